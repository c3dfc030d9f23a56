"""The peer of `heads.edge_scores`: EAP-IG written the way Hanna et al.'s EAP-IG code computes it, on
TransformerLens 4's hooks (its TransformerBridge around a copy of the same transformers model).

    python benchmarks/circuits_peer.py --n 20 --out benchmarks/results/circuits_peer.json

As in their `get_scores_eap_ig`: a `(B, T, senders, C)` matrix of activation differences is
filled by forward hooks (added on the corrupted run, subtracted on the clean run) at the
senders' outputs (`hook_embed`, each block's `attn.hook_result` per head, `hook_mlp_out`);
then `steps` forward/backward runs on clean with the input embedding interpolated toward
clean, where backward hooks at the receivers' inputs (`hook_q_input`, `hook_k_input`,
`hook_v_input` per head, `hook_mlp_in`, the last block's `hook_resid_post`) add
einsum(differences[:, :, :prefix], gradient) to the scores. The steps and the normalisation
follow multihead's definition (alpha = k / steps, k = 1..steps; a sum over rows, no mean)
so that the two are the same numbers; `--check` compares them to 1e-4 relative.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from multihead import heads
from multihead.files import write_json
from multihead.heads import tasks
from multihead.heads.edge_graph import Graph
from multihead.interop.loaders import load_model


def bridge_of(model):
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    arch = model.config.architectures[0] if getattr(model.config, "architectures", None) else type(model).__name__
    b = build_bridge_from_module(copy.deepcopy(model), arch, hf_config=model.config)  # it rewires what it is given
    b.set_use_split_qkv_input(True)
    b.set_use_attn_result(True)
    b.set_use_hook_mlp_in(True)
    return b


def peer_scores(b, graph: Graph, clean: torch.Tensor, corrupted: torch.Tensor, metric, steps: int) -> torch.Tensor:
    """(receivers, senders) scores, receivers and senders in multihead's graph order."""
    L, H, Hkv = graph.n_layers, graph.n_heads, graph.n_kv_heads
    B, T = clean.shape
    C = b.cfg.d_model
    diff = torch.zeros(B, T, len(graph.senders), C, dtype=torch.float64)
    scores = torch.zeros(len(graph.receivers), len(graph.senders), dtype=torch.float64)

    def act(index, sign):
        def hook(x, hook):
            x = x.detach().double()
            if x.dim() == 4:  # (B, T, H, C): a layer's heads
                diff[:, :, index:index + x.shape[2]] += sign * x
            else:
                diff[:, :, index] += sign * x
        return hook

    def fwd(sign):
        out = [("hook_embed", act(0, sign))]
        for layer in range(L):
            first = graph.first_sender(layer)
            out.append((f"blocks.{layer}.attn.hook_result", act(first, sign)))
            out.append((f"blocks.{layer}.hook_mlp_out", act(first + H, sign)))
        return out

    def grad_hook(r0, prefix):
        def hook(g, hook):
            g = g.detach().double()
            g = g if g.dim() == 4 else g.unsqueeze(2)  # (B, T, receivers, C)
            scores[r0:r0 + g.shape[2], :prefix] += torch.einsum("btsc,btrc->rs", diff[:, :, :prefix], g)
        return hook
    bwd = []
    per = graph.per_layer
    for layer in range(L):
        r0, first = layer * per, graph.first_sender(layer)
        bwd += [(f"blocks.{layer}.hook_q_input", grad_hook(r0, first)),
                (f"blocks.{layer}.hook_k_input", grad_hook(r0 + H, first)),
                (f"blocks.{layer}.hook_v_input", grad_hook(r0 + H + Hkv, first)),
                (f"blocks.{layer}.hook_mlp_in", grad_hook(r0 + H + 2 * Hkv, first + H))]
    bwd.append((f"blocks.{L - 1}.hook_resid_post", grad_hook(L * per, len(graph.senders))))
    with torch.no_grad():
        with b.hooks(fwd_hooks=fwd(1.0)):
            b(corrupted)
        e_corr = diff[:, :, 0].clone()
        with b.hooks(fwd_hooks=fwd(-1.0)):
            b(clean)
        e_clean = e_corr - diff[:, :, 0]

    for k in range(1, steps + 1):
        def interpolate(x, hook, k=k):
            new = e_clean if k == steps else e_corr + (k / steps) * (e_clean - e_corr)
            return new.to(x.dtype).requires_grad_(True)
        with b.hooks(fwd_hooks=[("hook_embed", interpolate)], bwd_hooks=bwd):
            metric(b(clean)).backward()
    return scores / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from machine_info import finish  # now: it takes the load at the start (benchmarks/ is on sys.path)
    lm = load_model("smollm2")
    model = lm.model
    task = tasks.ioi(args.n, seed=0, tokenizer=lm.tokenizer)
    ids, cids = task.clean["input_ids"], task.corrupted["input_ids"]
    # the rows are right-padded: in a causal model the padding comes after every real token and
    # the metric reads real tokens only, so both sides run the ids alone and give the same scores
    b = bridge_of(model)
    for p in b.parameters():
        p.requires_grad_(False)
    cfg = model.config
    graph = Graph(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    t = time.perf_counter()
    ours = heads.edge_scores(model, ids, cids, task.metric, method="eap-ig", steps=args.steps)
    t_ours = time.perf_counter() - t
    t = time.perf_counter()
    theirs = peer_scores(b, graph, ids, cids, task.metric, args.steps)
    t_peer = time.perf_counter() - t
    a, p = ours.vector(), EdgeScoresLike(graph, theirs)
    err = float((a - p).abs().max() / a.abs().max())
    res = {"model": "SmolLM2-135M-Instruct", "n": args.n, "steps": args.steps, "seconds_multihead": round(t_ours, 2),
           "seconds_peer": round(t_peer, 2), "speedup": round(t_peer / t_ours, 2), "max_relative_difference": err,
           "threads": torch.get_num_threads()}
    print(json.dumps(res, indent=1))
    if args.out:
        write_json(args.out, finish(res))


def EdgeScoresLike(graph: Graph, matrix: torch.Tensor) -> torch.Tensor:  # noqa: N802 (the matrix in edge order)
    return heads.EdgeScores(graph, matrix, "peer", 0).vector()


if __name__ == "__main__":
    main()

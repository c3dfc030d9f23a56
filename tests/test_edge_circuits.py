"""Edge patching and edge attribution (EAP, EAP-IG) against a reference on transformers' eager attention.

The reference is a residual-decomposed forward written with plain hooks on the model's own
modules, in float64: layer by layer, each receiver's input is summed from its senders'
outputs (kept: this run's, else the corrupted run's) plus the output projections' biases;
a layer's heads run in the model's own eager attention, with forward hooks replacing each
query/key/value head's slice of the projection by that of its own input, and a pre-hook on
the output projection reading z (each head's output: its z through its slice of the output
projection). The input sender is read at the first block's input.

Gemma 2 and 3 (a norm after the attention and after the MLP): a head's output is its share
of the normed sum, (1 + w) * o_h / rms(sum of the layer's o_h) with the rms of the same run,
checked here to sum to what the model's own post-attention norm returns. Their tiny configs
have a window shorter than the input, mixed layer types, query_pre_attn_scalar unlike the
head dim, and (Gemma 2) both softcaps small enough to bend the values.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from multihead import heads
from multihead.heads.edge_graph import Graph, edge_name, parse_edge

V, T, B = 40, 7, 3


class RMSNorm(torch.nn.Module):
    """transformers' RMSNorm in the input's dtype (theirs rounds through float32): float64 stays float64."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class GemmaNorm(torch.nn.Module):
    """Gemma's RMSNorm, (1 + w) * x / rms(x), in the input's dtype (theirs computes in float32)."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x):
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def eager64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager_attention_forward of the Llama family with the softmax in the inputs' dtype
    (theirs takes it in float32, which would bound a float64 comparison at float32's scale)."""
    G = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(G, dim=1), value.repeat_interleave(G, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    if kwargs.get("softcap") is not None:  # Gemma 2 hands its softcap over; Gemma 3 does not
        scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
    if attention_mask is None:  # no mask handed over: causal (and, for Mistral, the window) as eager's
        raise AssertionError("eager64 expects its mask from the model")
    mask = attention_mask[:, :, :, : key.shape[-2]]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


transformers.AttentionInterface.register("eager64", eager64)
transformers.AttentionMaskInterface.register("eager64", transformers.masking_utils.eager_mask)


def make_gemma(kind: str):
    common = dict(hidden_size=24, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=10, sliding_window=3,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"], vocab_size=V,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager64")
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(attn_logit_softcapping=2.0, final_logit_softcapping=3.0, **common)
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common))
    model = model.double().eval()
    for name, m in list(model.named_modules()):
        if type(m).__name__.endswith("RMSNorm"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, GemmaNorm(m))
    if kind == "gemma2":  # scores of order 1 (no query/key norm there), so that the softcap of 2 bends them
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(10)
                layer.self_attn.k_proj.weight.mul_(10)
    return model


def make(kind: str):
    torch.manual_seed({"gpt2": 0, "llama": 1, "qwen2": 2, "mistral": 3, "gemma2": 4, "gemma3": 5}[kind])
    if kind.startswith("gemma"):
        model = make_gemma(kind)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=16, n_layer=3, n_head=4, n_positions=16, vocab_size=V, bos_token_id=0,
                                      eos_token_id=0, attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
        extra = {"sliding_window": 4} if kind == "mistral" else {}
        cfg = cls[0](hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=V, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                     attn_implementation="eager64", **extra)
        model = cls[1](cfg)
    model = model.double().eval()
    if kind in ("llama", "qwen2", "mistral"):
        for layer in model.model.layers:
            layer.input_layernorm = RMSNorm(layer.input_layernorm)
            layer.post_attention_layernorm = RMSNorm(layer.post_attention_layernorm)
        model.model.norm = RMSNorm(model.model.norm)
    with torch.no_grad():  # visible biases and norms, so that a dropped constant would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.startswith("transformer.ln"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def pair(seed: int = 0, rows: int = B, length: int = T, changed: tuple[int, int] = (2, 4)):
    """Random clean ids and the corrupted ones: two positions changed, by 5 and by 7."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, V, (rows, length), generator=g)
    corrupted = clean.clone()
    for at, by in zip(changed, (5, 7)):
        corrupted[:, at] = (clean[:, at] + by) % (V - 1) + 1
    return clean, corrupted


def metric(logits):  # reads every position and the batch as a whole: no shortcut applies
    return (logits[:, -1, 3] - logits[:, -1, 5]).mean() + 0.1 * logits[:, :, 7].pow(2).mean()


class Reference:
    """The decomposed forward on hooks; outputs keyed by the graph's sender nodes."""

    def __init__(self, model):
        self.model = model
        self.gpt2 = model.config.model_type == "gpt2"
        self.gemma = model.config.model_type.startswith("gemma")
        self.layers = model.transformer.h if self.gpt2 else model.model.layers
        cfg = model.config
        self.H = cfg.n_head if self.gpt2 else cfg.num_attention_heads
        self.Hkv = self.H if self.gpt2 else cfg.num_key_value_heads
        self.graph = Graph(len(self.layers), self.H, self.Hkv)

    def parts(self, layer):
        lay = self.layers[layer]
        if self.gpt2:
            return lay.ln_1, lay.attn.c_proj, lay.ln_2, lay.mlp
        if self.gemma:  # the MLP's output as the residual receives it: after its post-feedforward norm
            return (lay.input_layernorm, lay.self_attn.o_proj, lay.pre_feedforward_layernorm,
                    lambda x: lay.post_feedforward_layernorm(lay.mlp(x)))
        return lay.input_layernorm, lay.self_attn.o_proj, lay.post_attention_layernorm, lay.mlp

    def input_of(self, ids):
        got = {}

        def read(m, args, kwargs):
            got["x"] = args[0] if args else kwargs["hidden_states"]
        hook = self.layers[0].register_forward_pre_hook(read, with_kwargs=True)
        try:
            with torch.no_grad():
                self.model(ids)
        finally:
            hook.remove()
        return got["x"]

    def bias(self, layer):
        b = self.parts(layer)[1].bias
        return 0 if b is None else b

    def heads_of(self, layer, ids, xq, xk, xv):
        """Each head's output (its z through its slice of the output projection) with each receiver's input."""
        ln, o_proj, _, _ = self.parts(layer)
        attn = self.layers[layer].attn if self.gpt2 else self.layers[layer].self_attn
        D = o_proj.weight.shape[0 if self.gpt2 else 1] // self.H

        def apply(proj, x):  # the projection's own weights (calling it from its hook would recurse)
            if self.gpt2:  # Conv1D: x @ W + b
                return x @ proj.weight + proj.bias
            return torch.nn.functional.linear(x, proj.weight, proj.bias)

        def sliced(proj, xs):  # each head's slice of the projection, from its own input
            return torch.cat([apply(proj, ln(x))[..., i * D:(i + 1) * D] for i, x in enumerate(xs)], dim=-1)
        hooks, got = [], {}
        if self.gpt2:
            C = self.H * D

            def fused(m, a, out):
                def part(j, xs):
                    lo = j * C
                    return torch.cat([apply(m, ln(x))[..., lo + i * D:lo + (i + 1) * D] for i, x in enumerate(xs)], -1)
                return torch.cat([part(0, xq), part(1, xk), part(2, xv)], dim=-1)
            hooks.append(attn.c_attn.register_forward_hook(fused))
        else:
            for proj, xs in ((attn.q_proj, xq), (attn.k_proj, xk), (attn.v_proj, xv)):
                hooks.append(proj.register_forward_hook(lambda m, a, out, xs=xs: sliced(m, xs)))

        class Stop(Exception):
            pass

        def read_z(m, a):
            got["z"] = a[0]
            raise Stop
        hooks.append(o_proj.register_forward_pre_hook(read_z))
        try:
            self.model(ids)
        except Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
        z = got["z"]  # (B, T, H * D)
        W = o_proj.weight.t() if self.gpt2 else o_proj.weight  # (C, H * D)
        out = [z[..., h * D:(h + 1) * D] @ W[:, h * D:(h + 1) * D].t() for h in range(self.H)]
        if not self.gemma:
            return out
        # each head's share of the post-attention norm of the layer's sum, that sum's rms in this run
        norm = self.layers[layer].post_attention_layernorm
        total = o_proj(z)
        shares = [(1 + norm.weight) * o * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + norm.eps) for o in out]
        torch.testing.assert_close(sum(shares), norm(total), rtol=1e-12, atol=1e-12)  # what the block adds
        return shares

    def run(self, ids, emb, corrupted=None, keep=None, weight=None, deltas=None):
        """Logits of the decomposed run; non-kept edges read `corrupted` (sender -> output).
        `weight`: {edge: eps} moves those edges' senders eps of the way to corrupted;
        `deltas`: receiver -> tensor added to its input (for gradients)."""
        g, out = self.graph, {"input": emb}

        def x_of(r):
            n = g.prefix[g.receiver_index[r]]
            total = 0
            for s in g.senders[:n]:
                v = out[s]
                if keep is not None and (s, r) not in keep:
                    v = corrupted[s]
                if weight and (s, r) in weight:
                    v = v + weight[(s, r)] * (corrupted[s] - v)
                total = total + v
            layer = r[1] if r != "logits" and r[0] == "mlp" else (g.n_layers if r == "logits" else r[0])
            for i in range(layer + (r != "logits" and r[0] == "mlp")):
                total = total + self.bias(i)
            if deltas is not None:
                total = total + deltas[r]
            return total
        for layer in range(g.n_layers):
            xq = [x_of((layer, h, "q")) for h in range(self.H)]
            xk = [x_of((layer, k, "k")) for k in range(self.Hkv)]
            xv = [x_of((layer, k, "v")) for k in range(self.Hkv)]
            for h, o in enumerate(self.heads_of(layer, ids, xq, xk, xv)):
                out[(layer, h)] = o
            _, _, ln2, mlp = self.parts(layer)
            out[("mlp", layer)] = mlp(ln2(x_of(("mlp", layer))))
        final = self.model.transformer.ln_f if self.gpt2 else self.model.model.norm
        logits = self.model.lm_head(final(x_of("logits")))
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return (logits if cap is None else torch.tanh(logits / cap) * cap), out

    def outputs(self, ids):
        with torch.no_grad():
            return self.run(ids, self.input_of(ids))

    def scores(self, clean, corrupted, steps):
        return reference_scores(self.graph, self.outputs(clean)[1], self.outputs(corrupted)[1], steps, metric,
                                lambda emb, deltas: self.run(clean, emb, deltas=deltas))


def reference_scores(g, out_c, out_x, steps, metric, run):
    """EAP-IG's scores as defined: (corrupted - clean outputs) . mean over steps of dm/dx_r, where
    `run(embedding, deltas)` is a reference forward whose receiver r reads its input plus deltas[r]."""
    e_c, e_x = out_c["input"], out_x["input"]
    total = {r: 0 for r in g.receivers}
    for k in range(1, steps + 1):
        emb = e_c if k == steps else e_x + (k / steps) * (e_c - e_x)
        deltas = {r: torch.zeros_like(e_c, requires_grad=True) for r in g.receivers}
        logits, _ = run(emb, deltas)
        grads = torch.autograd.grad(metric(logits), [deltas[r] for r in g.receivers])
        for r, gr in zip(g.receivers, grads):
            total[r] = total[r] + gr / steps
    return {(s, r): float(((out_x[s] - out_c[s]) * total[r]).sum()) for s, r in g.edges}


KINDS = ["gpt2", "llama", "qwen2"]


@pytest.fixture(scope="module", params=KINDS + ["mistral", "gemma2", "gemma3"])
def setup(request):
    model = make(request.param)
    model.requires_grad_(False)
    return request.param, model, Reference(model)


def test_graph_names_and_edges(setup):
    kind, model, ref = setup
    E = heads.edges(model)
    g = ref.graph
    assert len(E) == len(set(E)) == len(g)
    # input -> every receiver; a head of layer l -> receivers of later layers, m{l} and logits
    assert ("input", "logits") in E and ((0, 1), ("mlp", 0)) in E and ((0, 1), (1, 0, "q")) in E
    assert ((1, 1), (1, 0, "q")) not in E and (("mlp", 1), ("mlp", 1)) not in E and (("mlp", 0), (1, 1, "k")) in E
    n = 1 + g.n_layers * (g.n_heads + 1)
    per = g.n_heads + 2 * g.n_kv_heads
    want = sum(per * (1 + i * (g.n_heads + 1)) + 1 + i * (g.n_heads + 1) + g.n_heads for i in range(g.n_layers)) + n
    assert len(E) == want
    assert edge_name(((0, 1), (2, 1, "k"))) == "a0.h1->a2.g1<k>"
    assert edge_name(("input", (1, 3, "q"))) == "input->a1.h3<q>"
    assert edge_name((("mlp", 0), "logits")) == "m0->logits"
    for e in E:
        assert parse_edge(edge_name(e)) == e


def test_decomposition_reproduces_the_logits(setup):
    kind, model, ref = setup
    clean, _ = pair()
    with torch.no_grad():
        want = model(clean).logits
    got, _ = ref.outputs(clean)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_edge_patch_all_none_single_and_random(setup):
    kind, model, ref = setup
    tol = 1e-10
    clean, corrupted = pair(1)
    E = heads.edges(model)
    with torch.no_grad():
        m_clean, m_corr = float(metric(model(clean).logits)), float(metric(model(corrupted).logits))
    assert heads.edge_patch(model, clean, corrupted, metric, E) == pytest.approx(m_clean, rel=tol, abs=1e-12)
    assert heads.edge_patch(model, clean, corrupted, metric, []) == pytest.approx(m_corr, rel=tol, abs=1e-12)
    _, corr_out = ref.outputs(corrupted)
    rng = random.Random(0)
    singles = [("input", "logits"), ((0, 1), (2, 1, "k")), (("mlp", 1), (2, 3, "q")), ((2, 0), ("mlp", 2))]
    subsets = [set(rng.sample(E, k)) for k in (3, len(E) // 2 + 5, len(E) - 4)]  # bases: corrupted, mixed, patched
    for keep in [{e} for e in singles] + subsets:
        with torch.no_grad():
            want = float(metric(ref.run(clean, ref.input_of(clean), corr_out, keep)[0]))
        got = heads.edge_patch(model, clean, corrupted, metric, [edge_name(e) for e in keep], batch_size=2)
        assert got == pytest.approx(want, rel=tol, abs=1e-12), (kind, len(keep), got, want)


@pytest.mark.parametrize("steps", [1, 3])
def test_edge_scores_equal_the_reference(setup, steps):
    kind, model, ref = setup
    if kind in ("mistral", "qwen2", "gemma2") and steps == 3:
        pytest.skip("steps are the same code on every model: GPT-2 and Llama cover them (keeps the suite lean)")
    clean, corrupted = pair(2)
    want = ref.scores(clean, corrupted, steps)
    for batch_size in (None, 2):  # one chunk; chunks with the metric's gradient from a first pass
        got = heads.edge_scores(model, clean, corrupted, metric, method="eap-ig", steps=steps, batch_size=batch_size)
        a = torch.tensor([got[e] for e in want], dtype=torch.float64)
        b = torch.tensor(list(want.values()), dtype=torch.float64)
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 1e-6, (kind, steps, batch_size, err)
    if steps == 1:
        eap = heads.edge_scores(model, clean, corrupted, metric, method="eap")
        assert torch.equal(eap.matrix, got.matrix) or float((eap.matrix - got.matrix).abs().max()) < 1e-12


def test_eap_is_the_derivative_of_edge_patching(setup):
    kind, model, ref = setup
    clean, corrupted = pair(3)
    scores = heads.edge_scores(model, clean, corrupted, metric, method="eap")
    _, corr_out = ref.outputs(corrupted)
    emb = ref.input_of(clean)
    eps = 1e-4  # central differences: an error of order eps^2
    for edge in [e for e, _ in scores.top(2)] + [((1, 2), (2, 0, "v"))]:
        with torch.no_grad():
            up = float(metric(ref.run(clean, emb, corr_out, weight={edge: eps})[0]))
            down = float(metric(ref.run(clean, emb, corr_out, weight={edge: -eps})[0]))
        d = (up - down) / (2 * eps)
        assert scores[edge] == pytest.approx(d, rel=1e-6, abs=1e-10), (edge, scores[edge], d)

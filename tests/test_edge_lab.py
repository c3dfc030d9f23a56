"""Edge patching and edge attribution on multihead's own decoder (`LabTransformer`), against a reference
written with plain hooks on the model's own modules.

The reference is a residual-decomposed forward in float64: layer by layer, each receiver's input is
summed from its senders' outputs (kept: this run's, else the corrupted run's) plus the output
projections' biases; a layer's heads run in the layer's own `multihead.Attention` forward (its RoPE and
its kernel), with forward hooks replacing each query/key/value head's slice of the projection by that of
its own input through the block's norm, and a pre-hook on the output projection reading z (each head's
output: its z through its slice of the output projection). The input sender is read at the first
block's input (token plus learned position embedding).

Models: MHA with learned positions, RMSNorm and biases; GQA with RoPE and LayerNorm; MQA attention-only
(no MLP senders or receivers); MLA (a key and a value receiver per query head: the reference's hook on the
up-projection gives head h's key from the latent of its key receiver's input and its value from its value
receiver's, on the module's naive path).
"""

from __future__ import annotations

import random

import pytest
import torch

from multihead import heads
from multihead.decoder import LabConfig, LabTransformer
from multihead.heads.edge_graph import Graph, edge_name, parse_edge
from test_edge_circuits import reference_scores

V, T, B = 40, 7, 3

CONFIGS = {
    "mha": dict(n_kv_heads=None, norm="rms", bias=True, positions="learned"),
    "gqa-rope": dict(n_kv_heads=2, norm="layer", bias=True, positions="rope"),
    "mqa-attn-only": dict(n_kv_heads=1, norm="rms", bias=False, positions="rope", mlp=False),
    "mla": dict(attention="mla", kv_rank=6, norm="rms", bias=True),
}


def make(kind: str) -> LabTransformer:
    torch.manual_seed(list(CONFIGS).index(kind))
    cfg = LabConfig(vocab_size=V, max_len=16, d_model=16, n_layers=3, n_heads=4, **CONFIGS[kind])
    model = LabTransformer(cfg).double().eval()
    with torch.no_grad():  # weights of unit gain (the lab's init is 0.02: logits near zero); visible biases and
        for name, p in model.named_parameters():  # norms, so that a dropped constant would show
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if name.endswith("emb.weight") else p.shape[1] ** -0.5)
    return model


def pair(seed: int = 0, rows: int = B, length: int = T):
    """Random clean ids and the corrupted ones: positions 2 and 4 changed, by 5 and by 7."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, V, (rows, length), generator=g)
    corrupted = clean.clone()
    for at, by in ((2, 5), (4, 7)):
        corrupted[:, at] = (clean[:, at] + by) % (V - 1) + 1
    return clean, corrupted


def metric(logits):  # reads every position and the batch as a whole
    return (logits[:, -1, 3] - logits[:, -1, 5]).mean() + 0.1 * logits[:, :, 7].pow(2).mean()


class Stop(Exception):
    pass


class Reference:
    """The decomposed forward on hooks; outputs keyed by the graph's sender nodes."""

    def __init__(self, model: LabTransformer):
        self.model = model
        cfg = model.cfg
        self.H = cfg.n_heads
        self.Hkv = cfg.n_heads if cfg.n_kv_heads is None or cfg.attention == "mla" else cfg.n_kv_heads
        self.graph = Graph(cfg.n_layers, self.H, self.Hkv, mlp=cfg.mlp)

    def input_of(self, ids):
        got = {}

        def read(m, args):
            got["x"] = args[0]
        hook = self.model.blocks[0].register_forward_pre_hook(read)
        try:
            with torch.no_grad():
                self.model(ids)
        finally:
            hook.remove()
        return got["x"]

    def bias(self, layer):
        b = self.model.blocks[layer].attn.o_proj.bias
        return 0 if b is None else b

    def heads_of(self, layer, xq, xk, xv):
        """Each head's output (its z through its slice of the output projection) with each receiver's input."""
        block = self.model.blocks[layer]
        attn, ln = block.attn, block.norm1
        mla = self.model.cfg.attention == "mla"
        D = attn.head_dim

        def sliced(proj, xs, width=D):  # each head's slice of the projection, from its own input
            return torch.cat([torch.nn.functional.linear(ln(x), proj.weight, proj.bias)[..., i * width:(i + 1) * width]
                              for i, x in enumerate(xs)], dim=-1)

        def up(m, a, out):  # MLA: head i's key from the latent of its key input, its value from its value input's
            R, Dv = attn.kv_rank, attn.v_head_dim

            def latent(x):
                return attn.kv_a_norm(attn.kv_a_proj(ln(x))[..., :R])
            parts = []
            for i in range(self.H):
                head = slice(i * (D + Dv), (i + 1) * (D + Dv))
                parts += [torch.nn.functional.linear(latent(xk[i]), m.weight[head][:D]),
                          torch.nn.functional.linear(latent(xv[i]), m.weight[head][D:])]
            return torch.cat(parts, dim=-1)  # (B, S, H * (D + Dv)), each head's [k ; v]
        got = {}

        def read_z(m, a):
            got["z"] = a[0]
            raise Stop
        if mla:
            hooks = [attn.q_proj.register_forward_hook(lambda m, a, out: sliced(m, xq, D + attn.rope_dim)),
                     attn.kv_b_proj.register_forward_hook(up)]
        else:
            hooks = [proj.register_forward_hook(lambda m, a, out, xs=xs: sliced(m, xs))
                     for proj, xs in ((attn.q_proj, xq), (attn.k_proj, xk), (attn.v_proj, xv))]
        hooks.append(attn.o_proj.register_forward_pre_hook(read_z))
        try:  # the module's own forward: its RoPE and its kernel on the hooked projections (MLA: the naive path)
            attn(ln(xq[0]), absorb=False) if mla else attn(ln(xq[0]))
        except Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
        Dv = attn.v_head_dim if mla else D
        z, W = got["z"], attn.o_proj.weight  # (B, T, H * Dv), (C, H * Dv)
        return [z[..., h * Dv:(h + 1) * Dv] @ W[:, h * Dv:(h + 1) * Dv].t() for h in range(self.H)]

    def run(self, emb, corrupted=None, keep=None, weight=None, deltas=None):
        """Logits of the decomposed run; non-kept edges read `corrupted` (sender -> output).
        `weight`: {edge: eps} moves those edges' senders eps of the way to corrupted;
        `deltas`: receiver -> tensor added to its input (for gradients)."""
        g, out = self.graph, {"input": emb}

        def x_of(r, layers_before):
            total = 0
            for s in g.senders[:g.prefix[g.receiver_index[r]]]:
                v = out[s]
                if keep is not None and (s, r) not in keep:
                    v = corrupted[s]
                if weight and (s, r) in weight:
                    v = v + weight[(s, r)] * (corrupted[s] - v)
                total = total + v
            for i in range(layers_before):  # the output projections' biases of the layers run before
                total = total + self.bias(i)
            return total if deltas is None else total + deltas[r]
        for layer in range(g.n_layers):
            xq = [x_of((layer, h, "q"), layer) for h in range(self.H)]
            xk = [x_of((layer, k, "k"), layer) for k in range(self.Hkv)]
            xv = [x_of((layer, k, "v"), layer) for k in range(self.Hkv)]
            for h, o in enumerate(self.heads_of(layer, xq, xk, xv)):
                out[(layer, h)] = o
            block = self.model.blocks[layer]
            if g.mlp:
                out[("mlp", layer)] = block.mlp(block.norm2(x_of(("mlp", layer), layer + 1)))
        return self.model.lm_head(self.model.norm_f(x_of("logits", g.n_layers))), out

    def outputs(self, ids):
        with torch.no_grad():
            return self.run(self.input_of(ids))

    def scores(self, clean, corrupted, steps):
        return reference_scores(self.graph, self.outputs(clean)[1], self.outputs(corrupted)[1], steps, metric,
                                lambda emb, deltas: self.run(emb, deltas=deltas))


@pytest.fixture(scope="module", params=list(CONFIGS))
def setup(request):
    model = make(request.param)
    model.requires_grad_(False)
    return request.param, model, Reference(model)


def test_graph_of_the_lab_decoder(setup):
    kind, model, ref = setup
    E = heads.edges(model)
    g = ref.graph
    assert len(E) == len(set(E)) == len(g)
    per = g.n_heads + 2 * g.n_kv_heads
    if g.mlp:
        n = 1 + g.n_layers * (g.n_heads + 1)
        want = sum(per * (1 + i * (g.n_heads + 1)) + 1 + i * (g.n_heads + 1) + g.n_heads for i in range(g.n_layers))
        assert (("mlp", 0), (1, 0, "k")) in E
    else:  # no MLP node at all: a head of layer l reaches the receivers of later layers and the logits
        n = 1 + g.n_layers * g.n_heads
        want = sum(per * (1 + i * g.n_heads) for i in range(g.n_layers))
        assert not any("mlp" in (s if isinstance(s, tuple) else ()) for e in E for s in e)
    assert len(E) == want + n
    assert ((0, 1), (1, 0, "q")) in E and ((1, 1), (1, 0, "q")) not in E and ("input", "logits") in E
    assert ((0, 1), (2, g.n_kv_heads - 1, "v")) in E and ((0, 1), (2, g.n_kv_heads, "v")) not in E
    for e in E:
        assert parse_edge(edge_name(e)) == e
    clean, corrupted = pair(9)
    j = heads.edge_scores(model, clean, corrupted, metric, method="eap").to_json()
    assert j["graph"] == {"n_layers": 3, "n_heads": 4, "n_kv_heads": ref.Hkv, "mlp": g.mlp}
    assert len(j["scores"]) == len(E)


def test_decomposition_reproduces_the_logits(setup):
    kind, model, ref = setup
    clean, _ = pair()
    with torch.no_grad():
        want = model(clean)
    got, _ = ref.outputs(clean)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_edge_patch_all_none_single_and_random(setup):
    kind, model, ref = setup
    tol = 1e-10
    clean, corrupted = pair(1)
    E = heads.edges(model)
    with torch.no_grad():
        m_clean, m_corr = float(metric(model(clean))), float(metric(model(corrupted)))
    # the two ends are the clean and the corrupted forward themselves
    assert heads.edge_patch(model, clean, corrupted, metric, E) == pytest.approx(m_clean, rel=tol, abs=1e-12)
    assert heads.edge_patch(model, clean, corrupted, metric, []) == pytest.approx(m_corr, rel=tol, abs=1e-12)
    assert m_clean != pytest.approx(m_corr, rel=1e-3)  # the corruption moves the metric: the ends differ
    _, corr_out = ref.outputs(corrupted)
    emb = ref.input_of(clean)
    mlp = ("mlp", 1) if ref.graph.mlp else (1, 0)
    singles = [("input", "logits"), ((0, 1), (2, 0, "k")), (mlp, (2, 3, "q")), ((2, 0), "logits"),
               ((1, 2), (2, ref.Hkv - 1, "v"))]
    rng = random.Random(0)
    subsets = [set(rng.sample(E, k)) for k in (3, len(E) // 2 + 5, len(E) - 4)]  # bases: corrupted, mixed, patched
    for keep in [{e} for e in singles] + subsets:
        with torch.no_grad():
            want = float(metric(ref.run(emb, corr_out, keep)[0]))
        got = heads.edge_patch(model, clean, corrupted, metric, [edge_name(e) for e in keep], batch_size=2)
        assert got == pytest.approx(want, rel=tol, abs=1e-12), (kind, len(keep), got, want)


@pytest.mark.parametrize("steps", [1, 3])
def test_edge_scores_equal_the_reference(setup, steps):
    kind, model, ref = setup
    if kind in ("mqa-attn-only", "mla") and steps == 3:
        pytest.skip("steps are the same code on every model: MHA and GQA cover them (keeps the suite lean)")
    clean, corrupted = pair(2)
    want = ref.scores(clean, corrupted, steps)
    b = torch.tensor(list(want.values()), dtype=torch.float64)
    assert float(b.abs().max()) > 1e-3  # the scores are not all zero: the comparison below has something to see
    for batch_size in (None, 2):  # one chunk; chunks with the metric's gradient from a first pass
        got = heads.edge_scores(model, clean, corrupted, metric, method="eap-ig", steps=steps, batch_size=batch_size)
        a = torch.tensor([got[e] for e in want], dtype=torch.float64)
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 1e-6, (kind, steps, batch_size, err)
    if steps == 1:
        eap = heads.edge_scores(model, clean, corrupted, metric, method="eap")
        assert float((eap.matrix - got.matrix).abs().max()) <= 1e-12 * float(b.abs().max())


def test_eap_is_the_derivative_of_edge_patching(setup):
    kind, model, ref = setup
    clean, corrupted = pair(3)
    scores = heads.edge_scores(model, clean, corrupted, metric, method="eap")
    _, corr_out = ref.outputs(corrupted)
    emb = ref.input_of(clean)
    eps = 1e-4  # central differences: an error of order eps^2
    for edge in [e for e, _ in scores.top(2)] + [((1, 2), (2, 0, "v"))]:
        with torch.no_grad():
            up = float(metric(ref.run(emb, corr_out, weight={edge: eps})[0]))
            down = float(metric(ref.run(emb, corr_out, weight={edge: -eps})[0]))
        d = (up - down) / (2 * eps)
        assert scores[edge] == pytest.approx(d, rel=1e-6, abs=1e-10), (edge, scores[edge], d)


def test_faithfulness_curve_ends_and_mean_ablation():
    model = make("gqa-rope")
    clean, corrupted = pair(4)
    scores = heads.edge_scores(model, clean, corrupted, metric, method="eap")
    curve = heads.faithfulness_curve(model, clean, corrupted, metric, scores, fractions=[0.1, 1.0])
    with torch.no_grad():
        m_clean, m_corr = float(metric(model(clean))), float(metric(model(corrupted)))
    assert curve["metric_clean"] == pytest.approx(m_clean, rel=1e-10)
    assert curve["metric_corrupted"] == pytest.approx(m_corr, rel=1e-10)
    assert curve["faithfulness"][-1] == pytest.approx(1.0, rel=1e-9)
    kept = [e for e, _ in scores.top(curve["edges_kept"][0])]
    assert curve["metric_kept"][0] == pytest.approx(heads.edge_patch(model, clean, corrupted, metric, kept), rel=1e-12)
    # mean ablation: every non-kept edge carries its sender's mean over the reference rows and positions
    ref = Reference(model)
    _, out = ref.outputs(corrupted)
    means = {s: o.mean((0, 1), keepdim=True).expand_as(o) for s, o in out.items()}
    keep = set(kept)
    with torch.no_grad():
        want = float(metric(ref.run(ref.input_of(clean), means, keep)[0]))
    got = heads.edge_patch(model, clean, None, metric, kept, ablation="mean", reference=corrupted)
    assert got == pytest.approx(want, rel=1e-10)


def test_foreign_hooks_and_long_inputs_are_refused():
    model = make("mha")
    clean, corrupted = pair(5)
    handle = model.blocks[0].attn.register_forward_hook(lambda m, a, out: out * 2)
    try:  # the edge forward never calls the attention module: its hook would change the model's output only
        with pytest.raises(ValueError, match=r"forward hook on blocks\.0\.attn \(Attention\)"):
            heads.edge_patch(model, clean, corrupted, metric, [])
    finally:
        handle.remove()
    handle = model.blocks[0].norm1.register_forward_hook(lambda m, a, out: out * 2)
    try:  # a norm it calls keeps its hook, in the model's forward and in the edge forward alike
        with torch.no_grad():
            want = float(metric(model(clean)))
        assert heads.edge_patch(model, clean, corrupted, metric, heads.edges(model)) == pytest.approx(want, rel=1e-10)
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="clean has 17 positions; this model reads at most 16"):
        heads.edge_patch(model, torch.ones(1, 17, dtype=torch.long), torch.ones(1, 17, dtype=torch.long), metric, [])


def test_latent_attention_with_rope_and_a_query_latent():
    """MLA with its decoupled RoPE key (one per key receiver, from that receiver's own latent input) and a query
    latent: keeping every edge is the model's own forward, keeping none its corrupted forward, and EAP-IG with one
    step is EAP; the receivers are a key and a value per query head."""
    from multihead import LatentAttention

    torch.manual_seed(7)
    cfg = LabConfig(vocab_size=V, max_len=16, d_model=16, n_layers=2, n_heads=4, attention="mla", kv_rank=6,
                    rope_dim=4, mlp=False)
    model = LabTransformer(cfg).double().eval()
    for block in model.blocks:  # a query latent (q_rank), which the lab's config does not set
        block.attn = LatentAttention(16, 4, 6, q_rank=5, head_dim=4, rope_dim=4, causal=True).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.normal_(
                0.0, 1.0 if name.endswith("emb.weight") else p.shape[1] ** -0.5)
    clean, corrupted = pair(6)
    E = heads.edges(model)
    assert ((0, 3), (1, 3, "k")) in E and ((0, 3), (1, 4, "k")) not in E and len(E) == len(Graph(2, 4, 4, mlp=False))
    with torch.no_grad():
        m_clean, m_corr = float(metric(model(clean))), float(metric(model(corrupted)))
    assert m_clean != pytest.approx(m_corr, rel=1e-3)
    assert heads.edge_patch(model, clean, corrupted, metric, E) == pytest.approx(m_clean, rel=1e-10, abs=1e-12)
    assert heads.edge_patch(model, clean, corrupted, metric, []) == pytest.approx(m_corr, rel=1e-10, abs=1e-12)
    eap = heads.edge_scores(model, clean, corrupted, metric, method="eap")
    ig1 = heads.edge_scores(model, clean, corrupted, metric, method="eap-ig", steps=1, batch_size=2)
    scale = float(eap.matrix.abs().max())
    assert scale > 1e-3 and float((eap.matrix - ig1.matrix).abs().max()) <= 1e-10 * scale

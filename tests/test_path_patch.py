"""heads.path_patch / path_patch_scan against a hand-written three-step patch on
transformers' *eager* attention (the same weights), on small random GPT-2 (its fused qkv
Conv1D), Llama (GQA), Mistral and Qwen2 (GQA, biases on q/k/v), Gemma 2 and 3 (a norm after
the attention, softcaps, QK-norm, window and global layers):

1. forward pre-hooks on the output projection read every head's z (its slice of the
   projection's input) on clean and on corrupted;
2. the same pre-hooks pin every head's slice to corrupted, the senders' to clean, while
   forward hooks on the q/k/v projections read the receivers' slices of their outputs;
3. forward hooks put those slices into the corrupted run; the direct path ("logits") adds
   the senders' clean-minus-corrupted results, computed from the output projection's
   weights by hand (Gemma: the change of the post-attention norm's output), to the final
   norm's input; and, with no formula, the run with every other path held.

Also: the scan against one reference patch per head; a sender at or above every receiver
gives the corrupted metric exactly; in a model whose MLPs are zeroed, one sender's paths to
every later head (q, k and v) plus the logits compose to patching its z (`patch_scan`),
where nothing else can carry its effect; lab models (multihead modules, MLA included).
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import hooks
from multihead import heads
from multihead.heads import path_patching

pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

import multihead.interop.hf  # noqa: E402, F401  (registers "multihead")

V = 40
ARCHS = ["gpt2", "llama", "mistral", "qwen2", "gemma2", "gemma3"]
TOL = 1e-5


def _build(name: str, layers: int = 3):
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=32, vocab_size=V,
                                      initializer_range=0.25, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, vocab_size=V,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                      initializer_range=0.25)
        if name == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        elif name == "mistral":
            model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=6))
        elif name == "qwen2":
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        elif name == "gemma2":  # post-norms, attention and final softcaps, window on every other layer
            model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
                **common, sliding_window=6, attn_logit_softcapping=5.0, final_logit_softcapping=8.0))
        else:  # gemma3: post-norms, QK-norm, sliding and global layers with their own RoPE
            layer_types = ["sliding_attention", "full_attention"] * layers
            model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
                **common, sliding_window=6, layer_types=layer_types[:layers]))
        if name.startswith("gemma"):  # norms' gains start at 1 + 0: random ones show a norm misapplied
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "norm" in pname:
                        p.normal_(0, 0.5)
    model = model.eval()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    model.set_attn_implementation("multihead")
    return model, eager


def _pair(seed: int = 1, B: int = 2, T: int = 9, changed: int | None = None):
    """Random clean and corrupted ids; with `changed`, corrupted is clean with that one position
    changed (an IOI-style pair: the scan skips the shared prefix)."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, V, (B, T), generator=g)
    corrupted = torch.randint(3, V, (B, T), generator=g)
    if changed is not None:
        corrupted = clean.clone()
        corrupted[:, changed] = (clean[:, changed] + 1 + torch.arange(B)) % (V - 3) + 3
    return clean, corrupted


def _metric(logits):
    return (logits[:, -1, 3] - logits[:, -1, 4]).mean() + 0.1 * logits[:, -2, 5].sum()


# ---------------------------------------------------------------- the hand-written reference


class _Eager:
    """An eager transformers model read and written through plain torch hooks."""

    def __init__(self, model):
        self.model = model
        self.gpt2 = isinstance(model, transformers.GPT2LMHeadModel)
        cfg = model.config
        if self.gpt2:
            self.attn = [b.attn for b in model.transformer.h]
            self.final_norm = model.transformer.ln_f
            self.H, self.Hkv, self.D = cfg.n_head, cfg.n_head, cfg.n_embd // cfg.n_head
        else:
            self.attn = [layer.self_attn for layer in model.model.layers]
            self.final_norm = model.model.norm
            self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        blocks = model.transformer.h if self.gpt2 else model.model.layers
        self.mlps = [b.mlp for b in blocks]
        # Gemma 2/3 normalise the attention's output before the residual sum
        self.post_norms = [getattr(b, "post_attention_layernorm", None) if hasattr(b, "post_feedforward_layernorm")
                           else None for b in blocks]

    def out_proj(self, layer):
        a = self.attn[layer]
        return a.c_proj if self.gpt2 else a.o_proj

    def result(self, layer, head, z):
        """A head's share of the output projection, by hand: z (B, T, H * D) -> (B, T, C)."""
        D = self.D
        zh = z[..., head * D:(head + 1) * D]
        W = self.out_proj(layer).weight
        return zh @ (W[head * D:(head + 1) * D, :] if self.gpt2 else W[:, head * D:(head + 1) * D].T)

    def proj(self, layer, via, head):
        """(module, slice of its output's last dim) holding a head's q, k or v."""
        a, D = self.attn[layer], self.D
        if self.gpt2:
            C = self.H * D
            off = {"q": 0, "k": C, "v": 2 * C}[via]
            return a.c_attn, slice(off + head * D, off + (head + 1) * D)
        return getattr(a, f"{via}_proj"), slice(head * D, (head + 1) * D)

    def run(self, inputs, hooks):
        handles = []
        try:
            for module, kind, fn in hooks:
                handles.append(module.register_forward_pre_hook(fn) if kind == "pre" else
                               module.register_forward_hook(fn))
            with torch.no_grad():
                return (self.model(**inputs) if isinstance(inputs, dict) else self.model(inputs)).logits
        finally:
            for h in handles:
                h.remove()

    def zs(self, inputs):
        z = {}
        hooks = [(self.out_proj(i), "pre", lambda m, a, i=i: z.__setitem__(i, a[0].clone()))
                 for i in range(len(self.attn))]
        self.run(inputs, hooks)
        return z

    def path_patch(self, clean, corrupted, metric, senders, receivers, logits=False):
        """receivers: [(layer, head, via)]."""
        zc, zx = self.zs(clean), self.zs(corrupted)
        D = self.D

        def pin(m, args, i):
            x = zx[i].clone()
            for layer, h in senders:
                if layer == i:
                    x[..., h * D:(h + 1) * D] = zc[i][..., h * D:(h + 1) * D]
            return (x,)
        kept = {}

        def read(m, args, out, key, sl):
            kept[key] = out[..., sl].clone()
        hooks = [(self.out_proj(i), "pre", lambda m, a, i=i: pin(m, a, i)) for i in range(len(self.attn))]
        for r in receivers:
            module, sl = self.proj(r[0], r[2], r[1])
            hooks.append((module, "post", lambda m, a, out, r=r, sl=sl: read(m, a, out, r, sl)))
        self.run(corrupted, hooks)

        def put(m, args, out, key, sl):
            out = out.clone()
            out[..., sl] = kept[key]
            return out
        hooks = []
        for r in receivers:
            module, sl = self.proj(r[0], r[2], r[1])
            hooks.append((module, "post", lambda m, a, out, r=r, sl=sl: put(m, a, out, r, sl)))
        if logits:
            delta = sum(self.direct(layer, [h for i, h in senders if i == layer], zc[layer], zx[layer])
                        for layer in {i for i, _ in senders})
            hooks.append((self.final_norm, "pre", lambda m, a: (a[0] + delta,)))
        return float(metric(self.run(corrupted, hooks)))

    def direct(self, layer, hs, zc, zx):
        """What a layer's senders `hs`, their z clean, add to the corrupted residual stream: the
        output projection's change, or for a post-norm block its norm's (the heads together)."""
        norm = self.post_norms[layer]
        if norm is None:
            return sum(self.result(layer, h, zc) - self.result(layer, h, zx) for h in hs)
        mixed, D = zx.clone(), self.D
        for h in hs:
            mixed[..., h * D:(h + 1) * D] = zc[..., h * D:(h + 1) * D]
        with torch.no_grad():
            o = self.out_proj(layer)
            return norm(o(mixed)) - norm(o(zx))

    def direct_by_holding(self, clean, corrupted, metric, senders):
        """The direct path by its definition, with no formula: the corrupted run with every
        head's z held at its corrupted value but the senders' (clean) and every MLP's output
        held at the corrupted run's, so the senders reach the logits through the residual
        stream only."""
        zc, zx = self.zs(clean), self.zs(corrupted)
        mlp = {}
        self.run(corrupted, [(m, "post", lambda m, a, out, i=i: mlp.__setitem__(i, out.clone()))
                             for i, m in enumerate(self.mlps)])
        D = self.D

        def pin(i):
            x = zx[i].clone()
            for layer, h in senders:
                if layer == i:
                    x[..., h * D:(h + 1) * D] = zc[i][..., h * D:(h + 1) * D]
            return (x,)
        hooks = [(self.out_proj(i), "pre", lambda m, a, i=i: pin(i)) for i in range(len(self.attn))]
        hooks += [(m, "post", lambda m, a, out, i=i: mlp[i]) for i, m in enumerate(self.mlps)]
        return float(metric(self.run(corrupted, hooks)))


def _receivers(receivers, via):
    return [r if len(r) == 3 else (*r, via) for r in receivers]


# ---------------------------------------------------------------- tests


CASES = [
    ("q", [(0, 1)], [(1, 0), (2, 3)]),
    ("q", [(0, 1), (1, 2)], [(2, 0), (2, 3), (1, 1)]),
    ("k", [(0, 3)], [(1, 1), (2, 0)]),
    ("k", [(0, 0), (1, 3)], [(2, 1)]),
    ("v", [(0, 2)], [(1, 0), (2, 1)]),
    ("v", [(1, 0), (0, 1)], [(2, 0), (2, 1)]),
    ("q", [(0, 1), (2, 2)], "logits"),
    ("q", [(1, 3)], [(2, 0, "q"), (2, 1, "k"), (2, 0, "v"), "logits"]),
]


@pytest.mark.parametrize("name", ARCHS)
def test_path_patch_equals_the_hand_written_three_steps_on_eager_attention(name):
    model, eager = _build(name)
    ref = _Eager(eager)
    clean, corrupted = _pair()
    with torch.no_grad():
        base = float(_metric(eager(corrupted).logits))
    moved = 0.0
    for via, senders, receivers in CASES:
        got = heads.path_patch(model, clean, corrupted, _metric, senders, receivers, via=via)
        if receivers == "logits":
            want = ref.path_patch(clean, corrupted, _metric, senders, [], logits=True)
        else:
            rs = [r for r in receivers if r != "logits"]
            want = ref.path_patch(clean, corrupted, _metric, senders, _receivers(rs, via),
                                  logits="logits" in receivers)
        assert abs(got - want) < TOL * (1 + abs(want)), f"{name} via {via} {senders} -> {receivers}: " \
                                                        f"{got} vs eager {want} ({abs(got - want):.2e})"
        moved = max(moved, abs(want - base))
    assert moved > 1e-2, f"{name}: no path moved the metric ({moved:.2e}): the check could not fail"


@pytest.mark.parametrize("name", ARCHS)
def test_the_direct_path_is_the_run_with_every_other_path_held(name):
    """On pre-norm and post-norm (Gemma 2/3) blocks alike: the senders' direct path equals the
    corrupted run in which every other head's z and every MLP's output are held at their
    corrupted values. Two heads of one layer together are not the sum of each alone where a
    norm follows the attention."""
    model, eager = _build(name)
    ref = _Eager(eager)
    clean, corrupted = _pair(7)
    with torch.no_grad():
        base = float(_metric(eager(corrupted).logits))
    moved = 0.0
    for senders in ([(1, 2)], [(0, 1), (2, 3)], [(1, 0), (1, 2)]):
        got = heads.path_patch(model, clean, corrupted, _metric, senders, "logits")
        want = ref.direct_by_holding(clean, corrupted, _metric, senders)
        assert abs(got - want) < TOL * (1 + abs(want)), f"{name} {senders}: {got} vs held {want}"
        moved = max(moved, abs(want - base))
    assert moved > 1e-2, f"{name}: no direct path moved the metric ({moved:.2e}): the check could not fail"
    scan = heads.path_patch_scan(model, clean, corrupted, _metric, "logits")
    want = torch.tensor([[ref.direct_by_holding(clean, corrupted, _metric, [(layer, h)]) for h in range(4)]
                         for layer in range(3)])
    diff = (scan - want).abs().max().item()
    assert diff < TOL * (1 + want.abs().max().item()), f"{name}: scan vs held, max diff {diff:.2e}"


# the scan reports no count of prefix skips made: a subclass installed in its place counts them
class _CountSkips(path_patching._Skip):
    made = 0

    def __init__(self, *args):
        super().__init__(*args)
        type(self).made += 1


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("via, receivers", [("q", [(2, 0), (2, 3)]), ("k", [(1, 1), (2, 0)]), ("v", [(2, 1)]),
                                            ("q", "logits"), ("q", [(1, 2, "q"), (2, 1, "v"), "logits"])])
@pytest.mark.parametrize("changed", [None, 5])
def test_path_patch_scan_equals_one_hand_written_patch_per_sender(name, via, receivers, changed, monkeypatch):
    """changed=5: one token changed, so the scan skips the shared prefix [0, 5)."""
    model, eager = _build(name)
    ref = _Eager(eager)
    clean, corrupted = _pair(3, changed=changed)
    monkeypatch.setattr(path_patching, "_Skip", _CountSkips)  # counts the skips made (see _CountSkips)
    _CountSkips.made = 0
    scan = heads.path_patch_scan(model, clean, corrupted, _metric, receivers, via=via)
    assert _CountSkips.made == (changed is not None), f"{name}: prefix skip taken {_CountSkips.made} times"
    assert scan.shape == (3, 4)
    logits = "logits" in receivers
    rs = _receivers([r for r in receivers if r != "logits"] if receivers != "logits" else [], via)
    want = torch.tensor([[ref.path_patch(clean, corrupted, _metric, [(layer, h)], rs, logits=logits)
                          for h in range(4)] for layer in range(3)])
    diff = (scan - want).abs().max().item()
    assert diff < TOL * (1 + want.abs().max().item()), f"{name} via {via}: scan vs eager, max diff {diff:.2e}"
    assert (want - want[-1, 0]).abs().max() > 1e-3 or logits, "every cell the same: the check could not fail"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_sender_at_or_above_every_receiver_gives_the_corrupted_metric_exactly(name):
    model, _ = _build(name)
    clean, corrupted = _pair(4)
    with torch.no_grad():
        base = float(_metric(model(corrupted).logits))
    for via, senders, receivers in [("q", [(1, 0)], [(1, 2), (0, 3)]), ("k", [(2, 1), (2, 3)], [(2, 0), (1, 1)]),
                                    ("v", [(1, 3)], [(0, 0)])]:
        assert heads.path_patch(model, clean, corrupted, _metric, senders, receivers, via=via) == base
    scan = heads.path_patch_scan(model, clean, corrupted, _metric, [(1, 0), (1, 2)], via="q")
    assert (scan[1:] == base).all(), scan
    assert (scan[0] != base).any(), "layer 0 reaches layer 1: its row must move"


def _without_mlps(model):
    """The same model with every MLP's output zeroed: attention is all a head's effect can go through."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for m in model.modules():
            for name in ("c_proj", "down_proj"):
                lin = getattr(m, name, None)
                if lin is not None and type(m).__name__.endswith("MLP"):
                    lin.weight.zero_()
                    if getattr(lin, "bias", None) is not None:
                        lin.bias.zero_()
    return model


@pytest.mark.parametrize("name", ARCHS)
def test_all_paths_of_one_sender_compose_to_patching_its_z(name):
    """Without MLPs, a head of layer L-2 acts on the logits through layer L-1's q, k and v and
    directly, nothing else: all those paths at once equal patching its z. From layer 0 of
    three, the paths through layer 1 to layer 2 are missing: the two must then differ."""
    model, _ = _build(name)
    model = _without_mlps(model)
    clean, corrupted = _pair(5)
    z = heads.patch_scan(model, clean, corrupted, _metric, what="z")
    cfg = model.config
    H = cfg.num_attention_heads if name != "gpt2" else cfg.n_head
    Hkv = cfg.num_key_value_heads if name != "gpt2" else H
    n = 3

    def all_paths(layer):
        later = [(i, h, "q") for i in range(layer + 1, n) for h in range(H)]
        later += [(i, h, via) for i in range(layer + 1, n) for h in range(Hkv) for via in ("k", "v")]
        return later + ["logits"]
    for layer in (1, 2):
        for h in range(H):
            got = heads.path_patch(model, clean, corrupted, _metric, [(layer, h)], all_paths(layer))
            assert abs(got - z[layer, h].item()) < TOL * (1 + abs(got)), \
                f"{name} sender {layer}.{h}: all paths {got} vs its z patched {z[layer, h].item()}"
    gaps = [abs(heads.path_patch(model, clean, corrupted, _metric, [(0, h)], all_paths(0)) - z[0, h].item())
            for h in range(H)]
    assert max(gaps) > 1e-4, f"{name}: from layer 0 the composition misses paths, yet it equals z ({gaps})"
    # the scan carries several receivers' inputs too
    scan = heads.path_patch_scan(model, clean, corrupted, _metric, all_paths(1))
    diff = (scan[1] - z[1]).abs().max().item()
    assert diff < TOL * (1 + z[1].abs().max().item()), f"{name}: scan of all paths vs z, max diff {diff:.2e}"


def test_path_patch_leaves_the_model_as_it_was():
    model, _ = _build("llama")
    clean, corrupted = _pair(6)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(corrupted).logits
    heads.path_patch_scan(model, clean, corrupted, _metric, [(2, 0), (2, 1, "k"), "logits"])
    with pytest.raises(ValueError):
        heads.path_patch(model, clean, corrupted, _metric, [(0, 9)], [(1, 0)])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    with torch.no_grad():
        assert torch.equal(model(corrupted).logits, before)
    hooked = [m for m in model.modules() if any(hooks(m)[:2])]
    assert not hooked, f"hooks left on {[type(m).__name__ for m in hooked]}"


def test_errors_name_what_was_received():
    model, _ = _build("llama")
    clean, corrupted = _pair(7)
    cases = [
        (dict(senders=[(0, 1)], receivers=[(1, 0)], via="z"), ValueError, "via must be one of"),
        (dict(senders=[(0, 1)], receivers="everything"), ValueError, "'everything'"),
        (dict(senders=[(0, 1)], receivers=[]), ValueError, "receivers is empty"),
        (dict(senders=[], receivers=[(1, 0)]), ValueError, "senders is empty"),
        (dict(senders=[(0, 4)], receivers=[(1, 0)]), ValueError, "sender head 4 out of range in layer 0"),
        (dict(senders=[(0, 1)], receivers=[(1, 2)], via="k"), ValueError, "receiver head 2 (via 'k') out of range"),
        (dict(senders=[(5, 1)], receivers=[(1, 0)]), ValueError, "layer(s) [5] out of range"),
        (dict(senders=[(0, 1)], receivers=[(1, 0, "x")]), ValueError, "received (1, 0, 'x')"),
        (dict(senders="0.1", receivers=[(1, 0)]), TypeError, "received '0.1'"),
    ]
    for kw, err, text in cases:
        with pytest.raises(err) as info:
            heads.path_patch(model, clean, corrupted, _metric, **kw)
        assert text in str(info.value), (kw, str(info.value))
    with pytest.raises(TypeError, match="metric must be callable"):
        heads.path_patch(model, clean, corrupted, 3, [(0, 1)], [(1, 0)])
    with pytest.raises(ValueError, match="same batch size"):
        heads.path_patch(model, clean[:1], corrupted, _metric, [(0, 1)], [(1, 0)])
    with pytest.raises(ValueError, match="metric must return a scalar"):
        heads.path_patch_scan(model, clean, corrupted, lambda lg: lg[:, -1], [(1, 0)])
    with pytest.raises(ValueError, match="variants_per_run"):
        heads.path_patch_scan(model, clean, corrupted, _metric, [(1, 0)], variants_per_run=0)
    eager = transformers.LlamaForCausalLM(model.config).eval()
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="attn_implementation"):
        heads.path_patch(eager, clean, corrupted, _metric, [(0, 1)], [(1, 0)])


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_lab_models_scan_equals_path_patch_one_sender_at_a_time(kind):
    from multihead.decoder import LabConfig, LabTransformer

    torch.manual_seed(0)
    extra = dict(attention="mla", kv_rank=8, rope_dim=4) if kind == "mla" else dict(n_kv_heads=2, positions="rope")
    cfg = LabConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=4, head_dim=8, max_len=16, **extra)
    model = LabTransformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # visible effects from a random init
    clean, corrupted = _pair(8, T=7)
    for via, receivers in [("q", [(2, 0), (1, 3)]), ("k", [(2, 1)]), ("v", [(1, 0), (2, 1)]), ("q", "logits")]:
        if via != "q" and kind == "mla":
            receivers = [(layer, h + 2) for layer, h in receivers]  # MLA: a key/value head per query head
        scan = heads.path_patch_scan(model, clean, corrupted, _metric, receivers, via=via, variants_per_run=3)
        loop = torch.tensor([[heads.path_patch(model, clean, corrupted, _metric, [(layer, h)], receivers, via=via)
                              for h in range(4)] for layer in range(3)])
        diff = (scan - loop).abs().max().item()
        assert diff < TOL * (1 + loop.abs().max().item()), f"{kind} via {via}: scan vs loop, max diff {diff:.2e}"
        assert (loop - loop[-1, 0]).abs().max() > 1e-4, f"{kind} via {via}: nothing moved"


# ---------------------------------------------------------------- the command line


WORDS = ["[UNK]", "[PAD]"] + "when mary and john went to the store gave a drink book sat on mat".split()
CLEAN = "when mary and john went to the store john gave a drink to"
CORRUPTED = "when mary and john went to the store mary gave a drink to"


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("llama")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, vocab_size=len(WORDS),
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.25,
                                   max_position_embeddings=32, bos_token_id=None, eos_token_id=None, pad_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(path)
    return path


def _cli(*argv) -> int:
    import argparse

    from multihead.heads.path_cli import add_path_arguments, run_path

    parser = argparse.ArgumentParser(prog="multihead heads")
    add_path_arguments(parser.add_subparsers(dest="heads_command"))
    return run_path(parser.parse_args(["path", *argv]))


@pytest.mark.parametrize("receivers, via", [("logits", "q"), ("2.1,2.3", "q"), ("1.0,2.1", "v")])
def test_cli_path_json_equals_path_patch_scan(capsys, llama_folder, receivers, via):
    import json

    pair = ["--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", "mary", "--wrong", "john"]
    assert _cli("--model", str(llama_folder), *pair, "--receivers", receivers, "--via", via, "--json") == 0
    r = json.loads(capsys.readouterr().out)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_folder).eval()
    model.set_attn_implementation("multihead")
    tok = transformers.AutoTokenizer.from_pretrained(llama_folder)
    clean, corrupted = tok(CLEAN, return_tensors="pt"), tok(CORRUPTED, return_tensors="pt")
    mary, john = WORDS.index("mary"), WORDS.index("john")

    def metric(logits):  # what transformers' own LM head says at the last token
        return (logits[:, -1, mary] - logits[:, -1, john]).mean()
    rs = "logits" if receivers == "logits" else [tuple(map(int, x.split("."))) for x in receivers.split(",")]
    want = heads.path_patch_scan(model, clean, corrupted, metric, rs, via=via)
    got = torch.tensor(r["table"])
    assert (got - want).abs().max() < 1e-5, (got, want)
    with torch.no_grad():
        assert abs(r["metric_corrupted"] - float(metric(model(**corrupted).logits))) < 1e-5
    assert r["top"][0]["effect"] == max((t["effect"] for t in r["top"]), key=abs)


def test_cli_path_table_png_and_html(capsys, llama_folder, tmp_path):
    pair = ["--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", "mary", "--wrong", "john"]
    png, html = tmp_path / "p.png", tmp_path / "p.html"
    assert _cli("--model", str(llama_folder), *pair, "--receivers", "2.0", "--png", str(png), "--html",
                str(html)) == 0
    out = capsys.readouterr().out
    assert "path to 2.0 via q" in out and "top heads" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and "<table>" in html.read_text()


@pytest.mark.parametrize("argv, message", [
    (["--receivers", "9-6"], "'9-6' is not layer.head"),
    (["--receivers", "9.6"], "layer(s) [9] out of range"),
    (["--receivers", "2.2", "--via", "k"], "receiver head 2 (via 'k') out of range"),
    (["--receivers", "logits", "--task", "ioi"], "drop --clean"),
    (["--receivers", "logits", "--n", "3"], "add --task ioi"),
])
def test_cli_path_mistakes_are_one_line_errors(llama_folder, argv, message):
    from multihead.cli import user_message

    pair = ["--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", "mary", "--wrong", "john"]
    with pytest.raises(ValueError) as info:
        _cli("--model", str(llama_folder), *pair, *argv)
    assert message in str(info.value) and "\n" not in user_message(info.value), str(info.value)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_two_threads_path_scanning_one_model_get_the_tables_of_a_scan_alone(name):
    """The path scan's hooks act only in the thread that installed them: two scans at once
    (one with the prefix skip, one without) give exactly what each gives alone."""
    import threading

    model, _ = _build(name)
    jobs = [(_pair(3, changed=5), [(2, 1)], "q"), (_pair(4), "logits", "q")]
    alone = [heads.path_patch_scan(model, *pair, _metric, rec, via=via) for pair, rec, via in jobs]
    got, errors = {}, []
    start = threading.Barrier(2)

    def scan(i):
        pair, rec, via = jobs[i]
        try:
            start.wait()
            for r in range(2):
                got[i, r] = heads.path_patch_scan(model, *pair, _metric, rec, via=via)
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(repr(err))

    threads = [threading.Thread(target=scan, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 4
    for (i, r), table in got.items():
        assert torch.equal(table, alone[i]), f"{name}: thread {i} round {r} differs by {(table - alone[i]).abs().max()}"

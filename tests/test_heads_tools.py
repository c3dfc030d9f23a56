"""multihead.heads: attribution_scan, importance and prune against their definitions.

- attribution_scan: the formula metric(corr) + sum (z_clean - z_corr) * dmetric/dz written
  with plain torch hooks on o_proj's input; and exact where the metric is linear in z.
- importance: Michel et al.'s head mask written by hand (a ones vector multiplying o_proj's
  input per head), |dloss/dxi| summed over batches, layers L2-normalized.
- prune: the pruned model computes what the ablated one does (float64 multihead modules;
  a Llama saved and reloaded by stock transformers); refusals say why.
"""

from __future__ import annotations

import pytest
import torch

from multihead import heads
from multihead.attention import Attention
from multihead.decoder import LabConfig, LabTransformer
from multihead.latent import LatentAttention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _lab(**kw):
    torch.manual_seed(0)
    return LabTransformer(LabConfig(vocab_size=40, max_len=16, n_layers=2, n_heads=4, **kw)).eval()


def _metric(logits):
    return logits[:, -1, :5].sum() - logits[:, -1, 5:9].sum()


def _tokens(seed):
    return torch.randint(0, 40, (3, 8), generator=torch.Generator().manual_seed(seed))


def test_attribution_scan_equals_its_formula_written_with_plain_hooks():
    m = _lab(n_kv_heads=2)
    clean, corr = _tokens(1), _tokens(2)
    got = heads.attribution_scan(m, clean, corr, _metric)
    attns = [b.attn for b in m.blocks]
    zs = {}
    hooks = [a.o_proj.register_forward_pre_hook(lambda mod, args, i=i: zs.__setitem__(i, args[0]))
             for i, a in enumerate(attns)]
    with torch.no_grad():
        m(clean)
    z_clean = {i: z.clone() for i, z in zs.items()}
    value = _metric(m(corr))
    grads = torch.autograd.grad(value, [zs[0], zs[1]])
    for h in hooks:
        h.remove()
    for i in range(2):
        delta = (z_clean[i] - zs[i].detach()).view(3, 8, 4, -1)
        want = value.item() + (delta * grads[i].view(3, 8, 4, -1)).sum((0, 1, 3))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in m.parameters())


def test_attribution_scan_is_exact_where_the_metric_is_linear_in_z():
    torch.manual_seed(0)
    m = Attention(16, 4, causal=True).double()
    clean, corr = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    metric = lambda y: y[:, -1].sum()  # noqa: E731  (o_proj is linear in z)
    exact = heads.patch_scan(m, clean, corr, metric)
    approx = heads.attribution_scan(m, clean, corr, metric)
    torch.testing.assert_close(approx, exact, rtol=0, atol=1e-6)


def test_importance_equals_michel_et_al_head_mask_by_hand():
    m = _lab()
    batches = [_tokens(s) for s in range(3)]

    def loss(model, x):
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())

    got = heads.importance(m, batches, loss, normalize=False)
    got_n = heads.importance(m, batches, loss)
    xi = [torch.ones(4, requires_grad=True) for _ in m.blocks]
    hooks = [b.attn.o_proj.register_forward_pre_hook(
        lambda mod, args, i=i: ((args[0].view(*args[0].shape[:2], 4, -1) * xi[i][:, None]).flatten(2),))
        for i, b in enumerate(m.blocks)]
    want = torch.zeros(2, 4)
    for x in batches:
        g = torch.autograd.grad(loss(m, x), xi)
        want += torch.stack([t.abs() for t in g])
    for h in hooks:
        h.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_n, want / want.norm(dim=1, keepdim=True), rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in m.parameters())
    with pytest.raises(ValueError, match="batches is empty"):
        heads.importance(m, [], loss)


# ----------------------------------------------------------------------- prune


@pytest.mark.parametrize("removed,shape", [([1], (3, 3)), ([0, 1], (2, 1)), ([1, 3], (2, 2)), ([0, 1, 2], (1, 1))])
def test_pruned_attention_equals_the_ablated_one(removed, shape):
    torch.manual_seed(0)
    m = Attention(32, 4, 2, causal=True, bias=True).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    pairs = [(0, h) for h in removed]
    with heads.ablate(m, pairs):
        want = m(x)
    heads.prune(m, pairs)
    assert (m.n_heads, m.n_kv_heads) == shape and m.q_proj.out_features == shape[0] * m.head_dim
    torch.testing.assert_close(m(x), want, rtol=0, atol=1e-12)


def test_pruned_latent_attention_and_lab_models_equal_the_ablated_ones():
    torch.manual_seed(0)
    m = LatentAttention(32, 4, 8, head_dim=8, rope_dim=4, causal=True, q_rank=12).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with heads.ablate(m, [(0, 1), (0, 3)]):
        want = m(x)
    heads.prune(m, [(0, 1), (0, 3)])
    assert m.n_heads == 2
    torch.testing.assert_close(m(x), want, rtol=0, atol=1e-12)
    for kw in ({}, dict(attention="mla", kv_rank=8, rope_dim=4)):
        lab = _lab(**kw).double()
        pairs = [(0, 0), (1, 2), (1, 3)]
        with heads.ablate(lab, pairs):
            want = lab(_tokens(1))
        heads.prune(lab, pairs)
        torch.testing.assert_close(lab(_tokens(1)), want, rtol=0, atol=1e-10)


def test_prune_refuses_before_changing_anything():
    m = _lab()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="every head of layer 1"):
        heads.prune(m, [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3)])
    with pytest.raises(ValueError, match="out of range"):
        heads.prune(m, [(0, 0), (5, 0)])
    assert m.state_dict().keys() == state.keys() and all(torch.equal(v, state[k]) for k, v in m.state_dict().items())
    alibi = Attention(16, 2, causal=True, alibi=True)
    with pytest.raises(ValueError, match="ALiBi"):
        heads.prune(alibi, [(0, 1)])


transformers_cases = pytest.mark.parametrize("removed,counts", [
    ([1, 3, 5, 7], (4, 2)),  # two heads of each group
    ([4, 5, 6, 7], (4, 1)),  # a whole KV group
])


@transformers_cases
def test_pruned_llama_saves_and_loads_in_stock_transformers_equal_to_the_ablated_model(tmp_path, removed, counts):
    transformers = pytest.importorskip("transformers")
    import multihead.interop.hf  # noqa: F401

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=50,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=32, attention_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("multihead")
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    pairs = [(layer, h) for layer in range(2) for h in removed]
    with heads.ablate(model, pairs), torch.no_grad():
        want = model(x).logits
    heads.prune(model, pairs)
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert (back.config.num_attention_heads, back.config.num_key_value_heads) == counts
    with torch.no_grad():
        got = back(x).logits
    assert (got - want).abs().max() < 1e-5, f"max diff {(got - want).abs().max():.2e}"


def test_prune_refuses_what_a_transformers_config_cannot_hold():
    transformers = pytest.importorskip("transformers")
    import multihead.interop.hf  # noqa: F401

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=20))
    with pytest.raises(ValueError, match="no head_dim.*ablate"):
        heads.prune(gpt2, [(0, 1)])
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=20, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="uneven"):
        heads.prune(llama, [(0, 0), (1, 0)])
    with pytest.raises(ValueError, match="different head counts"):
        heads.prune(llama, [(0, 0), (0, 1)])
    odd = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=20, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="would not hold 3 query.*hidden size"):
        heads.prune(odd, [(0, 1)])
    assert llama.model.layers[0].self_attn.q_proj.out_features == 32  # untouched

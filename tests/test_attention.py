"""multihead.Attention against nn.MultiheadAttention, the NumPy reference, and itself."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import multihead as mh
from conftest import assert_close
from multihead import masks
from multihead import reference as R
from multihead.interop.torch import from_torch, to_torch


def ref_forward(attn: mh.Attention, x, context=None, mask=None, causal=None):
    """The NumPy reference with the module's weights (nn.Linear holds W^T)."""
    w = lambda lin: lin.weight.detach().double().numpy().T  # noqa: E731
    b = lambda lin: None if lin.bias is None else lin.bias.detach().double().numpy()  # noqa: E731
    return R.gqa_forward(
        x.double().numpy(), w(attn.q_proj), w(attn.k_proj), w(attn.v_proj), w(attn.o_proj),
        attn.n_heads, attn.n_kv_heads, mask=mask, causal=attn.causal if causal is None else causal,
        b_q=b(attn.q_proj), b_k=b(attn.k_proj), b_v=b(attn.v_proj), b_o=b(attn.o_proj),
        context=None if context is None else context.double().numpy(),
    )


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(4, 4, None), (8, 2, None), (8, 1, None), (6, 3, 5)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_numpy_reference(n_heads, n_kv_heads, head_dim, causal, bias):
    attn = mh.Attention(24, n_heads, n_kv_heads, head_dim=head_dim, causal=causal, bias=bias).double()
    x = torch.randn(3, 7, 24, dtype=torch.float64)
    assert_close(attn(x), ref_forward(attn, x))


def test_cross_attention_equals_reference():
    attn = mh.Attention(16, 4, 2, context_dim=10).double()
    x, ctx = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 9, 10, dtype=torch.float64)
    keep = torch.tensor([[True] * 9, [True] * 4 + [False] * 5])
    out = attn(x, ctx, mask=masks.padding(keep=keep))
    assert_close(out, ref_forward(attn, x, ctx, mask=keep.numpy()[:, None, None, :]))


def _mha_pair(E=32, H=4, kdim=None, bias=True, batch_first=True):
    mha = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=kdim, batch_first=batch_first).double().eval()
    return mha, from_torch(mha).eval()


@pytest.mark.parametrize("bias", [True, False])
def test_equals_nn_multihead_attention_self(bias):
    mha, attn = _mha_pair(bias=bias)
    x = torch.randn(3, 6, 32, dtype=torch.float64)
    ref, ref_w = mha(x, x, x, average_attn_weights=False)
    out, w = attn(x, return_weights=True)
    assert_close(out, ref)
    assert_close(w, ref_w)


def test_equals_nn_multihead_attention_cross_kdim_and_seq_first():
    mha, attn = _mha_pair(kdim=12, batch_first=False)
    x, ctx = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 8, 12, dtype=torch.float64)
    ref, _ = mha(x.transpose(0, 1), ctx.transpose(0, 1), ctx.transpose(0, 1))
    assert_close(attn(x, ctx), ref.transpose(0, 1))


def test_equals_nn_multihead_attention_key_padding_and_causal():
    mha, _ = _mha_pair()
    attn = from_torch(mha, causal=True).eval()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])  # torch: True = padding
    causal_tm = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    ref, _ = mha(x, x, x, key_padding_mask=kpm, attn_mask=causal_tm, need_weights=False)
    out = attn(x, mask=masks.from_key_padding_mask(kpm))
    assert_close(out, ref)


def test_fully_padded_sequence_is_zero_where_torch_gives_nan():
    mha, attn = _mha_pair()
    x = torch.randn(2, 4, 32, dtype=torch.float64)
    kpm = torch.tensor([[False] * 4, [True] * 4])  # the second sequence is all padding
    ref, _ = mha(x, x, x, key_padding_mask=kpm)
    assert torch.isnan(ref[1]).all()  # torch's documented NaN (need_weights=True path)
    out = attn(x, mask=masks.from_key_padding_mask(kpm))
    assert torch.isfinite(out).all()
    assert_close(out[1], attn.o_proj.bias.expand(4, 32))  # attention output 0 -> only the out bias
    assert_close(out[0], ref[0])


def test_to_torch_round_trip_is_exact():
    attn = mh.Attention(32, 4, context_dim=20)
    back = from_torch(to_torch(attn, batch_first=False))
    for name, p in attn.state_dict().items():
        assert torch.equal(p, back.state_dict()[name]), name


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = mh.Attention(32, 8, 2).double()
    mha = mh.Attention(32, 8).double()
    G, D = 4, 4
    with torch.no_grad():
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.o_proj.load_state_dict(gqa.o_proj.state_dict())
        for src, dst in ((gqa.k_proj, mha.k_proj), (gqa.v_proj, mha.v_proj)):
            # kv head j serves query heads j*G .. j*G+G-1: repeat each head's rows G times
            dst.weight.copy_(src.weight.view(2, 1, D, 32).expand(2, G, D, 32).reshape(32, 32))
            dst.bias.copy_(src.bias.view(2, 1, D).expand(2, G, D).reshape(32))
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    assert_close(gqa(x, mask=masks.causal()), mha(x, mask=masks.causal()))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("rope", [None, "half", "interleaved", "partial"])
def test_incremental_decoding_equals_full_forward(n_kv_heads, rope):
    rotary = {None: None, "half": True, "interleaved": mh.RotaryEmbedding(8, interleaved=True),
              "partial": mh.RotaryEmbedding(4, base=500000.0)}[rope]
    attn = mh.Attention(32, 4, n_kv_heads, causal=True, rope=rotary).double().eval()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    full = attn(x)
    cache = attn.new_cache(2, 16)
    steps = [attn(x[:, :3], cache=cache)]  # a prefill chunk, then one token at a time
    steps += [attn(x[:, t : t + 1], cache=cache) for t in range(3, 10)]
    assert cache.length == 10
    assert_close(torch.cat(steps, dim=1), full)


def test_cross_attention_cache_reuses_the_context():
    attn = mh.Attention(16, 4, 2, context_dim=12).double()
    x, ctx = torch.randn(2, 4, 16, dtype=torch.float64), torch.randn(2, 7, 12, dtype=torch.float64)
    full = attn(x, ctx)
    cache = attn.new_cache(2, 7)
    outs = [attn(x[:, t : t + 1], ctx, cache=cache) for t in range(4)]
    assert cache.length == 7  # filled once
    assert_close(torch.cat(outs, 1), full)


def test_weights_subset_from_module_and_dropout_in_training():
    attn = mh.Attention(32, 8, 4, dropout=0.5)
    x = torch.randn(2, 6, 32)
    attn.eval()
    out, w = attn(x, return_weights=[2])
    out_all, w_all = attn(x, return_weights=True)
    assert_close(w, w_all[:, [2]])
    assert_close(out, out_all)
    attn.train()
    torch.manual_seed(0)
    a = attn(x)
    torch.manual_seed(1)
    b = attn(x)
    assert (a - b).abs().max() > 1e-3  # dropout is live in training
    out_tr, w_tr = attn(x, return_weights=[0])  # falls to "math" (weights + dropout)
    assert torch.allclose(w_tr.sum(-1), torch.ones(2, 1, 6), atol=1e-5)


def test_head_sharding_infers_local_heads():
    """Split q/k/v column-wise and o row-wise into two shards, as tensor parallelism does:
    each shard runs the unchanged forward on its local heads, the outputs sum to the whole."""
    attn = mh.Attention(32, 8, 4, bias=False).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    full = attn(x, mask=masks.causal())
    total = 0
    for shard in range(2):
        part = copy.deepcopy(attn)
        rows_q = slice(shard * 16, (shard + 1) * 16)  # 4 of 8 query heads, D = 4
        rows_kv = slice(shard * 8, (shard + 1) * 8)  # 2 of 4 kv heads
        part.q_proj = nn.Linear(32, 16, bias=False).double()
        part.k_proj = nn.Linear(32, 8, bias=False).double()
        part.v_proj = nn.Linear(32, 8, bias=False).double()
        part.o_proj = nn.Linear(16, 32, bias=False).double()
        with torch.no_grad():
            part.q_proj.weight.copy_(attn.q_proj.weight[rows_q])
            part.k_proj.weight.copy_(attn.k_proj.weight[rows_kv])
            part.v_proj.weight.copy_(attn.v_proj.weight[rows_kv])
            part.o_proj.weight.copy_(attn.o_proj.weight[:, rows_q])
        total = total + part(x, mask=masks.causal())
    assert_close(total, full)


def test_bfloat16_module_close_to_float64():
    attn = mh.Attention(64, 8, 2, causal=True)
    x = torch.randn(2, 16, 64)
    ref = ref_forward(attn, x)
    out = copy.deepcopy(attn).to(torch.bfloat16)(x.bfloat16())
    assert_close(out.float(), ref, torch.bfloat16, atol=5e-2)


def test_decode_step_under_torch_compile():
    attn = mh.Attention(32, 4, 2, causal=True, rope=True).eval()
    x = torch.randn(1, 12, 32)
    ref_cache = attn.new_cache(1, 16)
    ref = [attn(x[:, t : t + 1], cache=ref_cache) for t in range(12)]
    cache = attn.new_cache(1, 16)

    compiled = []  # one entry per graph dynamo hands to the backend (public backend API)

    def counting_backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    @torch.compile(dynamic=True, backend=counting_backend)
    def step(tok):
        return attn(tok, cache=cache)

    torch._dynamo.reset()
    outs, graphs = [], []
    with torch.no_grad():
        for t in range(12):
            outs.append(step(x[:, t : t + 1]))
            graphs.append(len(compiled))
    assert_close(torch.cat(outs, 1), torch.cat(ref, 1), atol=1e-5)
    # the cache position is a tensor, so one graph serves every step
    assert graphs[-1] == 1, f"graphs compiled after each step: {graphs}"
    assert cache.length == 12


def _heads_reference(attn, x, **kw):
    """The module's projections in float64, then reference.attention with its score mods."""
    B, T, _ = x.shape
    with torch.no_grad():
        q = attn.q_proj(x).view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2).numpy()
        k = attn.k_proj(x).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2).numpy()
        v = attn.v_proj(x).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2).numpy()
    heads = R.attention(q, k, v, causal=attn.causal, **kw)
    return R.combine_heads(heads) @ attn.o_proj.weight.detach().numpy().T + attn.o_proj.bias.detach().numpy()


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_module_equals_reference(heads, causal):
    attn = mh.Attention(24, *heads, causal=causal, softcap=0.5).double()
    x = 3 * torch.randn(2, 7, 24, dtype=torch.float64)  # scores well past the cap
    ref = _heads_reference(attn, x, softcap_cap=0.5)
    assert_close(attn(x), ref, what="softcap")
    plain = mh.Attention(24, *heads, causal=causal).double()
    plain.load_state_dict(attn.state_dict())
    assert (plain(x) - attn(x)).abs().max() > 1e-3  # the cap matters at these scores


@pytest.mark.parametrize("n_heads", [4, 6])
def test_alibi_module_equals_reference_and_decodes_with_a_cache(n_heads):
    attn = mh.Attention(24, n_heads, causal=True, alibi=True).double()
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    ref = _heads_reference(attn, x, alibi=R.alibi_slopes(n_heads))
    full = attn(x)
    assert_close(full, ref, what="alibi")
    cache = attn.new_cache(2, 9)
    steps = [attn(x[:, :4], cache=cache)] + [attn(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
    assert_close(torch.cat(steps, 1), full, what="alibi cached decode")


def test_sliding_window_and_softcap_with_a_rolling_cache():
    """Gemma-2's local layer: window + softcap, decoded through the rolling cache."""
    attn = mh.Attention(16, 4, 2, causal=True, sliding_window=3, softcap=1.0, rope=True).double()
    x = 2 * torch.randn(1, 10, 16, dtype=torch.float64)
    cache = attn.new_cache(1)
    out = torch.cat([attn(x[:, t : t + 1], cache=cache) for t in range(10)], 1)
    assert_close(out, attn(x), what="window + softcap, rolling cache")


@pytest.mark.parametrize("kwargs,match", [
    (dict(sliding_window=4), "sliding_window=4 is a causal window"),
    (dict(causal=True, sliding_window=0), "sliding_window must be an int >= 1"),
    (dict(softcap=0.0), "softcap must be a positive finite number"),
    (dict(softcap=float("inf")), "softcap must be a positive finite number"),
    (dict(alibi=1), "alibi must be True or False"),
    (dict(causal=True, alibi=True, softcap=5.0), "softcap and alibi together"),
])
def test_bad_layer_options(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        mh.Attention(16, 4, **kwargs)


def test_float64_input_to_a_float32_module_is_named():
    with pytest.raises(TypeError, match="x is torch.float64 but this module's weights are torch.float32"):
        mh.Attention(16, 4)(torch.randn(1, 3, 16, dtype=torch.float64))


def test_sliding_window_layer_combines_with_a_flex_callable_mask():
    """A plain flex mask_mod (top-left indices) given to a windowed layer keeps the window."""
    attn = mh.Attention(16, 4, causal=True, sliding_window=3).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    keep_even_keys = lambda b, h, q, kv: kv % 2 == 0  # noqa: E731
    allowed = masks.sliding_window(3).to_dense(1, 1, 8, 8)[0, 0].numpy() & (np.arange(8)[None, :] % 2 == 0)
    ref = _heads_reference(attn, x, mask=allowed)
    assert_close(attn(x, mask=keep_even_keys), ref, what="window & flex callable")


def test_sliding_window_decode_step_under_torch_compile():
    """The compiled step folds the window into its positional mask over the static buffer
    (keys at slots, not bottom-right positions) and equals eager decoding."""
    torch.manual_seed(0)
    attn = mh.Attention(16, 4, 2, causal=True, rope=True, sliding_window=3).eval()
    x = torch.randn(1, 8, 16)
    with torch.no_grad():
        ref = attn(x)
    cache = attn.new_cache(1, 8, rolling=False)

    @torch.compile(dynamic=True, backend=lambda gm, inputs: gm.forward)
    def step(tok):
        return attn(tok, cache=cache)

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.cat([step(x[:, t : t + 1]) for t in range(8)], 1)
    assert_close(out, ref, atol=1e-5, what="compiled windowed decode vs full forward")

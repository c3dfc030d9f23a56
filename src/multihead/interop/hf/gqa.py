"""Change `num_key_value_heads` of a trained Hugging Face model: MHA/GQA -> GQA/MQA.

`transformers_to_gqa(model, n_kv_heads, init="mean")` (what `multihead.convert.to_gqa`
calls for a transformers model; use that) returns a deep copy of a transformers model
whose attention layers have separate `k_proj` / `v_proj` Linear layers and whose config
carries `num_key_value_heads` (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2, Gemma3
text): in every such layer each group of key/value heads becomes one (mean-pooled, as
Ainslie et al. 2023; or the first of the group; or drawn afresh, see
`multihead.convert.to_gqa`), the Linear layers shrink to the new width, and the layer's
`num_key_value_groups` and the model's
`config.num_key_value_heads` follow. The result is an ordinary transformers model:
`save_pretrained` writes it and stock transformers loads it, eager attention included.

Details: docs/mla.md, "How `transformers_to_gqa` changes a model".
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

__all__ = ["kv_layers", "transformers_to_gqa"]


def kv_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every attention layer with k_proj and v_proj Linear
    layers and a head_dim: the layers `transformers_to_gqa` converts."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "k_proj", None), nn.Linear) and isinstance(getattr(m, "v_proj", None), nn.Linear)
            and isinstance(getattr(m, "head_dim", None), int)]


def _check(model: nn.Module, n_kv_heads) -> tuple[int, int]:
    """(n_heads, old n_kv_heads) of the model's config, after checking the request."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    H, old = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not isinstance(H, int) or not isinstance(old, int):
        raise TypeError(f"to_gqa: {name}'s config has no num_attention_heads / num_key_value_heads (a model whose "
                        "config nests them, such as a vision-language model, is not converted); valid: Llama, "
                        "Mistral, Qwen2, Qwen3, Gemma, Gemma2, Gemma3 text models")
    if old == 1:
        raise ValueError(f"to_gqa: {name} has one key/value head already (config.num_key_value_heads = 1, MQA"
                         + (": Gemma 3 270M is built so" if "Gemma3" in name else "")
                         + "); there are no heads to merge; valid: a model with more than one key/value head")
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 1 or old % n_kv_heads:
        valid = [d for d in range(1, old + 1) if old % d == 0]
        raise ValueError(f"n_kv_heads must divide the model's {old} key/value heads (config.num_key_value_heads); "
                         f"received {n_kv_heads!r}; valid: {', '.join(map(str, valid))}")
    layers = kv_layers(model)
    if not layers:
        raise TypeError(f"to_gqa: {name} has no attention layer with separate k_proj and v_proj Linear layers "
                        "(a fused qkv projection, as Phi-3's, is not converted); valid: Llama, Mistral, Qwen2, "
                        "Qwen3, Gemma, Gemma2, Gemma3 text models")
    for lname, m in layers:
        if m.k_proj.out_features != old * m.head_dim or m.v_proj.out_features != old * m.head_dim:
            raise ValueError(f"to_gqa: layer {lname} has {m.k_proj.out_features // m.head_dim} key heads, but the "
                             f"config says num_key_value_heads = {old}")
    return H, old


def _shrunk(lin: nn.Linear, n_kv_heads: int, head_dim: int, init: str, generator) -> nn.Linear:
    """A Linear with n_kv_heads * D outputs: lin's heads pooled group by group."""
    from multihead.conversion_parts import pool_kv_heads

    w = lin.weight
    new = nn.Linear(lin.in_features, n_kv_heads * head_dim, bias=lin.bias is not None, device=w.device,
                    dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(pool_kv_heads(w, n_kv_heads, head_dim, init=init, generator=generator))
        if lin.bias is not None:
            new.bias.copy_(pool_kv_heads(lin.bias, n_kv_heads, head_dim, init=init, generator=generator))
    new.train(lin.training)
    new.weight.requires_grad_(w.requires_grad)
    return new


def transformers_to_gqa(model: nn.Module, n_kv_heads: int, *, init: str | None = None,
                        generator: torch.Generator | None = None, calibration=None, tokenizer=None,
                        return_report: bool = False):
    """A copy of a transformers model with `n_kv_heads` key/value heads in every layer.

    Returns the model, or `(model, multihead.convert.ConversionReport)` with the relative
    K/V reconstruction error of every layer. The input model is untouched.

    Raises:
        ValueError: n_kv_heads does not divide config.num_key_value_heads; an unknown init.
        TypeError: a model without num_key_value_heads in its config, or without separate
            k_proj / v_proj layers.
    """
    from multihead.conversion_parts import GQA_INITS, ConversionReport, LayerConversion, grouped_kv_error
    from multihead.interop.hf.calibrated import calibration_ids, layer_stats

    init = init if init is not None else ("aligned" if calibration is not None else "mean")
    if init not in GQA_INITS:
        raise ValueError(f"init must be one of {', '.join(GQA_INITS)}; received {init!r}")
    if (init == "aligned") != (calibration is not None):
        raise ValueError(f"to_gqa: init='aligned' fits the merge on calibration tokens, and only it reads them; "
                         f"received init={init!r} with calibration={'None' if calibration is None else 'given'}; "
                         "valid: calibration=text (with tokenizer=) or token ids with init='aligned' (its default), "
                         "or no calibration")
    H, old = _check(model, n_kv_heads)
    stats = {} if calibration is None else layer_stats(model, kv_layers(model), calibration_ids(
        calibration, tokenizer, fn="to_gqa", vocab=model.get_input_embeddings().num_embeddings))
    new = copy.deepcopy(model)
    rows = []
    for name, attn in kv_layers(new):
        D = attn.head_dim
        if init == "aligned":
            rows.append(LayerConversion(name, _aligned_layer(attn, stats[name], n_kv_heads)))
        else:
            k, v = attn.k_proj, attn.v_proj
            attn.k_proj = _shrunk(k, n_kv_heads, D, init, generator)
            attn.v_proj = _shrunk(v, n_kv_heads, D, init, generator)
            rows.append(LayerConversion(name, grouped_kv_error((k.weight, v.weight, v.bias),
                                                               (attn.k_proj.weight, attn.v_proj.weight,
                                                                attn.v_proj.bias), D)))
        if hasattr(attn, "num_key_value_groups"):
            attn.num_key_value_groups = H // n_kv_heads
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = n_kv_heads
    for module in new.modules():  # the config object is shared by the layers; nested copies too
        config = getattr(module, "config", None)
        if getattr(config, "num_key_value_heads", None) == old:
            config.num_key_value_heads = n_kv_heads
    import multihead.interop.hf  # noqa: F401  (registers attn_implementation="multihead")

    report = ConversionReport("MQA" if n_kv_heads == 1 else f"GQA-{n_kv_heads}", init, tuple(rows))
    return (new, report) if return_report else new


# ------------------------------------------------------------ init "aligned": from calibration


def _aligned_keys(attn: nn.Module, st, t: int, m: int, G: int) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """New key head t from old heads t*m .. t*m + m - 1: (weight `(D, C)`, bias `(D,)` or None,
    a `(m, D/2)` complex: old head j's key pair f is ~ a[j, f] times the new one's, and the old
    heads' key maps as the new one gives them `(m*D, C)`).

    Per rotary pair f the old keys z_j = k_j,f + i k_j,f+D/2 (complex, `(N, m)`) are fitted by
    one shared complex feature w times a complex factor per old head, z_j ~ a_j w, the rank-1
    complex fit weighted by what the group's queries make of an error there (value_scale_h
    E||q_h^(f)||^2 summed over the old head's query heads); a scale and a turn within a pair
    commute with RoPE, so the queries take conj(a_j) and the score stays the rotated one."""
    Hkv, D = attn.k_proj.out_features // attn.head_dim, attn.head_dim
    half, C = D // 2, attn.q_proj.in_features
    old = range(t * m, (t + 1) * m)
    x = st.x.double()
    w_all = attn.k_proj.weight.detach().double().view(Hkv, D, C)[list(old)]  # (m, D, C)
    b_all = None if attn.k_proj.bias is None else attn.k_proj.bias.detach().double().view(Hkv, D)[list(old)]
    wz = torch.complex(w_all[:, :half], w_all[:, half:])  # (m, D/2, C)
    bz = None if b_all is None else torch.complex(b_all[:, :half], b_all[:, half:])  # (m, D/2)
    z = torch.einsum("nc,jfc->nfj", x.to(wz.dtype), wz) + (0 if bz is None else bz.T[None])  # (N, D/2, m)
    q2 = (st.q2[:, :half] + st.q2[:, half:]) * st.value_scale[:, None]  # (H, D/2)
    weight = torch.stack([q2[j * G:(j + 1) * G].sum(0) for j in old], dim=1).clamp(min=1e-30)  # (D/2, m)
    zs = z * weight.sqrt()[None]  # (N, D/2, m)
    gram = torch.einsum("nfa,nfb->fab", zs.conj(), zs)  # (D/2, m, m) Hermitian
    _, vecs = torch.linalg.eigh(gram)
    b = vecs[..., -1]  # (D/2, m): the top right singular vector of each pair's weighted fit
    coef = b * weight.sqrt()  # w = sum_j coef_j z_j
    new_w = torch.einsum("fj,jfc->fc", coef, wz)  # (D/2, C)
    new_b = None if bz is None else torch.einsum("fj,jf->f", coef, bz)
    a = (b.conj() / weight.sqrt()).T  # (m, D/2): z_j ~ a_j w
    weight_out = torch.cat([new_w.real, new_w.imag])  # (D, C)
    rec = a[:, :, None] * new_w[None]  # (m, D/2, C): each old head's key map, as the merged one gives it
    bias_out = None if new_b is None else torch.cat([new_b.real, new_b.imag])
    return weight_out, bias_out, a, torch.cat([rec.real, rec.imag], dim=1).reshape(-1, C)


def _aligned_values(attn: nn.Module, st, t: int, m: int, G: int
                    ) -> tuple[Tensor, Tensor | None, list[Tensor], Tensor]:
    """New value head t: (weight `(Dv, C)`, bias or None, B_j `(Dv, Dv)` per old head j with
    v_j ~ B_j v, and the old heads' value maps as the new one gives them `(m*Dv, C)`). The new
    value is the top principal subspace of the group's stacked old values in the metric of the
    output (old head j's error counts through sum_h W_o,h^T W_o,h over its query heads); B_j,
    least squares, goes into each query head's o_proj columns."""
    H, Hkv = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    C = attn.q_proj.in_features
    Dv = attn.v_proj.out_features // Hkv
    old = list(range(t * m, (t + 1) * m))
    x = st.x.double()
    wv = attn.v_proj.weight.detach().double().view(Hkv, Dv, C)[old]  # (m, Dv, C)
    bv = None if attn.v_proj.bias is None else attn.v_proj.bias.detach().double().view(Hkv, Dv)[old]
    v = torch.einsum("nc,jdc->njd", x, wv) + (0 if bv is None else bv[None])  # (N, m, Dv)
    wo = attn.o_proj.weight.detach().double().view(C, H, Dv).transpose(0, 1)  # (H, C, Dv)
    chol = []
    for j in old:
        metric = torch.einsum("gca,gcb->ab", wo[j * G:(j + 1) * G], wo[j * G:(j + 1) * G])
        metric = metric + 1e-9 * float(metric.diagonal().mean().clamp(min=1e-30)) * torch.eye(Dv, dtype=metric.dtype)
        chol.append(torch.linalg.cholesky(metric))
    L = torch.block_diag(*chol)  # (m*Dv, m*Dv)
    f = v.reshape(len(x), -1)  # (N, m*Dv)
    g = f @ L
    _, vecs = torch.linalg.eigh(g.T @ g)
    proj = (L @ vecs.flip(1)[:, :Dv]).T  # (Dv, m*Dv): u = proj f
    u = f @ proj.T  # (N, Dv)
    B = torch.linalg.lstsq(u, f).solution.T.view(m, Dv, Dv)  # v_j ~ B_j u
    pj = proj.view(Dv, m, Dv)
    new_w = torch.einsum("ejd,jdc->ec", pj, wv)
    new_b = None if bv is None else torch.einsum("ejd,jd->e", pj, bv)
    return new_w, new_b, list(B), torch.einsum("jde,ec->jdc", B, new_w).reshape(-1, C)


def _aligned_layer(attn: nn.Module, st, n_kv_heads: int) -> float:
    """Replace attn's k/v/q/o projections by the aligned merge (the functions above); return
    the relative error of the K/V map [W_k ; W_v] as the merged heads give it back."""
    from multihead.conversion_parts import relative_error
    from multihead.interop.hf.calibrated import turn_pairs

    D = attn.head_dim
    H, Hkv, C = attn.q_proj.out_features // D, attn.k_proj.out_features // D, attn.q_proj.in_features
    Dv = attn.v_proj.out_features // Hkv
    m, G = Hkv // n_kv_heads, H // Hkv
    normed = getattr(attn, "k_norm", None) is not None  # a normed key is not linear in x: keys mean-pooled
    kw, kb, vw, vb, mix, k_rec, v_rec = [], [], [], [], [], [], []
    turns = torch.ones(H, D // 2, dtype=torch.complex128)
    for t in range(n_kv_heads):
        if normed:
            kw.append(pool_rows(attn.k_proj.weight, Hkv, D, t, m))
            kb.append(None if attn.k_proj.bias is None else pool_rows(attn.k_proj.bias, Hkv, D, t, m))
            k_rec.append(kw[-1].repeat(m, 1))
        else:
            w, b, a, rec = _aligned_keys(attn, st, t, m, G)
            kw.append(w)
            kb.append(b)
            k_rec.append(rec)
            for i, j in enumerate(range(t * m, (t + 1) * m)):
                turns[j * G:(j + 1) * G] = a[i]
        w, b, B, rec = _aligned_values(attn, st, t, m, G)
        vw.append(w)
        vb.append(b)
        mix += B
        v_rec.append(rec)
    old = torch.cat([attn.k_proj.weight.detach().double(), attn.v_proj.weight.detach().double()])
    error = relative_error(old, torch.cat(k_rec + v_rec))
    dev, dtype = attn.q_proj.weight.device, attn.q_proj.weight.dtype
    with torch.no_grad():
        if not normed:
            wq = turn_pairs(attn.q_proj.weight.detach().double().view(H, D, C), turns)
            attn.q_proj.weight.copy_(wq.reshape(H * D, C))
            if attn.q_proj.bias is not None:
                attn.q_proj.bias.copy_(turn_pairs(attn.q_proj.bias.detach().double().view(H, D, 1), turns).reshape(-1))
        wo = attn.o_proj.weight.detach().double().view(C, H, Dv)
        wo = torch.stack([wo[:, h] @ mix[h // G] for h in range(H)], dim=1)  # (C, H, Dv)
        attn.o_proj.weight.copy_(wo.reshape(C, H * Dv))
    attn.k_proj = _linear(torch.cat(kw), None if kb[0] is None else torch.cat(kb), attn.k_proj, dev, dtype)
    attn.v_proj = _linear(torch.cat(vw), None if vb[0] is None else torch.cat(vb), attn.v_proj, dev, dtype)
    return error


def pool_rows(t: Tensor, Hkv: int, D: int, group: int, m: int) -> Tensor:
    """The mean of heads group*m .. group*m + m - 1 of a K/V weight `(Hkv*D, C)` or bias, float64."""
    return t.detach().double().view(Hkv, D, *t.shape[1:])[group * m:(group + 1) * m].mean(0)


def _linear(weight: Tensor, bias: Tensor | None, like: nn.Linear, device, dtype) -> nn.Linear:
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=device, dtype=dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    new.train(like.training)
    new.weight.requires_grad_(like.weight.requires_grad)
    return new

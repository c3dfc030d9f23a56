"""Conversions of trained attention layers between head layouts.

`from_torch` / `to_torch` (exact), `to_gqa` (mean-pooling, Ainslie et al., 2023, "GQA")
and `to_mla` (a truncated SVD of the stacked K/V projections; partial RoPE after MHA2MLA),
on one `Attention` layer or a whole model.

Details: docs/mla.md, "`multihead.convert`: the conversions and what they take".
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, replace

import torch
from torch import nn

from multihead.attention import Attention
from multihead.checks import check_divisible, check_int, check_positive_int
from multihead.conversion_parts import (
    GQA_INITS,
    ConversionReport,
    LayerConversion,
    grouped_kv_error,
    pool_kv_heads,
    relative_error,
    stacked_kv,
)
from multihead.interop.torch import from_torch, to_torch
from multihead.latent import LatentAttention
from multihead.model_state import compiled

__all__ = ["GQA_INITS", "ConversionReport", "LayerConversion", "MLAReport", "from_torch", "grouped_kv_error",
           "mla_report", "pool_kv_heads", "to_gqa", "to_mla", "to_torch"]


def _check_attention(fn: str, attn) -> None:
    if not isinstance(attn, Attention):
        raise TypeError(f"{fn} takes a multihead.Attention; received {type(attn).__name__}"
                        + (" (use multihead.convert.from_torch first)"
                           if isinstance(attn, nn.MultiheadAttention) else ""))


def _has_bias(attn: Attention) -> bool:
    """Whether any projection has a bias (Qwen2's layers have q/k/v biases and no o bias)."""
    return any(getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj"))


def _match_biases(dst: nn.Module, src: nn.Module, names: tuple[str, ...]) -> None:
    """Remove dst's bias wherever src's same-named projection has none (so that the
    state dicts load and parameter counts stay honest)."""
    for name in names:
        if getattr(src, name).bias is None:
            getattr(dst, name).register_parameter("bias", None)


# ------------------------------------------------------------------------ GQA


def to_gqa(model, n_kv_heads: int, *, init: str | None = None, generator: torch.Generator | None = None,
           calibration=None, tokenizer=None, return_report: bool = False):
    """A copy of `model` with `n_kv_heads` key/value heads in every attention layer.

    `model` is one `Attention`, a model holding `Attention` layers (a lab model's `cfg`
    gets the new n_kv_heads), or a Hugging Face model whose config has
    `num_key_value_heads` (Llama, Mistral, Qwen2/3, Gemma: see `multihead.interop.hf.gqa`).

    Query head h reads key/value head h // G, so the new key/value head j replaces the
    old heads j*m .. (j+1)*m - 1, m = n_kv_heads_old / n_kv_heads. `init` says how:

    - "mean": their mean, weights and biases alike (Ainslie et al., 2023);
    - "first": head j*m's, the first of its group;
    - "random": drawn afresh from N(0, std of the layer's own K (V) weights), zero biases
      (`generator` makes it reproducible): the no-knowledge baseline of the paper;
    - "aligned" (transformers models, the default when `calibration` text or token ids are
      given): fitted on them, per rotary pair a complex rank-1 merge of the keys (a scale and
      a turn per old head, which commute with RoPE, go into the queries) and the values'
      principal subspace in the output's metric (the per-head maps go into o_proj);
      `multihead.interop.hf.gqa`.

    Queries, output, RoPE, window, softcap, ALiBi, causality and the rest are copied
    unchanged; with n_kv_heads == n_kv_heads_old and init "mean" or "first" the result
    is identical to the input.

    Returns:
        the new layer or model, or `(new, ConversionReport)` with `return_report=True`.

    Raises:
        ValueError: n_kv_heads does not divide a layer's key/value heads; an unknown init;
            a model without attention layers.
        TypeError: neither an `Attention` nor an `nn.Module`; n_kv_heads not an int.
    """
    _check_uncompiled("to_gqa", model)
    if init is not None and init not in GQA_INITS:
        raise ValueError(f"init must be one of {', '.join(GQA_INITS)}; received {init!r}")
    target = _gqa_target(model, n_kv_heads)
    if _is_transformers_model(model):
        from multihead.interop.hf.gqa import transformers_to_gqa

        return transformers_to_gqa(model, n_kv_heads, init=init, generator=generator, calibration=calibration,
                                   tokenizer=tokenizer, return_report=return_report)
    init = "mean" if init is None else init
    if init == "aligned" or calibration is not None or tokenizer is not None:
        raise ValueError(f"to_gqa: init='aligned' and calibration= are for transformers models (their attention "
                         f"statistics are read on calibration tokens); received init={init!r}"
                         + (", calibration=" if calibration is not None else "") + "; valid: init='mean', "
                         "'first' or 'random', calibration=None")
    return _convert(
        "to_gqa", model, lambda attn: _gqa_layer(attn, n_kv_heads, init, generator), target, init, return_report,
        lambda cfg: replace(cfg, n_kv_heads=n_kv_heads))


def _gqa_target(model, n_kv_heads) -> str:
    check_positive_int("n_kv_heads", n_kv_heads)
    if isinstance(model, Attention):
        _check_kv_heads(model, n_kv_heads)
    return "MQA" if n_kv_heads == 1 else f"GQA-{n_kv_heads}"


def _check_kv_heads(attn: Attention, n_kv_heads) -> None:
    check_positive_int("n_kv_heads", n_kv_heads)
    check_divisible("the layer's key/value heads", attn.n_kv_heads, "n_kv_heads", n_kv_heads)


def _gqa_layer(attn: Attention, n_kv_heads: int, init: str, generator: torch.Generator | None
               ) -> tuple[Attention, float]:
    """The converted layer and its relative K/V reconstruction error."""
    _check_attention("to_gqa", attn)
    _check_kv_heads(attn, n_kv_heads)
    D, Cin = attn.head_dim, attn.context_dim
    w = attn.q_proj.weight
    new = Attention(attn.d_model, attn.n_heads, n_kv_heads, head_dim=D, context_dim=Cin, bias=_has_bias(attn),
                    dropout=attn.dropout, causal=attn.causal, rope=copy.deepcopy(attn.rope), backend=attn.backend,
                    sliding_window=attn.sliding_window, softcap=attn.softcap, alibi=attn.alibi)
    _match_biases(new, attn, ("q_proj", "k_proj", "v_proj", "o_proj"))
    new = new.to(device=w.device, dtype=w.dtype).train(attn.training)
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(new, name).load_state_dict(getattr(attn, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(attn, name), getattr(new, name)
            dst.weight.copy_(pool_kv_heads(src.weight, n_kv_heads, D, init=init, generator=generator))  # (Hkv*D, Cin)
            if src.bias is not None:
                dst.bias.copy_(pool_kv_heads(src.bias, n_kv_heads, D, init=init, generator=generator))  # (Hkv*D,)
    error = grouped_kv_error((attn.k_proj.weight, attn.v_proj.weight, attn.v_proj.bias),
                             (new.k_proj.weight, new.v_proj.weight, new.v_proj.bias), D)
    return new, error


# ------------------------------------------------------------- whole models


def _check_uncompiled(fn: str, model) -> None:
    if compiled(model):
        raise ValueError(f"{fn}: {type(model).__name__} is compiled (torch.compile); a conversion copies and "
                         "rewrites the model's layers, which a compiled forward would not run; valid: the uncompiled "
                         "model (for torch.compile(model): its ._orig_mod), compiled again after the conversion")


def _is_transformers_model(model) -> bool:
    """A transformers PreTrainedModel (checked without importing transformers)."""
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
               for c in type(model).__mro__)


def _convert(fn: str, model, layer_fn, target: str, init: str, return_report: bool, lab_cfg):
    """Apply `layer_fn` (attn -> (new, error)) to one layer, or to every `Attention` of a
    deep copy of `model`; update a lab model's cfg with `lab_cfg(cfg)`."""
    if isinstance(model, Attention):
        new, error = layer_fn(model)
        report = ConversionReport(target, init, (LayerConversion("", error),))
        return (new, report) if return_report else new
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn} takes a multihead.Attention or an nn.Module holding them; "
                        f"received {type(model).__name__}")
    if isinstance(model, (nn.MultiheadAttention, LatentAttention)):  # a lone layer of another kind
        _check_attention(fn, model)
    names = [name for name, m in model.named_modules() if isinstance(m, Attention)]
    if not names:
        torch_mha = any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
        raise ValueError(f"{fn}: {type(model).__name__} holds no multihead.Attention layer"
                         + (" (its nn.MultiheadAttention layers convert with multihead.convert.from_torch first)"
                            if torch_mha else "")
                         + "; valid: a multihead.Attention, a model built from them (a lab model), or a "
                         "transformers model with num_key_value_heads in its config (to_gqa)")
    new = copy.deepcopy(model)
    rows = []
    for name in names:
        try:
            converted, error = layer_fn(new.get_submodule(name))
        except (TypeError, ValueError) as err:  # the same class, naming the layer
            raise type(err)(f"{fn}: layer {name}: {err}") from None
        parent, _, child = name.rpartition(".")
        setattr(new.get_submodule(parent) if parent else new, child, converted)
        rows.append(LayerConversion(name, error))
    _update_lab_config(new, lab_cfg)
    report = ConversionReport(target, init, tuple(rows))
    return (new, report) if return_report else new


def _update_lab_config(model: nn.Module, lab_cfg) -> None:
    """A lab model records its architecture in `cfg` (what its checkpoint's config.json
    says); it follows the conversion. Only a model of a loaded `multihead.decoder` can be one."""
    lab = sys.modules.get("multihead.decoder")
    if lab is not None and isinstance(model, lab.LabTransformer):
        model.cfg = lab_cfg(model.cfg)


# ------------------------------------------------------------------------ MLA


@dataclass(frozen=True)
class MLAReport:
    """The spectrum of a layer's stacked key/value map, and the error of each rank.

    `singular_values` (descending, float64) are those of M = [W_k | b_k ; W_v | b_v]
    (the bias column only when the layer has biases; b_k only where softmax does not
    cancel it, i.e. under a softcap), the map `to_mla` factors. `measured`, set by
    `to_mla`, is the error of the map the built module computes, read back from its
    weights; `error` is that number when present.
    """

    kv_rank: int
    singular_values: tuple[float, ...]
    measured: float | None = None

    @property
    def max_rank(self) -> int:
        """min(rows, columns) of M: the rank at which the factorisation is exact."""
        return len(self.singular_values)

    @property
    def errors(self) -> tuple[float, ...]:
        """Relative reconstruction error ||M - M_r||_F / ||M||_F for r = 0 .. max_rank."""
        sq = [s * s for s in self.singular_values]
        total = sum(sq)
        tails = [math.fsum(sq[r:]) for r in range(len(sq) + 1)]
        return tuple(math.sqrt(t / total) if total > 0 else 0.0 for t in tails)

    @property
    def error(self) -> float:
        """Relative reconstruction error at `kv_rank`: measured from the built module's
        weights where `to_mla` made one, else from the singular values (equal up to rounding)."""
        return self.errors[self.kv_rank] if self.measured is None else self.measured

    def __str__(self) -> str:
        rows = ["rank  rel. error"]
        for r, e in enumerate(self.errors):
            if r and (r & (r - 1) == 0 or r in (self.kv_rank, self.max_rank)):  # powers of two, chosen, max
                mark = "  <- kv_rank" if r == self.kv_rank else ""
                rows.append(f"{r:>4}  {e:.3e}{mark}")
        return "\n".join(rows)


def _kv_matrix(attn: Attention) -> torch.Tensor:
    """M = [W_k | b_k ; W_v | b_v] in float64, `(2 * Hkv * D, C [+ 1])`.

    The key bias is left out (a zero block) where it cannot matter: it adds q_i . b_k to
    every score of query i, the same for every key, and softmax is invariant to that
    (exactly, weights too). A softcap breaks that invariance (tanh of a shifted score is
    not a shifted tanh), so a capped layer keeps its key bias in M. The biases ride along
    as the coefficients of a constant input feature 1, so they become the down-projection's
    bias and pass through the latent like the rest.
    """
    return stacked_kv(attn.k_proj.weight, attn.v_proj.weight, attn.v_proj.bias, _kept_key_bias(attn))


def _kept_key_bias(attn: Attention) -> torch.Tensor | None:
    """The key bias when the conversion must carry it (a softcapped layer), else None."""
    return attn.k_proj.bias if attn.softcap is not None else None


def _check_mla_source(fn: str, attn, rope_dim=None) -> None:
    _check_attention(fn, attn)
    if attn.rope is not None and rope_dim is None:
        raise ValueError(
            f"{fn}: the layer has rotary embeddings (rope={attn.rope.extra_repr()}); only layers without RoPE "
            "convert exactly. RoPE rotates each key by its position after W_k, and that rotation does not "
            "commute with a shared latent's up-projection, so it cannot be absorbed; MLA's decoupled RoPE "
            "key is a different model that needs training (MHA2MLA, Ji et al., 2025). valid: rope=None, or "
            "to_mla(..., rope_dim=r) for the approximate partial-RoPE conversion"
        )
    if rope_dim is not None:
        top = _max_rope_dim(attn)
        check_int(f"{fn}: rope_dim", rope_dim)
        if rope_dim % 2 or not 0 <= rope_dim <= top:
            rotary = 0 if attn.rope is None else attn.rope.dim
            why = "the layer's rotary dim" if top == rotary else \
                f"the layer's rotary dim {rotary}, less one non-rotary feature per head of {attn.head_dim}"
            raise ValueError(f"{fn}: rope_dim must be an even int in 0..{top} ({why}); received {rope_dim!r}; "
                             f"valid: {', '.join(map(str, range(0, top + 1, 2)))}")
        if rope_dim and attn.rope.scaling is not None:
            raise ValueError(f"{fn}: the layer's RoPE has {attn.rope.scaling.kind} scaling, whose frequencies "
                             "a decoupled RoPE key of fewer dims cannot keep; valid: rope_dim=0 or unscaled RoPE")
    if attn.alibi:
        raise ValueError(f"{fn}: the layer uses ALiBi, which LatentAttention does not carry; valid: alibi=False")
    if attn.context_dim != attn.d_model:
        raise ValueError(f"{fn}: context_dim ({attn.context_dim}) != d_model ({attn.d_model}): a cross-attention "
                         "layer has no LatentAttention equivalent (MLA is self-attention); "
                         "valid: context_dim == d_model")


def _max_rope_dim(attn: Attention) -> int:
    """The largest rope_dim that converts: at most the rotary dim, and every head keeps at
    least one non-rotary feature (LatentAttention's head_dim is D - rope_dim >= 1)."""
    if attn.rope is None:
        return 0
    top = min(attn.rope.dim, attn.head_dim - 1)
    return top - top % 2


def mla_report(attn: Attention, kv_rank: int | None = None) -> MLAReport:
    """The singular values of `attn`'s stacked K/V map and the error at every rank.

    For a rank sweep without building modules; kv_rank (default max_rank) only chooses
    which error `report.error` names.
    """
    _check_mla_source("mla_report", attn)
    s = torch.linalg.svdvals(_kv_matrix(attn))
    report = MLAReport(len(s), tuple(s.tolist()))
    if kv_rank is None:
        return report
    _check_rank(kv_rank, report.max_rank, attn)
    return MLAReport(kv_rank, report.singular_values)


def _check_rank(kv_rank, max_rank: int, attn: Attention, rope_dim: int = 0) -> None:
    check_int("kv_rank", kv_rank)
    if not 1 <= kv_rank <= max_rank:  # not check_int's range message: this one says where the maximum comes from
        rows = attn.n_kv_heads * (2 * attn.head_dim - rope_dim)
        cols = attn.d_model + (attn.v_proj.bias is not None or _kept_key_bias(attn) is not None)
        raise ValueError(
            f"kv_rank must be an int in 1..{max_rank}, the rank of the stacked [W_k ; W_v] "
            f"(min({rows} rows, {cols} columns)); received {kv_rank!r}"
        )


def to_mla(model, kv_rank: int, *, rope_dim: int | None = None, keep: str | None = None, basis: str | None = None,
           calibration=None, tokenizer=None, return_report: bool = False):
    """Factor an MHA/GQA layer's keys and values through a shared rank-`kv_rank` latent.

    `model` is one `Attention` (returns a `LatentAttention`, and with `return_report`
    its `MLAReport`: the error at every rank) or a model holding `Attention` layers: a
    deep copy with every one converted (a lab model's `cfg` says attention "mla"), and
    with `return_report` a `ConversionReport` of every layer's error at kv_rank.

    With M = [W_k ; W_v] `(2 * Hkv * D, C)` and its SVD U S V^T truncated to R = kv_rank:
    the down-projection `kv_a_proj` is S_R^(1/2) V_R^T `(R, C)` and the up-projection
    `kv_b_proj` holds U_R S_R^(1/2), each query head taking the rows of its key/value
    head (a GQA layer's heads are repeated per group, which is exact). Queries, output
    projection and causality are copied. The result has no latent norm
    (`latent_norm=False`: an RMSNorm would make the latent a nonlinear function of x)
    and rope_dim = 0. At R = max_rank its outputs equal the original's up to rounding;
    below, `MLAReport.errors` says how much of the K/V map is lost at each rank.

    Biases (Attention's default) are handled exactly: the query and output biases are
    copied (`bias=True`); the key bias is dropped, since it adds the same q_i . b_k to
    every score of query i and softmax ignores such a shift, except under a softcap (the
    cap does not commute with the shift), where it is kept; the value bias (and a kept
    key bias) becomes the down-projection's bias (M gains the column [b_k or 0 ; b_v]),
    so it passes through the latent like the weights. The report's error is measured
    from the built module's weights against M.

    A sliding window and a softcap are carried over. Refused, with the reason: layers
    with RoPE unless `rope_dim` is given (the rotation sits between W_k and the scores and
    cannot be absorbed into a shared latent), cross-attention layers (context_dim !=
    d_model), ALiBi. Dropout is not carried over (LatentAttention has none).

    `rope_dim=r` converts a layer with RoPE approximately, after MHA2MLA's partial RoPE
    (Ji et al., 2025, "Towards Economical Inference: Enabling DeepSeek's Multi-Head
    Latent Attention in Any Transformer-based LLMs"), choosing the r/2 highest-frequency
    rotary pairs (their "S_high"): those stay rotary in MLA's one decoupled RoPE key,
    which is the mean of the key heads' parts there (shared by all heads, as to_gqa's
    mean-pool: exact for an MQA layer), with the same frequencies (the new RoPE base is
    base^(r / rotary dim)); the other pairs lose their rotation and go through the SVD
    with the values (the report's error is that of this NoPE K/V map). r = 0 drops RoPE
    altogether. RoPE scaling is refused (its frequencies are not a base's).

    A transformers Llama-family model (Llama, Mistral, Qwen2, Qwen3) goes to
    `multihead.interop.hf.mla.transformers_to_mla`: rope_dim is then required (a multiple of 2 * Hkv up to
    Hkv * D, where it is exact). With `calibration` (text with `tokenizer=`, or token ids) the
    default is data-aware: keep="rotation" (the pairs whose rotation costs most to drop under
    the layer's attention) and basis="output" (the dropped pairs' queries turned by their mean
    rotation, the latent the principal subspace of the K/V features in the attention output's
    metric); without, keep="high" and basis="weights" (the SVD). keep="norm" (MHA2MLA's
    norm product) and basis="activations" (plain PCA of the features) stay by name
    (docs/mla.md, "With calibration text", compares them on SmolLM2).

    Returns:
        the converted layer or model, or `(new, report)` with `return_report=True`.
    """
    _check_uncompiled("to_mla", model)
    if _is_transformers_model(model):
        from multihead.interop.hf.mla import transformers_to_mla

        return transformers_to_mla(model, kv_rank, rope_dim=rope_dim, keep=keep, basis=basis, calibration=calibration,
                                   tokenizer=tokenizer, return_report=return_report)
    if keep not in (None, "high") or basis not in (None, "weights") or calibration is not None or tokenizer is not None:
        raise ValueError(f"to_mla: a multihead layer keeps its highest-frequency rotary pairs (keep='high') and "
                         f"factors its weights (basis='weights'); keep={keep!r}, basis={basis!r} and calibration= "
                         "are for transformers models; valid: keep=None or 'high', basis=None or 'weights', "
                         "calibration=None")
    if isinstance(model, Attention):
        return _mla_layer(model, kv_rank, return_report, rope_dim)
    bias = next((m.k_proj.bias is not None for m in model.modules() if isinstance(m, Attention)), False) \
        if isinstance(model, nn.Module) else False
    return _convert(
        "to_mla", model, lambda attn: _mla_layer_error(attn, kv_rank, rope_dim), f"MLA-{kv_rank}", "svd",
        return_report, lambda cfg: _lab_mla_config(cfg, kv_rank, bias, rope_dim))


def _lab_mla_config(cfg, kv_rank: int, bias: bool, rope_dim: int | None):
    if rope_dim is not None and cfg.positions == "rope":
        raise ValueError("to_mla(rope_dim=...) converts the layers of a lab model with rotary positions, but a "
                         "lab MLA model takes its RoPE base from d_model and n_heads, not from the conversion; "
                         "convert the model's layers, or use a model with positions='learned'")
    return replace(cfg, attention="mla", kv_rank=kv_rank, n_kv_heads=None, latent_norm=False, bias=bias, rope_dim=0)


def _mla_layer_error(attn: Attention, kv_rank, rope_dim) -> tuple[LatentAttention, float]:
    mla, report = _mla_layer(attn, kv_rank, True, rope_dim)
    return mla, report.error


def _rope_split(attn: Attention, r: int) -> tuple[list[int], list[int]]:
    """(rope features, nope features) of a head: the r/2 highest-frequency rotary pairs in
    the order a rotary embedding of width r and the same layout pairs them, and the rest."""
    D = attn.head_dim
    if not r:
        return [], list(range(D))
    half, k = attn.rope.dim // 2, r // 2
    rope = list(range(r)) if attn.rope.interleaved else list(range(k)) + [half + f for f in range(k)]
    kept = set(rope)
    return rope, [i for i in range(D) if i not in kept]


def _mla_layer(attn: Attention, kv_rank, return_report: bool, rope_dim: int | None = None):
    _check_mla_source("to_mla", attn, rope_dim)
    r = rope_dim or 0
    H, Hkv, D, C = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.d_model
    rope_idx, nope_idx = _rope_split(attn, r)
    wk = attn.k_proj.weight.detach().view(Hkv, D, C)
    bk = _kept_key_bias(attn)
    bk_nope = None if bk is None else bk.detach().view(Hkv, D)[:, nope_idx].reshape(-1)  # (Hkv*(D-r),)
    m = stacked_kv(wk[:, nope_idx].reshape(-1, C), attn.v_proj.weight, attn.v_proj.bias, bk_nope)  # (rows, C [+1])
    has_col = m.shape[1] > C
    max_rank = min(m.shape)
    _check_rank(kv_rank, max_rank, attn, r)
    U, S, Vh = torch.linalg.svd(m, full_matrices=False)  # (rows, k), (k,), (k, cols)
    R = kv_rank
    root = S[:R].sqrt()
    down = root[:, None] * Vh[:R]  # (R, C [+1])
    up = U[:, :R] * root[None, :]  # (Hkv*(2D-r), R)

    G = H // Hkv
    nk = Hkv * (D - r)
    up_k, up_v = up[:nk].view(Hkv, D - r, R), up[nk:].view(Hkv, D, R)
    up_kv = torch.cat([up_k, up_v], dim=1).repeat_interleave(G, dim=0)  # (H, 2D-r, R): query head h uses h // G

    k_rope = wk[:, rope_idx].double().mean(0)  # (r, C): the shared decoupled RoPE key, the heads' mean
    b_k = attn.k_proj.bias
    b_rope = None if b_k is None or not r else b_k.detach().view(Hkv, D)[:, rope_idx].double().mean(0)  # (r,)
    latent_bias = has_col or b_rope is not None
    bias = _has_bias(attn)
    w = attn.q_proj.weight
    rope_kw = {} if not r else dict(rope_base=attn.rope.base ** (r / attn.rope.dim),
                                    rope_interleaved=attn.rope.interleaved)
    mla = LatentAttention(C, H, R, head_dim=D - r, v_head_dim=D, rope_dim=r, causal=attn.causal,
                          backend=attn.backend, latent_norm=False, bias=bias,
                          sliding_window=attn.sliding_window, softcap=attn.softcap, **rope_kw)
    _match_biases(mla, attn, ("q_proj", "o_proj"))
    if not latent_bias:  # the latent's bias carries the value bias (and the key's where it matters)
        mla.kv_a_proj.register_parameter("bias", None)
    mla = mla.to(device=w.device, dtype=w.dtype).train(attn.training)
    order = nope_idx + rope_idx  # each query head: [q_nope ; q_pe]
    with torch.no_grad():
        mla.q_proj.weight.copy_(attn.q_proj.weight.view(H, D, C)[:, order].reshape(H * D, C))
        if attn.q_proj.bias is not None:
            mla.q_proj.bias.copy_(attn.q_proj.bias.view(H, D)[:, order].reshape(-1))
        mla.o_proj.load_state_dict(attn.o_proj.state_dict())
        mla.kv_a_proj.weight.copy_(torch.cat([down[:, :C], k_rope]))  # (R + r, C)
        if mla.kv_a_proj.bias is not None:
            zeros = torch.zeros(r, dtype=torch.float64, device=down.device)
            mla.kv_a_proj.bias.copy_(torch.cat([down[:, C] if has_col else
                                                torch.zeros(R, dtype=torch.float64, device=down.device),
                                                zeros if b_rope is None else b_rope]))
        mla.kv_b_proj.weight.copy_(up_kv.reshape(H * (2 * D - r), R))
    if not return_report:
        return mla
    return mla, MLAReport(R, tuple(S.tolist()), _measured_error(mla, m, Hkv, G, D - r, D, r))


def _measured_error(mla: LatentAttention, m: torch.Tensor, Hkv: int, G: int, Dn: int, Dv: int, r: int) -> float:
    """||M - M'||_F / ||M||_F with M' the K/V map the built module computes, read back from
    its weights: kv_b_proj (one query head per key/value head) times [kv_a_proj | bias]."""
    R = mla.kv_rank
    up = mla.kv_b_proj.weight.detach().double().view(Hkv, G, Dn + Dv, R)[:, 0]  # (Hkv, Dn + Dv, R)
    up = torch.cat([up[:, :Dn].reshape(-1, R), up[:, Dn:].reshape(-1, R)])  # (Hkv*(Dn+Dv), R): keys, then values
    down = mla.kv_a_proj.weight.detach().double()[:R]  # (R, C)
    if m.shape[1] > down.shape[1]:
        b = mla.kv_a_proj.bias
        down = torch.cat([down, b.detach().double()[:R, None]], dim=1)  # (R, C + 1)
    return relative_error(m, up @ down)

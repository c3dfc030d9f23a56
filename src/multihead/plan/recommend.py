"""Recommend an attention geometry for a parameter budget, a context, a batch and a device.

The recommender is a short list of deterministic rules (width from size, the starting
variant, inference and training priorities, what the user fixes), each stated where it is
applied.

Details: docs/plan.md, "How it recommends".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from multihead.checks import check_divisible, check_positive_int, divisibility_error, divisors
from multihead.plan.devices import DEVICES, RESERVE, Device, Fit, fit, max_batch, max_context
from multihead.plan.geometry import (
    AttentionGeometry,
    FeedForward,
    LatentGeometry,
    ModelGeometry,
    ParamCounts,
    kv_bytes_per_token,
    model_kv_cache_bytes,
    param_counts,
)
from multihead.plan.text import recommendation_text
from multihead.plan.units import bytes_for, dtype_name, fmt_bytes, fmt_count, fmt_tokens

PRIORITIES = ("inference", "training")
VARIANTS = ("mha", "gqa", "mqa", "mla")

# (parameters, d_model) of production models; the recommender takes the nearest in log size.
SIZE_LADDER = [
    (10e6, 256), (30e6, 384), (50e6, 512), (125e6, 768), (350e6, 1024), (760e6, 1536),
    (1e9, 2048), (3e9, 3072), (7e9, 4096), (13e9, 5120), (30e9, 6656), (70e9, 8192),
    (175e9, 12288), (405e9, 16384),
]  # fmt: skip
HEAD_DIMS = (128, 96, 80, 64, 48, 32)  # tried in order when the default does not divide d_model
MLA_MIN_PARAMS = 1e9
MHA_MAX_HEADS = 16  # beyond this, and beyond LONG_CONTEXT, MHA draws a warning
LONG_CONTEXT = 32 * 1024
TIE_BELOW = 4e9  # Llama 3.2 1B/3B, Qwen2.5 <= 3B tie their embeddings; 7B+ models do not
MIN_HEAD_DIM = 32
TINY_PARAMS = 10**6  # below this a --params value is almost surely a missing suffix (7 for 7B)


@dataclass(frozen=True)
class Request:
    """What the user asks for; None means 'let the recommender choose'."""

    params: int
    context: int = 8192
    batch: int = 1
    device: Device = DEVICES["h100-80gb"]
    n_devices: int | None = None
    priority: str = "inference"
    dtype: str = "bf16"
    weights_dtype: str = "bf16"
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    variant: str | None = None
    kv_rank: int | None = None
    vocab_size: int = 32000

    def __post_init__(self):
        for name in ("params", "context", "batch", "vocab_size"):
            check_positive_int(name, getattr(self, name))
        for name in ("n_devices", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "kv_rank"):
            check_positive_int(name, getattr(self, name), allow_none=True)
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}; "
                             f"received {self.priority!r}")
        if self.variant is not None and self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}; "
                             f"received {self.variant!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "weights_dtype", dtype_name(self.weights_dtype))


@dataclass(frozen=True)
class Candidate:
    """One geometry with its accounting at the request's context, batch and device."""

    model: ModelGeometry
    params: ParamCounts
    kv_bytes_per_token: int
    fit: Fit
    max_batch: int
    max_context: int

    @property
    def label(self) -> str:
        return self.model.attention.label

    @property
    def kv_bytes(self) -> int:
        return self.fit.kv_bytes

    def __repr__(self) -> str:
        a = self.model.attention
        where = self.fit.device.name if self.fit.n_devices == 1 else f"{self.fit.n_devices} x {self.fit.device.name}"
        return (f"Candidate({self.label}: {a.n_heads} heads of {a.head_dim}, {self.model.n_layers} layers, "
                f"{fmt_count(self.params.total)} params, KV {fmt_bytes(self.kv_bytes)} at "
                f"{fmt_tokens(self.fit.context)} x {self.fit.batch}, {'fits' if self.fit.fits else 'does not fit'} "
                f"on {where})")


@dataclass(frozen=True)
class Recommendation:
    """What `recommend` returns. `repr` is one line; `str(rec)` (or `print(rec)`) is the text
    `multihead plan` prints, which `plan.recommendation_text(rec)` also gives."""

    request: Request
    pick: Candidate
    reason: str
    alternatives: tuple[Candidate, ...]  # ranked, the pick first
    init: dict
    bias: dict
    check: dict
    warnings: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    pick_note: str = ""  # what the pick changed from what was asked, and why ("" if nothing)

    def __repr__(self) -> str:
        extra = "".join(f", {len(x)} {name}" for name, x in (("warnings", self.warnings), ("notes", self.notes)) if x)
        return (f"Recommendation(pick={self.pick!r}, {len(self.alternatives)} alternatives{extra}; "
                "print() it for the full text)")

    def __str__(self) -> str:
        return recommendation_text(self)


# --- rule 1: width, heads and layers -----------------------------------------------


def width_for(params: int) -> int:
    """d_model of the production size nearest to `params` (in log scale)."""
    return min(SIZE_LADDER, key=lambda row: abs(math.log(row[0] / params)))[1]


def usual_head_dim(d_model: int) -> int:
    """64 for d_model <= 1024 (GPT-2, BERT, Pythia), 128 above (Llama, Mistral, Qwen)."""
    return 64 if d_model <= 1024 else 128


def _heads(req: Request, warnings: list[str]) -> tuple[int, int, int]:
    """(d_model, n_heads, head_dim) with d_model = n_heads * head_dim."""
    c, h, d = req.d_model, req.n_heads, req.head_dim
    if c is None and h is not None and d is not None:
        c = h * d
    if c is None:
        c = width_for(req.params)
    if h is not None and d is not None:
        if h * d != c:
            raise ValueError(f"when recommending, d_model must equal n_heads * head_dim; "
                             f"received d_model {c}, n_heads {h}, head_dim {d} (= {h * d})")
    elif h is not None:
        check_divisible("d_model", c, "n_heads", h)
        d = c // h
    elif d is not None:
        if c % d:  # not check_divisible: the valid list is the usual head dims, not every divisor
            valid = ", ".join(str(x) for x in HEAD_DIMS if c % x == 0) or "a divisor of d_model"
            raise ValueError(f"d_model ({c}) must be divisible by head_dim ({d}); "
                             f"valid head_dim: {valid}")
        h = c // d
    else:
        tried = (usual_head_dim(c), *HEAD_DIMS)
        d = next((x for x in tried if c % x == 0), None)
        if d is None:
            raise ValueError(f"d_model ({c}) is not a multiple of any usual head_dim "
                             f"({', '.join(map(str, HEAD_DIMS))}); pass --head-dim or --n-heads")
        h = c // d
    warnings += _head_dim_warnings(c, d)
    return c, h, d


def ffn_width(d_model: int) -> int:
    """SwiGLU width with Llama 3's ratio: 3.5 * d_model, rounded up to a multiple of 256
    (4096 -> 14336, 8192 -> 28672), so layer counts come out near production models'."""
    return 256 * math.ceil(7 * d_model / 2 / 256)


def _model(attention, n_layers: int, req: Request, tied: bool) -> ModelGeometry:
    return ModelGeometry(
        attention=attention,
        n_layers=n_layers,
        vocab_size=req.vocab_size,
        ffn=FeedForward(ffn_width(attention.d_model)),
        tied_embeddings=tied,
        name=f"plan-{fmt_count(req.params)}",
        family="plan",
    )


def layers_for(attention, req: Request, tied: bool) -> int:
    """Layers that bring the model closest to the parameter budget (at least 1)."""
    one = param_counts(_model(attention, 1, req, tied))
    two = param_counts(_model(attention, 2, req, tied))
    per_layer = two.total - one.total
    fixed = one.total - per_layer
    return max(1, round((req.params - fixed) / per_layer))


def devices_for(weights_bytes: int, device: Device) -> int:
    """The fewest devices, a power of two, whose usable memory is at least twice the weights
    (half for the weights, half for the KV cache): 7B in bf16 on one H100, 70B on four."""
    n = 1
    while weights_bytes > 0.5 * (1 - RESERVE) * device.memory * n:
        n *= 2
    return n


# --- rule 2: the starting variant --------------------------------------------------


def _gqa8(h: int) -> int:
    """8 KV heads, or the largest divisor of H below 8 when 8 does not divide H."""
    return max(k for k in divisors(h) if k <= 8)


def start_variant(params: int, n_heads: int) -> tuple[int, str]:
    """(n_kv_heads, why) of the production default for this size."""
    if params < MLA_MIN_PARAMS and n_heads <= MHA_MAX_HEADS:
        return n_heads, "below 1B parameters with at most 16 heads MHA is the norm"
    k = _gqa8(n_heads)
    if k == n_heads:
        return n_heads, f"with {n_heads} heads, 8 KV heads is MHA"
    return k, f"GQA with {k} KV heads is the production default above 1B parameters"


# --- candidates --------------------------------------------------------------------


def _mla(c: int, h: int, d: int, rank: int) -> LatentGeometry:
    """DeepSeek-V2's proportions: no-RoPE head D, RoPE D/2, value D, q_rank 3R on wide models."""
    return LatentGeometry(c, h, kv_rank=rank, q_rank=3 * rank if c >= 4096 else None,
                          head_dim=d, rope_dim=d // 4 * 2, v_head_dim=d)


def _candidate(attention, n_layers: int, req: Request, tied: bool) -> Candidate:
    model = _model(attention, n_layers, req, tied)
    f = fit(model, req.device, req.context, req.batch, req.dtype, req.weights_dtype,
            req.n_devices)
    return Candidate(model, param_counts(model), kv_bytes_per_token(model, req.dtype), f,
                     max_batch(model, f), max_context(model, f))


def _kv_elements(c: Candidate) -> int:
    return c.model.attention.kv_elements_per_token


# --- the recommender ---------------------------------------------------------------


def recommend(req: Request) -> Recommendation:
    """Apply the rules of docs/plan.md ("How it recommends"); deterministic for a given request."""
    warnings: list[str] = []
    notes: list[str] = []
    if req.params < TINY_PARAMS:
        warnings.append(
            f"the budget is tiny: {req.params:,} parameters; did you mean {req.params}M or "
            f"{req.params}B? (sizes take a suffix: 125M, 1.3B, 7B)")
    c, h, d = _heads(req, warnings)
    if (req.variant == "mla" or req.kv_rank is not None) and req.params < MLA_MIN_PARAMS:
        warnings.append(
            f"MLA below 1B parameters ({fmt_count(req.params)}), as asked: the latent saves "
            f"little cache at this size and costs a more complex decode path; GQA is simpler")
    tied = req.params < TIE_BELOW
    user_kv, pick_note = _valid_user_kv(req, h, warnings)
    start_kv, start_why = start_variant(req.params, h)
    start_attn = AttentionGeometry(c, h, start_kv, head_dim=d, bias=False)
    req, n_layers = _size(req, start_attn, tied, warnings, notes)
    mla_default = req.kv_rank or 4 * d
    cands = _candidates(req, start_attn, user_kv, mla_default, n_layers, tied)
    pick, reason = _pick(req, cands, start_attn.label, start_why, user_kv, mla_default, pick_note)
    warnings += _pick_warnings(req, pick)
    notes += _training_notes(req, pick)
    return Recommendation(
        request=req,
        pick=pick,
        reason=reason,
        alternatives=tuple(_rank(pick, cands.values())),
        init=init_scales(pick.model),
        bias={"use": False, "reason": "production decoders (Llama, Mistral, Gemma, DeepSeek) "
              "train without attention biases; they add parameters and no quality"},
        check=induction_check(pick.model),
        warnings=tuple(warnings),
        notes=tuple(notes),
        pick_note=pick_note,
    )


def _valid_user_kv(req: Request, h: int, warnings: list[str]) -> tuple[int | None, str]:
    """The user's KV heads made valid (GQA groups must divide the heads), and the note
    saying what was changed ("" if nothing)."""
    user_kv = req.n_kv_heads
    if user_kv is None or (user_kv <= h and h % user_kv == 0):
        return user_kv, ""
    valid = divisors(h)
    fixed = max(k for k in valid if k <= user_kv)
    why = (f"KV heads must divide the {h} query heads" if user_kv <= h
           else f"there are only {h} query heads")
    warnings.append(f"{divisibility_error('n_heads', h, 'n_kv_heads', user_kv)}; using {fixed} (every KV head "
                    f"serves the same number of query heads)")
    return fixed, f"{fixed} KV heads, not {user_kv}: {why}"


def _size(req: Request, start_attn, tied: bool, warnings: list[str],
          notes: list[str]) -> tuple[Request, int]:
    """(request with n_devices filled in, n_layers): layers fill the budget at the starting
    geometry, devices hold its weights in half their usable memory."""
    n_layers = req.n_layers or layers_for(start_attn, req, tied)
    if req.n_devices is None:
        weights = bytes_for(param_counts(_model(start_attn, n_layers, req, tied)).total,
                            req.weights_dtype)
        req = replace(req, n_devices=devices_for(weights, req.device))
        if req.n_devices > 1:
            notes.append(f"{req.n_devices} x {req.device.name}: the fewest (a power of two, as "
                         f"tensor parallelism wants) that hold the {fmt_bytes(weights)} of "
                         "weights in half their usable memory, leaving the other half for the "
                         "cache; pass --n-accelerators to choose")
    if req.n_layers is None and n_layers < 2:
        warnings.append(f"{fmt_count(req.params)} parameters leave room for {n_layers} layer "
                        f"at d_model {start_attn.d_model} after the embeddings; "
                        "pass a smaller --d-model")
    return req, n_layers


def _candidates(req: Request, start_attn, user_kv: int | None, mla_default: int, n_layers: int,
                tied: bool) -> dict[str, Candidate]:
    """MHA, several GQA groupings, MQA, and (where allowed) MLA at ranks 2D, 4D, 8D, by label."""
    c, h, d = start_attn.d_model, start_attn.n_heads, start_attn.head_dim
    kv_counts = {h, 1, start_attn.n_kv_heads} | {k for k in (h // 2, 16, 8, 4, 2) if 1 < k < h and h % k == 0}
    if user_kv is not None:
        kv_counts.add(user_kv)
    attns = [AttentionGeometry(c, h, k, head_dim=d, bias=False)
             for k in sorted(kv_counts, reverse=True)]
    if req.params >= MLA_MIN_PARAMS or req.variant == "mla" or req.kv_rank is not None:
        ranks = sorted({2 * d, 4 * d, 8 * d, mla_default}, reverse=True)
        attns += [_mla(c, h, d, r) for r in ranks]
    return {a.label: _candidate(a, n_layers, req, tied) for a in attns}


def _pick(req: Request, cands: dict[str, Candidate], start_label: str, start_why: str,
          user_kv: int | None, mla_default: int, pick_note: str) -> tuple[Candidate, str]:
    """(pick, reason): what the user forced, else the start when training (rule 4), else the
    first rung of the cache ladder that fits (rule 3)."""
    start = cands[start_label]
    forced = _forced_label(req, start.model.attention.n_heads, user_kv, start.model.attention.n_kv_heads,
                           mla_default)
    if forced is not None:
        pick = cands[forced]
        asked = "as asked" if not pick_note else f"from the {req.n_kv_heads} KV heads asked, made valid"
        return pick, (f"{pick.label} {asked}: its KV cache at {_at(req)} is "
                      f"{fmt_bytes(pick.kv_bytes)}, {_fit_words(pick)}.")
    if req.priority == "training":
        return start, (f"{start.label}: training holds no KV cache, so the geometry follows "
                       f"practice ({start_why}); served at {_at(req)} its cache would be "
                       f"{fmt_bytes(start.kv_bytes)}, {_fit_words(start)}.")
    ladder = [x for x in cands.values()
              if _kv_elements(x) <= _kv_elements(start)
              and (x.model.attention.kind != "MLA" or x.label == f"MLA-{mla_default}")]
    ladder.sort(key=lambda x: (-_kv_elements(x), x.label))
    pick = next((x for x in ladder if x.fit.fits), None)
    if pick is start:
        return pick, (f"{pick.label}: {start_why}, and its KV cache at {_at(req)} is "
                      f"{fmt_bytes(pick.kv_bytes)}, {_fit_words(pick)}"
                      + (f" (MHA would need {fmt_bytes(cands['MHA'].kv_bytes)})."
                         if pick.label != "MHA" else "."))
    if pick is not None:
        bigger = ladder[ladder.index(pick) - 1]
        return pick, (f"{pick.label}: {bigger.label} would need {fmt_bytes(bigger.kv_bytes)} of "
                      f"KV cache at {_at(req)} + {fmt_bytes(bigger.fit.weights_bytes)} of weights = "
                      f"{_total(bigger)}, more than the {_usable(req)}; {pick.label} needs "
                      f"{fmt_bytes(pick.kv_bytes)} + {fmt_bytes(pick.fit.weights_bytes)} = {_total(pick)}.")
    pick = min(ladder, key=lambda x: (x.kv_bytes, x.label))
    return pick, (f"{pick.label}: the smallest KV cache on the ladder "
                  f"({fmt_bytes(pick.kv_bytes)} at {_at(req)}; with the weights {_total(pick)}) and "
                  f"still more than the {_usable(req)}.")


def _pick_warnings(req: Request, pick: Candidate) -> list[str]:
    """Warnings that depend on the pick: weights or cache that do not fit, MHA at long context."""
    warnings = []
    if not pick.fit.weights_fit:
        need = math.ceil(pick.fit.weights_bytes / ((1 - RESERVE) * req.device.memory))
        warnings.append(
            f"the weights ({fmt_bytes(pick.fit.weights_bytes)} in {req.weights_dtype}) do not "
            f"fit in {fmt_bytes(pick.fit.usable_bytes)} usable on {_device_words(req)}; they "
            f"need at least {need} x {req.device.name} (--n-accelerators {need} or more, leaving room "
            f"for the cache), or --weights-dtype fp8/int4")
    elif not pick.fit.fits:
        warnings.append(
            f"the KV cache ({fmt_bytes(pick.kv_bytes)} at {_at(req)}) does not fit: with the "
            f"{fmt_bytes(pick.fit.weights_bytes)} of weights it needs {_total(pick)}, more than the "
            f"{_usable(req)}: at most "
            f"{pick.max_batch} sequences of {fmt_tokens(req.context)} fit, or "
            f"{pick.max_context:,} tokens at batch {req.batch}")
    return warnings + mha_warnings(pick.model, req.context, req.batch, req.dtype)


def _training_notes(req: Request, pick: Candidate) -> list[str]:
    if req.priority != "training":
        return []
    state = 16 * pick.params.total
    per_device = (1 - RESERVE) * req.device.memory
    return [f"training state at 16 bytes/parameter (bf16 weights and grads, fp32 master "
            f"and Adam moments): {fmt_bytes(state)}, at least "
            f"{math.ceil(state / per_device)} x {req.device.name} with ZeRO-3/FSDP, "
            "plus activations"]


def _forced_label(req: Request, h: int, user_kv, start_kv: int, mla_default: int) -> str | None:
    if req.variant == "mla" or (req.variant is None and req.kv_rank is not None):
        return f"MLA-{mla_default}"
    if req.variant == "mha":
        return "MHA"
    if req.variant == "mqa":
        return "MQA" if h > 1 else "MHA"
    if req.variant == "gqa":
        k = user_kv if user_kv is not None else start_kv
        if k in (1, h):  # GQA asked with a count that makes it MHA/MQA: take the nearest GQA
            k = next((x for x in sorted(divisors(h), reverse=True) if 1 < x < h), k)
        return AttentionGeometry(h, h, k).label
    if user_kv is not None:
        return AttentionGeometry(h, h, user_kv).label
    return None


def _rank(pick: Candidate, cands) -> list[Candidate]:
    others = [x for x in cands if x is not pick]
    fitting = sorted((x for x in others if x.fit.fits), key=lambda x: (-_kv_elements(x), x.label))
    rest = sorted((x for x in others if not x.fit.fits), key=lambda x: (x.kv_bytes, x.label))
    return [pick, *fitting, *rest]


def _at(req: Request) -> str:
    return f"{fmt_tokens(req.context)} x {req.batch}"


def _device_words(req: Request) -> str:
    return (f"{req.n_devices} x {req.device.name}" if req.n_devices > 1 else req.device.name)


def _usable(req: Request) -> str:
    """The one memory figure every line quotes: what the devices hold less the reserve."""
    return (f"{fmt_bytes(int((1 - RESERVE) * req.device.memory * req.n_devices))} usable on "
            f"{_device_words(req)}")


def _total(c: Candidate) -> str:
    return fmt_bytes(c.kv_bytes + c.fit.weights_bytes)


def _fit_words(c: Candidate) -> str:
    f = c.fit
    if not f.weights_fit:
        return f"but the {fmt_bytes(f.weights_bytes)} of weights alone exceed the {fmt_bytes(f.usable_bytes)} usable"
    verdict = "which fits in" if f.fits else "more than"
    return (f"with {fmt_bytes(f.weights_bytes)} of weights {_total(c)}, {verdict} the "
            f"{fmt_bytes(f.usable_bytes)} usable")


# --- warnings shared with the accounting of real configs ---------------------------


def mha_warnings(model: ModelGeometry, context: int, batch: int, dtype) -> list[str]:
    """MHA with more than 16 heads beyond 32K context: price the cache, offer GQA and MLA."""
    a = model.attention
    if not (model.causal and a.kind == "MHA" and a.n_heads > MHA_MAX_HEADS
            and context > LONG_CONTEXT):
        return []
    d = a.head_dim
    k = _gqa8(a.n_heads)
    gqa = replace(model, attention=replace(a, n_kv_heads=k))
    mla = replace(model, attention=_mla(a.d_model, a.n_heads, d, 4 * d))
    one = model_kv_cache_bytes(model, context, 1, dtype)
    return [
        f"MHA with {a.n_heads} heads at {fmt_tokens(context)} context: the KV cache is "
        f"{fmt_bytes(one)} per sequence ({fmt_bytes(one * batch)} at batch {batch}); "
        f"GQA-{k} would need {fmt_bytes(model_kv_cache_bytes(gqa, context, batch, dtype))} and "
        f"MLA-{4 * d} {fmt_bytes(model_kv_cache_bytes(mla, context, batch, dtype))} at batch "
        f"{batch}"
    ]


def head_dim_warnings(model: ModelGeometry) -> list[str]:
    """Heads narrower than MIN_HEAD_DIM, for a real config as for a recommendation."""
    return _head_dim_warnings(model.attention.d_model, model.attention.head_dim)


def _head_dim_warnings(d_model: int, d: int) -> list[str]:
    if d >= MIN_HEAD_DIM:
        return []
    wider = f" (e.g. {d_model // 64} heads of 64)" if d_model % 64 == 0 else ""
    return [f"head_dim {d} is below {MIN_HEAD_DIM}: each head's q.k has too few dimensions to "
            f"separate tokens and positions; use fewer, wider heads{wider}"]


# --- init scales and the check ------------------------------------------------------


def init_scales(model: ModelGeometry) -> dict:
    """Normal init std for each projection, with the rule that gives it.

    Inputs (q, k, v and MLA's down-projections): 1/sqrt(fan_in), which keeps q.k/sqrt(D)
    at unit variance at init. Output o: 1/sqrt(fan_in) / sqrt(2 * n_layers), the GPT-2
    residual scaling, so that the residual stream does not grow with depth.
    """
    a, L = model.attention, model.n_layers

    def rule(fan_in: int, name: str, depth: bool = False) -> dict:
        std = 1 / math.sqrt(fan_in) / (math.sqrt(2 * L) if depth else 1)
        text = f"1/sqrt({name})" + (" / sqrt(2 * n_layers)" if depth else "")
        return {"std": std, "rule": text}

    if isinstance(a, LatentGeometry):
        scales = {"q": rule(a.d_model, "d_model")} if a.q_rank is None else {
            "q_a": rule(a.d_model, "d_model"), "q_b": rule(a.q_rank, "q_rank")}
        scales |= {"kv_a": rule(a.d_model, "d_model"), "kv_b": rule(a.kv_rank, "kv_rank"),
                   "o": rule(a.n_heads * a.v_head_dim, "n_heads * v_head_dim", depth=True)}
        return scales
    return {"q": rule(a.d_model, "d_model"), "k": rule(a.d_model, "d_model"),
            "v": rule(a.d_model, "d_model"),
            "o": rule(a.n_heads * a.v_head_dim, "n_heads * head_dim", depth=True)}


# What CHECK_TAKES says comes from a timed run of the check (docs/plan.md, "The check's time").
CHECK_TAKES = ("about 15 minutes on one CPU core for 16 heads of 128 (fewer or narrower heads: less); "
               "it prints its expected time after 40 steps; --quick: a smoke run of under a minute")


def induction_check(model: ModelGeometry) -> dict:
    """The check to run: 2 layers of this geometry should learn induction (A B ... A -> B).

    The flags are those of `multihead lab induction`, which trains this head geometry
    scaled down to a CPU-sized model with the same head_dim, group ratio H/Hkv and
    rope_dim (and says what it scaled). head_dim is d_model / n_heads there, as it is in
    every geometry the recommender produces.
    """
    a = model.attention
    variant = a.kind.lower()
    args = f"--variant {variant} --n-layers 2 --d-model {a.d_model} --n-heads {a.n_heads}"
    if isinstance(a, LatentGeometry):
        args += f" --kv-rank {a.kv_rank} --rope-dim {a.rope_dim}"
    elif a.kind == "GQA":
        args += f" --n-kv-heads {a.n_kv_heads}"
    return {
        "command": f"multihead lab induction {args}",
        "expect": "a 2-layer model of this geometry solves A B ... A -> B at >= 95% accuracy",
        "threshold": 0.95,
        "takes": CHECK_TAKES,
    }


"""The knobs of every lab experiment, as small frozen dataclasses (no torch here).

They live apart from the experiments so that `multihead lab --help` can show every
default (and the `--quick` one) without importing torch. Each experiment module
re-exports its own (`multihead.lab.heads.HeadsConfig`, ...).

`scale_induction` turns a real model's head geometry (what `multihead plan` recommends:
`--n-layers 2 --d-model 4096 --n-heads 32 --n-kv-heads 4`) into one that trains in minutes
on a CPU, keeping what decides how attention works: the head dim D, the group ratio
G = H / Hkv, and MLA's rope_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from multihead.checks import check_divisible, check_kv_heads, check_nonnegative_int, check_positive_int, variant_name

__all__ = ["HeadsConfig", "InductionConfig", "KVConfig", "MLAConfig", "VARIANTS", "scale_induction"]

@dataclass(frozen=True)
class HeadsConfig:
    """Knobs of the heads experiment (all recorded in results.json)."""

    d_model: int = 64
    head_counts: tuple[int, ...] = (1, 2, 4, 8, 16)
    n_seeds: int = 3
    steps: int = 400
    batch_size: int = 32
    seq_len: int = 24  # L: tokens to copy
    vocab: int = 32  # random symbols (the separator is one more)
    lr: float = 1e-3
    warmup: int = 50
    threshold: float = 0.1  # nats: "learned" when the smoothed training loss is below
    eval_batches: int = 8
    smooth: int = 10  # steps in the moving average for steps-to-threshold

    @classmethod
    def quick(cls) -> HeadsConfig:
        return cls(head_counts=(1, 16), n_seeds=2, steps=120, seq_len=8, vocab=16, lr=3e-3, warmup=10,
                   threshold=0.5, eval_batches=2)


@dataclass(frozen=True)
class KVConfig:
    d_model: int = 512
    n_heads: int = 8
    context: int = 2048  # N: cached tokens
    kv_heads: tuple[int, ...] = (8, 4, 2, 1)  # MHA, GQA-4, GQA-2, MQA
    mla_ranks: tuple[int, ...] = (128, 256)
    mla_rope_dim: int = 32
    batch: int = 1
    decode_steps: int = 32
    warmup_steps: int = 4
    bias: bool = False

    @classmethod
    def quick(cls) -> KVConfig:
        return cls(d_model=128, n_heads=4, context=256, kv_heads=(4, 2, 1), mla_ranks=(32,), mla_rope_dim=8,
                   decode_steps=8, warmup_steps=2)


@dataclass(frozen=True)
class MLAConfig:
    corpus: str | None = None  # None: the King James Bible shipped with multihead
    max_chars: int | None = None  # use only the first max_chars characters
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 8
    context: int = 64
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    kv_heads: tuple[int, ...] = (2, 1)  # GQA/MQA to train beside (2 * Hkv * D values per token)
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 40
    finetune_steps: int = 100
    finetune_lr: float = 1e-3
    eval_every: int = 50
    eval_batches: int = 16
    val_fraction: float = 0.1
    tolerance: float = 1.0  # bits/char above MHA still "within tolerance"
    budget: float = 1 / 8  # cache must be below this fraction of MHA's

    @classmethod
    def quick(cls) -> MLAConfig:
        return cls(max_chars=300_000, d_model=64, n_layers=1, n_heads=4, context=48, ranks=(4, 16), kv_heads=(1,),
                   steps=80, batch_size=16, warmup=10, finetune_steps=15, eval_every=40, eval_batches=4)

    def __post_init__(self):
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1); received {self.val_fraction}")
        check_divisible("d_model", self.d_model, "n_heads", self.n_heads)


@dataclass(frozen=True)
class InductionConfig:
    vocab: int = 64
    seq_len: int = 64  # tokens per sequence
    seg_min: int = 20  # length of the repeated segment
    seg_max: int = 31
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    eval_every: int = 20
    eval_sequences: int = 256
    score_sequences: int = 8  # random repeated sequences for the role scores
    target_accuracy: float = 0.95
    positions: str = "rope"  # relative positions: a previous-token head is easy to form (MHA/GQA/MQA)
    n_kv_heads: int | None = None  # Hkv (None: n_heads, MHA; 1: MQA; else GQA)
    head_dim: int | None = None  # D (None: d_model // n_heads)
    attention: str = "mha"  # "mha" (MHA, GQA, MQA by n_kv_heads) or "mla"
    kv_rank: int | None = None  # MLA's latent rank R
    rope_dim: int = 0  # MLA's decoupled RoPE dims (MLA takes its positions from them, not `positions`)
    scaled_from: str | None = None  # the geometry asked for, when this one is its CPU-sized version

    @classmethod
    def quick(cls) -> InductionConfig:
        return cls(vocab=32, seq_len=32, seg_min=10, seg_max=15, n_heads=2, steps=250, eval_every=50,
                   eval_sequences=64, score_sequences=2)

    def __post_init__(self):
        if not 2 <= self.seg_min <= self.seg_max <= self.seq_len // 2:
            raise ValueError(f"need 2 <= seg_min ({self.seg_min}) <= seg_max ({self.seg_max}) <= seq_len / 2 "
                             f"({self.seq_len // 2})")
        if self.seg_max >= self.vocab:
            raise ValueError(f"seg_max ({self.seg_max}) must be below vocab ({self.vocab}): segment tokens are "
                             "distinct, so each A has one B")
        if self.head_dim is None:
            check_divisible("d_model", self.d_model, "n_heads", self.n_heads)
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention must be 'mha' or 'mla'; received {self.attention!r}")
        if self.attention == "mla" and self.kv_rank is None:
            raise ValueError("attention='mla' needs kv_rank")
        check_kv_heads(self.n_heads, self.n_kv_heads)
        D = self.head_dim or self.d_model // self.n_heads
        if self.attention == "mha" and self.positions == "rope" and D % 2:
            raise ValueError(f"head_dim {D} is odd, and rotary positions turn pairs of dims; choose n_heads so that "
                             f"d_model / n_heads is even (d_model {self.d_model}, n_heads {self.n_heads})")


VARIANTS = ("mha", "gqa", "mqa", "mla")

# Past these the induction model stops being a minutes-on-a-CPU run, and is scaled down:
# widths (C, and H * D the query width) and depth of the induction check's 2-layer model.
CPU_D_MODEL, CPU_QUERY_WIDTH, CPU_LAYERS = 256, 1024, 4
SCALED_D_MODEL, SCALED_LAYERS, SCALED_HEADS = 64, 2, 4


def scale_induction(*, variant: str | None = None, layers: int | None = None, d_model: int | None = None,
                    n_heads: int | None = None, n_kv_heads: int | None = None, kv_rank: int | None = None,
                    rope_dim: int | None = None, base: InductionConfig | None = None, quick: bool = False
                    ) -> tuple[dict, list[str]]:
    """InductionConfig fields for a head geometry, and the lines saying what was scaled.

    The geometry is checked as given (variant against n_kv_heads / kv_rank, divisibility),
    then, if it is larger than a CPU trains in minutes (d_model above 256, query width
    H * D above 1024, or more than 4 layers), scaled down keeping the head dim D = C / H,
    the group ratio G = H / Hkv and rope_dim exactly:

    - layers -> 2 (a previous-token head, then an induction head);
    - d_model -> 64 (the residual width; each head still has its D dims);
    - Hkv -> the fewest KV heads with at least 4 query heads (2 at least for GQA, so that
      it stays GQA), H -> G * Hkv (an MQA model, G = H, keeps all its H heads: fewer would
      change the ratio); MLA: H -> at most 4;
    - MLA's kv_rank R -> R * 64 / C (the latent's share of the width), at least 8.

    With `quick`, a scaled geometry also trains a smoke run (100 steps of 16 sequences):
    its heads are wide (16 heads of 128 for a 7B's GQA), so the usual quick run would take
    minutes rather than seconds.

    Raises ValueError (naming the flags) for a geometry that is not one.
    """
    base = base or InductionConfig()
    given = {k: v for k, v in dict(layers=layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                    kv_rank=kv_rank, rope_dim=rope_dim).items() if v is not None}
    if variant is None and not given:
        return {}, []
    L = base.n_layers if layers is None else layers
    C = base.d_model if d_model is None else d_model
    H = base.n_heads if n_heads is None else n_heads
    for flag, v in (("--n-layers", L), ("--d-model", C), ("--n-heads", H), ("--n-kv-heads", n_kv_heads),
                    ("--kv-rank", kv_rank)):
        if v is not None:
            check_positive_int(flag, v)
    if rope_dim is not None:
        check_nonnegative_int("--rope-dim", rope_dim)
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"--variant must be one of {', '.join(VARIANTS)}; received {variant!r}")
    variant, n_kv_heads = _checked_variant(variant, H, n_kv_heads, kv_rank, rope_dim)
    check_divisible("--d-model", C, "--n-heads", H)
    D = C // H
    P = rope_dim or 0
    fields = dict(n_layers=L, d_model=C, n_heads=H, head_dim=D)
    if variant == "mla":
        fields |= dict(attention="mla", kv_rank=kv_rank, rope_dim=P, n_kv_heads=None)
    else:
        fields |= dict(attention="mha", n_kv_heads=n_kv_heads)
    if C <= CPU_D_MODEL and H * D <= CPU_QUERY_WIDTH and L <= CPU_LAYERS:
        return fields, []
    return _scaled(fields, variant, L, C, H, n_kv_heads, kv_rank, P, quick)


def _checked_variant(variant: str | None, H: int, n_kv_heads: int | None, kv_rank: int | None,
                     rope_dim: int | None) -> tuple[str, int | None]:
    """(variant, n_kv_heads): the variant inferred from the flags when not given, checked
    against them, and MHA's / MQA's KV head count filled in."""
    if variant is None:
        variant = "mla" if kv_rank is not None else variant_name(H, n_kv_heads or H).lower()
    if variant == "mla":
        if kv_rank is None:
            raise ValueError("--variant mla needs --kv-rank R (the latent rank), e.g. --kv-rank 512")
        if n_kv_heads is not None:
            raise ValueError(f"--n-kv-heads ({n_kv_heads}) is for MHA/GQA/MQA; MLA caches a latent of --kv-rank")
    else:
        if kv_rank is not None or rope_dim:
            raise ValueError(f"--kv-rank/--rope-dim are MLA's; --variant {variant} takes --n-kv-heads")
        want = {"mha": H, "mqa": 1}.get(variant)
        if variant == "gqa" and n_kv_heads is None:
            raise ValueError(f"--variant gqa needs --n-kv-heads K (a divisor of --n-heads {H} between 1 and {H})")
        if want is not None and n_kv_heads not in (None, want):
            raise ValueError(f"--variant {variant} has {want} KV head{'s' if want > 1 else ''}; "
                             f"received --n-kv-heads {n_kv_heads}")
        n_kv_heads = want if n_kv_heads is None else n_kv_heads
        check_kv_heads(H, n_kv_heads, n_heads_name="--n-heads", n_kv_heads_name="--n-kv-heads")
        if variant == "gqa" and n_kv_heads in (1, H):
            raise ValueError(f"--variant gqa needs 1 < --n-kv-heads < --n-heads ({H}); received {n_kv_heads} "
                             f"(that is {'MQA' if n_kv_heads == 1 else 'MHA'})")
    return variant, n_kv_heads


def _scaled(fields: dict, variant: str, L: int, C: int, H: int, n_kv_heads: int | None, kv_rank: int | None,
            P: int, quick: bool) -> tuple[dict, list[str]]:
    """A geometry too large for a CPU scaled down as `scale_induction` says, and the notes."""
    D = C // H
    asked = (f"{L} layer{'s' if L > 1 else ''}, d_model {C}, {H} heads of {D}"
             + (f", kv_rank {kv_rank}, rope_dim {P} (MLA)" if variant == "mla"
                else f", {n_kv_heads} KV head{'s' if n_kv_heads > 1 else ''} ({variant.upper()})"))
    L2, C2 = min(L, SCALED_LAYERS), min(C, SCALED_D_MODEL)
    if variant == "mla":
        H2 = min(H, SCALED_HEADS)
        R2 = max(8, math.ceil(kv_rank * C2 / C))
        fields |= dict(n_layers=L2, d_model=C2, n_heads=H2, kv_rank=R2)
        kept = f"head_dim {D} and rope_dim {P} kept"
        heads = [f"n_heads {H} -> {H2}"] * (H != H2) + [f"kv_rank {kv_rank} -> {R2} (R / d_model kept, at least 8)"
                                                          ] * (kv_rank != R2)
    else:
        G = H // n_kv_heads
        # the fewest KV heads with >= 4 query heads; GQA keeps two groups at least, so it stays GQA
        K2 = max(2 if variant == "gqa" else 1, min(n_kv_heads, SCALED_HEADS // G))
        H2 = G * K2
        fields |= dict(n_layers=L2, d_model=C2, n_heads=H2, n_kv_heads=K2)
        kept = f"head_dim {D} and n_heads / n_kv_heads = {G} kept"
        heads = [f"n_heads {H} -> {H2}"] * (H != H2) + [f"n_kv_heads {n_kv_heads} -> {K2}"] * (n_kv_heads != K2)
    fields["scaled_from"] = asked
    changed = [f"{name} {a} -> {b}" for name, a, b in (("layers", L, L2), ("d_model", C, C2)) if a != b]
    notes = [f"scaled to train in minutes on a CPU: {', '.join(changed + heads)}; {kept}", f"asked: {asked}"]
    if quick:
        fields |= QUICK_SCALED
        notes.append(f"--quick: a smoke run of {QUICK_SCALED['steps']} steps of {QUICK_SCALED['batch_size']} "
                     "sequences (induction needs the full run to form)")
    return fields, notes


# --quick for a scaled geometry: its heads are wide, so fewer and smaller steps
QUICK_SCALED = {"steps": 100, "batch_size": 16, "eval_every": 25, "eval_sequences": 32}

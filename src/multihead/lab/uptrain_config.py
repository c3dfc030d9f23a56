"""The knobs of `multihead lab uptrain` (no torch here, so `--help` stays light).

The base model's fields (corpus, width, heads, context, batch, learning rate, warmup,
validation split) are those of `MLAConfig` with the same defaults but for the steps
(1200 here, 400 there), so that the MHA baseline trained here is the one `multihead lab
mla --steps 1200` trains with the same seed, and `--from` a `lab mla` run reuses that
run's own settings.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from multihead.checks import check_divisible, check_int, check_positive_int, check_positive_number, divisors

__all__ = ["UptrainConfig", "parse_fractions", "parse_inits", "parse_mla_targets", "parse_rope_dims"]

_INITS = ("mean", "first", "random")


@dataclass(frozen=True)
class UptrainConfig:
    corpus: str | None = None  # None: the King James Bible shipped with multihead
    max_chars: int | None = None
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 8
    context: int = 64
    steps: int = 1200  # the MHA baseline's steps; the scratch models train as many
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 40
    eval_batches: int = 16
    val_fraction: float = 0.1
    kv_heads: tuple[int, ...] = (1, 2, 4)  # MQA, GQA-2, GQA-4
    inits: tuple[str, ...] = _INITS
    ranks: tuple[int, ...] = (32, 64)  # MLA latent ranks (the caches of MQA and GQA-2 at the defaults)
    fractions: tuple[float, ...] = (0.0, 0.025, 0.05, 0.1)  # uptraining, as a fraction of `steps`
    uptrain_lr: float | None = None  # None: where the baseline's schedule ended, 0.1 * lr
    positions: str = "learned"  # the baseline's: "learned" (as lab mla) or "rope" (rotary, every head dim)
    mla_rope_dims: tuple[int, ...] = (0, 8)  # positions "rope": MLA's decoupled RoPE dims (to_mla's rope_dim)
    from_checkpoint: str | None = None  # a `lab mla` run folder (its MHA model/ and results.json)

    @classmethod
    def quick(cls) -> UptrainConfig:
        return cls(max_chars=300_000, d_model=32, n_layers=1, n_heads=4, context=32, steps=80, batch_size=8,
                   warmup=8, eval_batches=2, kv_heads=(1, 2), ranks=(8,))

    def __post_init__(self):
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1); received {self.val_fraction}")
        if self.from_checkpoint is None:  # else the run's own width and heads, once read (check_geometry)
            self.check_geometry()
        unknown = [i for i in self.inits if i not in _INITS]
        if unknown or not self.inits:
            raise ValueError(f"inits must be some of {', '.join(_INITS)}; received {','.join(self.inits)!r}")
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"positions must be 'learned' or 'rope'; received {self.positions!r}")
        check_positive_number("uptrain_lr", self.uptrain_lr, allow_none=True)
        if any(not 0 <= f <= 1 for f in self.fractions) or 0.0 not in self.fractions:
            raise ValueError(f"fractions must lie in [0, 1] and include 0 (the conversion alone); "
                             f"received {', '.join(map(str, self.fractions))}")

    def check_geometry(self) -> None:
        """The targets against the baseline's width and heads: kv_heads divide n_heads, ranks at
        most d_model, MLA rope dims within the head dim. With `from_checkpoint`, the baseline is
        that run's, so this runs once its settings are in (`--quick` gives no width then)."""
        check_divisible("d_model", self.d_model, "n_heads", self.n_heads)
        for h in self.kv_heads:
            check_positive_int("n_kv_heads", h)
        bad = [h for h in self.kv_heads if self.n_heads % h or h == self.n_heads]
        if bad:  # not check_kv_heads: n_heads itself is the MHA baseline, not a target
            valid = [d for d in divisors(self.n_heads) if d < self.n_heads]
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({bad[0]}), a count below "
                             f"n_heads; valid: {', '.join(map(str, valid))}")
        D = self.d_model // self.n_heads
        for p in self.mla_rope_dims:
            check_int("mla_rope_dims", p)
        if any(p < 0 or p % 2 or p > D for p in self.mla_rope_dims):
            raise ValueError(f"mla_rope_dims must be even ints in 0..{D} (the head dim); "
                             f"received {', '.join(map(str, self.mla_rope_dims))}")
        if any(r > self.d_model for r in self.ranks):
            raise ValueError(f"kv_rank must be at most d_model ({self.d_model}), the rank of the stacked K/V "
                             f"projections; received {', '.join(map(str, self.ranks))}")

    @property
    def uptrain_peak_lr(self) -> float:
        """The uptraining's peak learning rate: the baseline's final one (its cosine ends at
        10% of lr), so that uptraining continues the run where it stopped."""
        return 0.1 * self.lr if self.uptrain_lr is None else self.uptrain_lr

    def uptrain_steps(self, fraction: float) -> int:
        """Steps of uptraining for a fraction of the original run (at least 1 when above 0)."""
        return 0 if fraction == 0 else max(1, round(fraction * self.steps))


def parse_fractions(text: str) -> tuple[float, ...]:
    """argparse type of --fractions: comma-separated numbers in [0, 1]; 0 is always added."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions like 0,0.05,0.1; "
                                         f"received {text!r}") from None
    if not values or len(values) > 16 or any(not (math.isfinite(v) and 0 <= v <= 1) for v in values):
        raise argparse.ArgumentTypeError(f"expected 1 to 16 fractions in [0, 1] like 0,0.05,0.1; received {text!r}")
    return tuple(sorted({0.0, *values}))


def parse_rope_dims(text: str) -> tuple[int, ...]:
    """argparse type of --mla-rope-dims: comma-separated even ints >= 0."""
    try:
        values = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        values = ()
    if not values or len(values) > 16 or any(v < 0 or v % 2 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated even integers >= 0 like 0,8; received {text!r}")
    return values


def parse_mla_targets(text: str) -> tuple[int | tuple[int, int], ...]:
    """argparse type of uptrain's --kv-ranks: comma-separated MLA targets, each a kv_rank R (at
    --rope-dim) or R+P (kv_rank R with P decoupled RoPE dims), like 64,144+72."""
    values: list[int | tuple[int, int]] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        rank, plus, rope = item.partition("+")
        try:
            r, p = int(rank), (int(rope) if plus else None)
        except ValueError:
            r, p = 0, None
        if r < 1 or r > 10**7 or (plus and (p is None or p < 0 or p % 2)):
            raise argparse.ArgumentTypeError(f"expected comma-separated kv_ranks R or R+P (P an even RoPE width) "
                                             f"like 64,144+72; received {text!r}")
        values.append(r if p is None else (r, p))
    if not values or len(values) > 16:
        raise argparse.ArgumentTypeError(f"expected 1 to 16 kv_ranks R or R+P like 64,144+72; received {text!r}")
    return tuple(dict.fromkeys(values))


def parse_inits(text: str) -> tuple[str, ...]:
    """argparse type of --inits: some of mean, first, random, aligned (aligned: with --model,
    a transformers model's merge fitted on calibration tokens; the lab model's config refuses it)."""
    values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not values or any(v not in (*_INITS, "aligned") for v in values):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(_INITS)},aligned; received {text!r}")
    return values

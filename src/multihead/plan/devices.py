"""Accelerators by exact name (memory, bandwidth), and what a model needs on one.

Memory is the vendor's figure read in binary units (an "80GB" H100 has 80 GiB of HBM;
the driver keeps a little of it, which the reserve below covers). Bandwidth is the
vendor's peak in decimal bytes/s. Anything else: `custom_device(memory, bandwidth)`, or
`--memory 48GiB --bandwidth 960GB/s` on the command line.

Decode is memory-bound at the batch sizes people serve with: each step reads the
weights once and the whole KV cache once, so step time >= bytes read / bandwidth. That
floor is the estimate plan gives; real kernels reach 60-90% of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from multihead.checks import check_positive_int
from multihead.plan.geometry import (
    ModelGeometry,
    kv_bytes_per_token,
    model_kv_cache_bytes,
    param_counts,
)
from multihead.plan.units import bytes_for, dtype_bits

GiB = 2**30
GB = 10**9
TB = 10**12

# Fraction of device memory kept for activations, the CUDA context, and allocator
# fragmentation; the KV cache gets what is left beside the weights.
RESERVE = 0.10


@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes
    bandwidth: int  # bytes/s
    note: str = ""

    def __post_init__(self):
        check_positive_int("memory", self.memory)
        check_positive_int("bandwidth", self.bandwidth)


DEVICES: dict[str, Device] = {
    d.name: d
    for d in [
        Device("h100-80gb", 80 * GiB, 3_350 * GB, "H100 SXM5, HBM3"),
        Device("h100-pcie", 80 * GiB, 2_000 * GB, "H100 PCIe, HBM2e"),
        Device("h200", 141 * GiB, 4_800 * GB, "H200 SXM, HBM3e"),
        Device("b200", 180 * GiB, 8_000 * GB, "B200 as in DGX B200, HBM3e"),
        Device("a100-40gb", 40 * GiB, 1_555 * GB, "A100 SXM4 40GB, HBM2"),
        Device("a100-80gb", 80 * GiB, 2_039 * GB, "A100 SXM4 80GB, HBM2e"),
        Device("mi300x", 192 * GiB, 5_300 * GB, "AMD MI300X, HBM3"),
        Device("l40s", 48 * GiB, 864 * GB, "L40S, GDDR6"),
        Device("l4", 24 * GiB, 300 * GB, "L4, GDDR6"),
        Device("a10g", 24 * GiB, 600 * GB, "A10G, GDDR6"),
        Device("t4", 16 * GiB, 320 * GB, "T4, GDDR6"),
        Device("rtx-4090", 24 * GiB, 1_008 * GB, "GeForce RTX 4090, GDDR6X"),
        Device("rtx-3090", 24 * GiB, 936 * GB, "GeForce RTX 3090, GDDR6X"),
        Device("m2-max", 96 * GiB, 400 * GB, "Apple M2 Max, largest unified memory"),
        Device("m2-ultra", 192 * GiB, 800 * GB, "Apple M2 Ultra, largest unified memory"),
        Device("m3-max", 128 * GiB, 400 * GB, "Apple M3 Max (16-core CPU), largest memory"),
        Device("m4-max", 128 * GiB, 546 * GB, "Apple M4 Max, largest unified memory"),
        Device("cpu", 64 * GiB, 100 * GB, "a desktop with dual-channel DDR5; pass "
                                           "--memory/--bandwidth for yours"),
    ]
}


def get_device(name: str) -> Device:
    """A device by its exact name (case-insensitive); an unknown name lists the valid ones."""
    if not isinstance(name, str):
        raise TypeError(f"device must be a name; received {name!r}")
    key = name.strip().lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}{_did_you_mean(key)}; valid: {', '.join(DEVICES)} "
                         "(or give --memory and --bandwidth)")
    return DEVICES[key]


def _did_you_mean(key: str) -> str:
    """' (did you mean h100-80gb or h100-pcie?)' for 'h100': the presets that start with what was
    typed (a family name), else the close spellings."""
    import difflib

    close = [n for n in DEVICES if key and n.startswith(key.replace(" ", "-"))]
    close = close or difflib.get_close_matches(key, list(DEVICES), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def custom_device(memory: int, bandwidth: int, name: str = "custom") -> Device:
    return Device(name, memory, bandwidth)


@dataclass(frozen=True)
class Fit:
    """A model on `n_devices` of `device` at a context length and batch.

    usable = (1 - RESERVE) * memory * n_devices; the KV cache gets usable - weights.
    decode_s is the memory-bound floor of one decode step (one token for each of the
    `batch` sequences): (weights read + cache read) / (bandwidth * n_devices).
    Weights read are all parameters except the input-side embedding tables (a step
    looks up `batch` rows of them) and, for MoE, the experts that `batch` tokens route to.
    """

    device: Device
    n_devices: int
    context: int
    batch: int
    kv_dtype: str
    weights_dtype: str
    weights_bytes: int
    kv_bytes: int
    usable_bytes: int
    weights_read_bytes: int

    @property
    def free_bytes(self) -> int:
        """Memory left for the KV cache beside the weights (negative: weights don't fit)."""
        return self.usable_bytes - self.weights_bytes

    @property
    def weights_fit(self) -> bool:
        return self.free_bytes >= 0

    @property
    def fits(self) -> bool:
        return self.weights_fit and self.kv_bytes <= self.free_bytes

    @property
    def decode_s(self) -> float:
        return (self.weights_read_bytes + self.kv_bytes) / (self.device.bandwidth * self.n_devices)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.decode_s


def weights_read_per_step(model: ModelGeometry, batch: int, weights_dtype="bf16") -> int:
    counts = param_counts(model)
    c = model.d_model
    read = counts.total
    # Input tables are looked up, not streamed; a tied table is streamed as the LM head.
    read -= (model.max_positions + model.token_types) * c
    if not (model.tied_embeddings and model.lm_head):
        read -= model.vocab_size * c
    if model.moe is not None:
        moe = model.moe
        read -= model.n_moe_layers * moe.params(c)
        read += model.n_moe_layers * round(moe.active_params(c, tokens=batch))
    return bytes_for(read, weights_dtype)


def fit(model: ModelGeometry, device: Device, context: int, batch: int = 1, kv_dtype="bf16",
        weights_dtype="bf16", n_devices: int = 1) -> Fit:
    check_positive_int("n_devices", n_devices)
    dtype_bits(kv_dtype), dtype_bits(weights_dtype)  # validate names early
    return Fit(
        device=device,
        n_devices=n_devices,
        context=context,
        batch=batch,
        kv_dtype=str(kv_dtype),
        weights_dtype=str(weights_dtype),
        weights_bytes=bytes_for(param_counts(model).total, weights_dtype),
        kv_bytes=model_kv_cache_bytes(model, context, batch, kv_dtype),
        usable_bytes=int((1 - RESERVE) * device.memory * n_devices),
        weights_read_bytes=weights_read_per_step(model, batch, weights_dtype),
    )


def max_batch(model: ModelGeometry, f: Fit) -> int:
    """The most sequences of f.context tokens whose cache fits beside the weights."""
    one = model_kv_cache_bytes(model, f.context, 1, f.kv_dtype)
    if f.free_bytes <= 0:
        return 0
    return f.free_bytes // one if one else 0


def max_context(model: ModelGeometry, f: Fit, limit: int = 2**40) -> int:
    """The longest context whose cache for f.batch sequences fits beside the weights.

    Window-aware: past the window, windowed layers stop growing, so the cache is a
    monotone piecewise-linear function of the context; bisection finds the last fit.
    Returns `limit` when the cache stops growing (every layer windowed, or no cache).
    """
    if f.free_bytes <= 0:
        return 0
    if kv_bytes_per_token(model, f.kv_dtype) == 0:
        return limit

    def ok(t: int) -> bool:
        return model_kv_cache_bytes(model, t, f.batch, f.kv_dtype) <= f.free_bytes

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo

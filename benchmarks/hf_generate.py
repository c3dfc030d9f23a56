"""Greedy `generate` through `attn_implementation="multihead"` beside transformers' own sdpa,
and where multihead's per-layer microseconds go (fp32, CPU, B = 1).

    .venv/bin/python benchmarks/hf_generate.py            # 4-layer GQA Llama, 512-token prompt, 64 new tokens
    .venv/bin/python benchmarks/hf_generate.py --quick    # a smoke run
    .venv/bin/python benchmarks/hf_generate.py --model smollm2 --rounds 7 --calls 500   # the real model
    .venv/bin/python benchmarks/hf_generate.py --model smollm2 --rounds 7 --calls 500 --clock cpu  # on a busy machine
    .venv/bin/python benchmarks/hf_generate.py --model smollm2 --rounds 9 --control  # with an A/A control
    .venv/bin/python benchmarks/hf_generate.py --model smollm2 --rounds 9 --control --generate-only  # the target
      (whole generates and the step-by-step comparison only: about 5 minutes on a quiet 2-core machine)
    .venv/bin/python benchmarks/hf_generate.py --model gemma3 --prompt 4096 --rounds 2 --step-rounds 3 \
        --prefill-rounds 0 --control --generate-only --cache --json benchmarks/results/hf_generate_gemma3_4k.json
      (a prompt past Gemma 3's 512-token window: the windowed layers' caches roll; the cache's bytes)

One random-init Llama (--layers, --heads query heads, --kv-heads KV heads) generates
--new-tokens tokens greedily from the same prompt under each implementation, switched
with `model.set_attn_implementation` on the one model, in alternating order, for
--rounds rounds. Reported: seconds per generate (medians), the ratio multihead / sdpa
(median of per-round ratios) and whether both produced the same tokens. With --control,
sdpa also runs under a second name: its ratio to sdpa is the noise floor of the ratio on
that machine (attention is under a tenth of a SmolLM2 generate, so the two implementations'
whole difference is about a percent of it, below what a loaded machine resolves). Every
generate is timed by wall time and by the process's CPU time, with the load average after
each round.

Then the same ratio at a finer grain (`paired_steps`, skipped with --step-rounds 0): one
implementation name whose function (and mask builder) is chosen per forward, so the implementations take
turns step by step inside each generate (A B B A over consecutive decode steps, every
rotation in turn with the control; the same over forwards of the prompt for the prefill):
two compared steps lie milliseconds apart, not seconds, so the machine's drift and load hit
both alike, and the median over cycles resolves a fraction of a percent where whole
generates resolve a few. Reported: the decode
step's and the prefill's ratios, paired per cycle (wall and CPU), and the generate ratio
they add up to, (prefill + new tokens x step) over sdpa's, beside the A/A control's.

Then the per-call cost of the two attention functions alone (warm: one layer's call
repeated; and cold: `per_call_cold`, every layer in turn after its MLP, as a decode step
leaves the caches), on the shapes a decode step hands them (q `(1, H, 1, D)`, k/v
`(1, Hkv, S, D)`, no mask, as transformers passes for a causal model without padding),
in microseconds per call, with a cProfile breakdown of
multihead's call by function (cumulative microseconds per call; cProfile's own cost
inflates every line). And the same decode calls inside `generate` (see `in_loop`): the
two functions alone (medians), with the ratio multihead / sdpa paired per round (the
median decode call and the mean prefill call of each round's generate, and the load
average after each round), then their parts: torch's kernel, multihead's NaN-rule
check, and multihead's rest layer by layer (the HF function, `attend`, the backend).

--clock cpu times this thread's CPU time instead of wall time (one torch thread does all
the work): on a shared machine the preemptions then drop out of every figure (the cache
misses other processes cause do not). --generate-only skips the per-call parts.

What a decode step's attention costs in multihead, the parts the timers above split it into:
the HF function's decode branch (`attention_forward`: T = 1 and nothing but q, k, v; its
one transformers read, `config.output_attentions`, taken from the config's field where its
class has transformers' own property, not through the config's Python `__getattribute__`),
`attend`'s plain call (two folded checks, `validation.plain_shape`
and `plain_scale`) and `kernels.decode.step` (`sdpa.plain`: the G query heads folded
into the query length, one kernel call), then the NaN rule's check
(`functional._nan_or_zero_row`), one sum over the rows of `out`. A prefill (T == S, causal)
takes the same plain call, its check one sum of `out` and a count of its rows' nonzero
first elements. The committed JSON has the run's own figures; docs/benchmarks.md quotes them.

Writes a Markdown report to stdout and JSON to benchmarks/results/hf_generate.json (or --json).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine, write_json  # noqa: E402

# What every timing reads: wall time (the default, for a quiet machine), or with --clock cpu
# the CPU time of this thread (one torch thread: all of the work), which a loaded machine's
# preemptions do not inflate (its cache misses still do).
clock = time.perf_counter


def build(layers: int, heads: int, kv_heads: int, width: int, positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    import multihead.interop.hf  # noqa: F401  (registers "multihead")

    cfg = LlamaConfig(vocab_size=1000, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


CONTROL = "sdpa_again"  # transformers' own sdpa under a second name: what an A/A comparison reads


def register_control() -> None:
    """Register transformers' sdpa attention function and mask under `CONTROL`, so that a run
    measures sdpa against itself beside multihead (the ratio an identical implementation gets)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CONTROL, sdpa_attention_forward)
    AttentionMaskInterface.register(CONTROL, sdpa_mask)


def time_generate(model, prompt: torch.Tensor, new_tokens: int, rounds: int, control: bool = False) -> dict:
    """Whole generates, each implementation in turn (first in turn), `rounds` timed rounds after
    an untimed one: seconds per generate by `clock` (medians), the process's CPU seconds beside
    them (what preemptions by other processes do not inflate), ratios paired per round, and
    the load average after each round."""
    impls = ["sdpa", "multihead"] + ([CONTROL] if control else [])
    seconds: dict[str, list[float]] = {impl: [] for impl in impls}
    cpu: dict[str, list[float]] = {impl: [] for impl in impls}
    loads: list[float] = []
    tokens = {}
    for r in range(-1, rounds):  # round -1 warms every implementation (first calls, allocator), untimed
        order = impls[r % len(impls):] + impls[:r % len(impls)]  # each implementation first in turn
        for impl in order:
            model.set_attn_implementation(impl)
            t0, c0 = clock(), time.process_time()
            with torch.no_grad():
                tokens[impl] = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                              do_sample=False)
            if r >= 0:
                seconds[impl].append(clock() - t0)
                cpu[impl].append(time.process_time() - c0)
        if r >= 0:
            loads.append(os.getloadavg()[0])
    ratios = [m / s for m, s in zip(seconds["multihead"], seconds["sdpa"])]
    cpu_ratios = [m / s for m, s in zip(cpu["multihead"], cpu["sdpa"])]
    out = {"seconds": {k: statistics.median(v) for k, v in seconds.items()}, "rounds": seconds,
           "ratio": statistics.median(ratios), "ratios": ratios,
           "cpu_seconds": {k: statistics.median(v) for k, v in cpu.items()}, "cpu_rounds": cpu,
           "cpu_ratio": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios, "load_per_round": loads,
           "same_tokens": bool(torch.equal(tokens["sdpa"], tokens["multihead"]))}
    if control:
        again = [c / s for c, s in zip(seconds[CONTROL], seconds["sdpa"])]
        cpu_again = [c / s for c, s in zip(cpu[CONTROL], cpu["sdpa"])]
        out |= {"control_ratio": statistics.median(again), "control_ratios": again,
                "control_cpu_ratio": statistics.median(cpu_again), "control_cpu_ratios": cpu_again,
                "control_same_tokens": bool(torch.equal(tokens["sdpa"], tokens[CONTROL]))}
    return out


SWITCH = "bench_switch"  # one implementation name whose function is chosen per forward (`paired_steps`)


def _cycle(impls: list[str]) -> list[str]:
    """The order of one cycle: every rotation of `impls` in turn (A B B A for two; A B C B C A
    C A B for three), so each implementation stands once in every position (a drift that is
    linear over a cycle adds the same time to each) and follows another one as often as the
    others do (a step after a change of function finds its code colder)."""
    return [impl for i in range(len(impls)) for impl in impls[i:] + impls[:i]]


def paired_steps(model, prompt: torch.Tensor, new_tokens: int, rounds: int, control: bool = False,
                 prefill_rounds: int | None = None) -> dict:
    """The generate ratio at a finer grain: the implementations take turns step by step inside
    one generate (A B B A over consecutive decode steps: one registered function that calls the
    one chosen for the step), so the seconds between two compared steps are milliseconds, not
    the seconds between two whole generates, and a change of the machine's load hits both
    alike. Per cycle, each implementation's mean step time; the ratios to sdpa paired per
    cycle; medians over every cycle of `rounds` generates. The prompt's forward (the prefill)
    the same way: cycles of `model(prompt)`, `prefill_rounds` of them (default `rounds`; 0: none,
    and no generate estimate). Both by wall time
    (`clock`) and the process's CPU time. From the two, the generate ratio they add up to:
    (prefill + new_tokens x step) under multihead over the same under sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impls = ["sdpa", "multihead"] + ([CONTROL] if control else [])
    fns = {impl: ALL_ATTENTION_FUNCTIONS[impl] for impl in impls}
    builders = {impl: ALL_MASK_ATTENTION_FUNCTIONS[impl] for impl in impls}
    chosen = {"fn": fns["sdpa"], "impl": "sdpa", "t0": 0.0, "c0": 0.0, "decode": False}

    def switch(module, *args, **kwargs):
        return chosen["fn"](module, *args, **kwargs)

    def switch_mask(*args, **kwargs):  # each implementation's own mask builder (a forward builds its masks once)
        return builders[chosen["impl"]](*args, **kwargs)

    AttentionInterface.register(SWITCH, switch)
    AttentionMaskInterface.register(SWITCH, switch_mask)
    cycle = _cycle(impls)
    step = {"i": 0}
    taken: list[tuple[str, float, float]] = []  # (implementation, wall, CPU) of each decode step of a generate

    def pre(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        chosen["decode"] = ids is not None and ids.shape[1] == 1
        if chosen["decode"]:
            impl = cycle[step["i"] % len(cycle)]
            step["i"] += 1
            chosen["impl"], chosen["fn"] = impl, fns[impl]
        chosen["t0"], chosen["c0"] = clock(), time.process_time()

    def post(_module, _args, _kwargs, _out):
        if chosen["decode"]:
            taken.append((chosen["impl"], clock() - chosen["t0"], time.process_time() - chosen["c0"]))

    def cycles_of(rows: list[tuple[str, float, float]], which: int) -> list[dict[str, float]]:
        """Each whole cycle's mean time per implementation (a cycle cut short is dropped)."""
        n = len(rows) // len(cycle)
        out = []
        for c in range(n):
            part = rows[c * len(cycle):(c + 1) * len(cycle)]
            out.append({impl: statistics.mean(r[which] for r in part if r[0] == impl) for impl in impls})
        return out

    step_cycles: dict[str, list[dict[str, float]]] = {"wall": [], "cpu": []}
    prefill_cycles: dict[str, list[dict[str, float]]] = {"wall": [], "cpu": []}
    hooks = [model.register_forward_pre_hook(pre, with_kwargs=True),
             model.register_forward_hook(post, with_kwargs=True)]
    loads: list[float] = []
    same = True
    try:
        model.set_attn_implementation(SWITCH)
        with torch.no_grad():
            for r in range(rounds + 1):  # the first generate warms, untimed
                taken.clear()
                step["i"] = 0
                out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                if r == 0:
                    reference = out
                    continue
                same = same and torch.equal(out, reference)
                for which, name in ((1, "wall"), (2, "cpu")):
                    step_cycles[name] += cycles_of(taken, which)
                loads.append(os.getloadavg()[0])
            prefill_rounds = rounds if prefill_rounds is None else prefill_rounds
            for r in range(prefill_rounds + 1 if prefill_rounds else 0):  # the prompt's forward, in the same cycles
                rows = []
                for impl in cycle:
                    chosen["impl"], chosen["fn"] = impl, fns[impl]
                    t0, c0 = clock(), time.process_time()
                    model(prompt)
                    rows.append((impl, clock() - t0, time.process_time() - c0))
                if r:
                    for which, name in ((1, "wall"), (2, "cpu")):
                        prefill_cycles[name] += cycles_of(rows, which)
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation("sdpa")

    def summary(cycles: list[dict[str, float]]) -> dict:
        res = {"seconds": {impl: statistics.median(c[impl] for c in cycles) for impl in impls}, "cycles": len(cycles)}
        for impl in impls[1:]:
            ratios = [c[impl] / c["sdpa"] for c in cycles]
            res[f"{impl}_ratio"] = statistics.median(ratios)
            res[f"{impl}_ratio_quartiles"] = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios
        return res

    out = {"new_tokens": new_tokens, "rounds": rounds, "same_tokens_every_round": same, "load_per_round": loads}
    for clock_name in ("wall", "cpu"):
        d = summary(step_cycles[clock_name])
        if not prefill_cycles[clock_name]:
            out[clock_name] = {"decode_step": d, "prefill": None, "generate_ratio_estimate": None}
            continue
        p = summary(prefill_cycles[clock_name])
        est = {}
        for impl in impls[1:]:
            a = p["seconds"]["sdpa"] + new_tokens * d["seconds"]["sdpa"]
            est[impl] = (p["seconds"]["sdpa"] * p[f"{impl}_ratio"] + new_tokens * d["seconds"]["sdpa"]
                         * d[f"{impl}_ratio"]) / a
        out[clock_name] = {"decode_step": d, "prefill": p, "generate_ratio_estimate": est}
    return out


def cache_bytes(model, prompt: torch.Tensor, new_tokens: int, impls: list[str]) -> dict:
    """The K/V cache a greedy generate leaves under each implementation (transformers' own cache
    in both: "multihead" changes the attention function, not the cache): bytes of keys and
    values per layer and in all, the keys each layer holds, and what a cache holding every
    position in every layer would take (a sliding-window layer's cache rolls: it keeps the
    window's keys only)."""
    out = {}
    for impl in impls:
        model.set_attn_implementation(impl)
        with torch.no_grad():
            res = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 return_dict_in_generate=True)
        cache = res.past_key_values
        layers = []
        for layer in cache.layers:
            k, v = layer.keys, layer.values  # (B, Hkv, S, D)
            layers.append({"kind": type(layer).__name__, "keys": int(k.shape[2]), "bytes": k.nbytes + v.nbytes})
        per_position = [(layer.keys.nbytes + layer.values.nbytes) // max(1, layer.keys.shape[2])
                        for layer in cache.layers]
        positions = res.sequences.shape[1] - 1  # the last token is generated, not yet cached
        out[impl] = {"bytes": sum(x["bytes"] for x in layers), "layers": layers,
                     "every_position_bytes": sum(per_position) * positions, "positions": positions}
    model.set_attn_implementation("sdpa")
    return out


def per_call(model, S: int, calls: int, rounds: int) -> dict:
    """Microseconds per call of each attention function on a decode step's shapes."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from multihead.interop.hf.registry import attention_forward

    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    module = model.model.layers[0].self_attn
    q, k, v = torch.randn(1, H, 1, D), torch.randn(1, Hkv, S, D), torch.randn(1, Hkv, S, D)
    fns = {"sdpa": sdpa_attention_forward, "multihead": attention_forward}
    us: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fn in fns.items():
                fn(module, q, k, v, None, scaling=D ** -0.5)  # warm
                t0 = clock()
                for _ in range(calls):
                    fn(module, q, k, v, None, scaling=D ** -0.5)
                us[name].append((clock() - t0) / calls * 1e6)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            attention_forward(module, q, k, v, None, scaling=D ** -0.5)
        profile.disable()
    stats = pstats.Stats(profile)
    breakdown = []
    for (file, _line, func), (_cc, ncalls, _tt, ct, _callers) in stats.stats.items():
        if "multihead" in file and ncalls >= calls:
            breakdown.append({"function": f"{Path(file).stem}.{func}", "calls_per_call": ncalls / calls,
                              "us_per_call": ct / calls * 1e6})
    breakdown.sort(key=lambda r: -r["us_per_call"])
    med = {name: statistics.median(v) for name, v in us.items()}
    return {"S": S, "us_per_call": med, "extra_us": med["multihead"] - med["sdpa"],
            "profiled_breakdown": breakdown[:12]}


def per_call_cold(model, S: int, rounds: int) -> dict:
    """Microseconds per decode-step attention call with the caches a decode step leaves it, without
    `generate`'s other noise: each layer of the model in turn, with its own K/V (random, S keys),
    right after that layer's MLP on one token (for SmolLM2 ~10 MB of weights read between two
    attention calls, as in a decode step). Per round and function: the median over the layers
    of `layer_passes` passes; the two functions alternate in order; ratios paired per round."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from multihead.interop.hf.registry import attention_forward

    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    layers = list(model.model.layers)
    g = torch.Generator().manual_seed(0)
    qkv = [(torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, S, D, generator=g),
            torch.randn(1, Hkv, S, D, generator=g)) for _ in layers]
    x = torch.randn(1, 1, cfg.hidden_size, generator=g)
    extra = {"dropout": 0.0, "scaling": D ** -0.5, "position_ids": torch.arange(1)[None], "use_cache": True}
    fns = {"sdpa": sdpa_attention_forward, "multihead": attention_forward}
    us: dict[str, list[float]] = {name: [] for name in fns}
    loads = []
    layer_passes = 4
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 warms
            for name in (("sdpa", "multihead") if r % 2 else ("multihead", "sdpa")):
                fn, times = fns[name], []
                for _ in range(layer_passes):
                    for layer, (q, k, v) in zip(layers, qkv):
                        layer.mlp(x)
                        t0 = clock()
                        fn(layer.self_attn, q, k, v, None, **extra)
                        times.append(clock() - t0)
                if r:
                    us[name].append(statistics.median(times) * 1e6)
            loads.append(os.getloadavg()[0])
    ratios = [m / s for m, s in zip(us["multihead"], us["sdpa"])]
    return {"S": S, "layers": len(layers), "us_per_call": {name: statistics.median(t) for name, t in us.items()},
            "us_per_round": us, "ratios": ratios, "ratio": statistics.median(ratios), "load_per_round": loads[1:]}


def in_loop(model, prompt: torch.Tensor, new_tokens: int, rounds: int) -> dict:
    """Microseconds per decode-step attention call as the calls run inside `generate`, between
    the model's other layers (colder caches than a call timed alone).

    Two passes of `rounds` alternating generates. The first times the two attention functions
    alone, with the same wrapper around each (median and mean per call: the fair comparison).
    The second also times what runs inside them: torch's fused kernel (both), multihead's
    native kernel (where its decode step runs it, `kernels.decode.native_checked`) and its
    NaN-rule check, each per decode call of the function (0 where it never ran); "the rest"
    is the function less those (Python: the registry's and the kernel entry's checks
    (`functional.decode_step`, or `attend`), the backend's dispatch, the views), inflated by
    the inner timers' own ~1-2 us each."""
    import torch.nn.functional as F
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import multihead.functional as mh_functional
    from multihead.interop.hf import registry as mh_registry
    from multihead.kernels import decode as mh_decode

    spent: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}  # the attention functions' prefill calls (pass 1)
    state = {"impl": "", "decode": False}

    def timed(key: str, f):
        def g(*a, **k):
            t0 = clock()
            out = f(*a, **k)
            (spent if state["decode"] else prefill).setdefault(key, []).append(clock() - t0)
            return out
        return g

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    saved = {"sdpa": mapping["sdpa"], "multihead": mapping["multihead"], "kernel": F.scaled_dot_product_attention,
             "nan": mh_functional._nan_or_zero_row, "attend": mh_registry.attend, "backend": mh_functional._decode_step,
             "entry": mh_functional.decode_step, "native": mh_decode.native_checked}

    def entry(impl: str):
        inner = timed(f"{impl}: attention function", saved[impl])

        def g(module, query, *a, **k):
            state["impl"], state["decode"] = impl, query.shape[2] == 1
            return inner(module, query, *a, **k)
        return g

    kernels = {impl: timed(f"{impl}: torch's fused kernel", saved["kernel"]) for impl in ("sdpa", "multihead")}

    def kernel(*a, **k):
        return kernels[state["impl"]](*a, **k)

    rounds_of: dict[str, dict[str, list[float]]] = {"decode median": {}, "prefill mean": {}}
    loads: list[float] = []

    def generate(r: int) -> None:
        for impl in (("sdpa", "multihead") if r % 2 else ("multihead", "sdpa")):
            model.set_attn_implementation(impl)
            key = f"{impl}: attention function"
            seen = len(spent.get(key, []))
            prefill.pop(key, None)
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            rounds_of["decode median"].setdefault(impl, []).append(statistics.median(spent[key][seen:]) * 1e6)
            rounds_of["prefill mean"].setdefault(impl, []).append(statistics.mean(prefill[key]) * 1e6)
        loads.append(os.getloadavg()[0])

    try:
        mapping["sdpa"], mapping["multihead"] = entry("sdpa"), entry("multihead")
        for r in range(rounds):  # pass 1: the functions alone
            generate(r)
        alone = {key: list(times) for key, times in spent.items()}
        alone_rounds = {what: {impl: list(v) for impl, v in by.items()} for what, by in rounds_of.items()}
        alone_loads = list(loads)
        spent.clear()
        F.scaled_dot_product_attention = kernel
        mh_functional._nan_or_zero_row = timed("multihead: NaN-rule check", saved["nan"])
        mh_registry.attend = timed("multihead: attend", saved["attend"])
        # the kernel's entry on the decode step (attend's plain step without its argument handling): one key
        # with attend, which the HF function calls instead where the step is not plain
        mh_functional.decode_step = timed("multihead: attend", saved["entry"])
        mh_functional._decode_step = timed("multihead: decode step", saved["backend"])  # kernels.decode.step
        mh_decode.native_checked = timed("multihead: native kernel", saved["native"])
        for r in range(rounds):  # pass 2: and their parts
            generate(r)
    finally:
        mapping["sdpa"], mapping["multihead"] = saved["sdpa"], saved["multihead"]
        F.scaled_dot_product_attention = saved["kernel"]
        mh_functional._nan_or_zero_row = saved["nan"]
        mh_registry.attend, mh_functional._decode_step = saved["attend"], saved["backend"]
        mh_functional.decode_step, mh_decode.native_checked = saved["entry"], saved["native"]
    n = len(alone.get("multihead: attention function", [])) or 1
    # per decode call of each implementation's function: a part that runs on some steps only (the
    # kernel of the engine a step takes, the check where the kernel did not look) averages over all
    calls = {impl: len(spent.get(f"{impl}: attention function", [])) or 1 for impl in ("sdpa", "multihead")}
    us = {key: sum(t) / calls[key.split(": ", 1)[0]] * 1e6 for key, t in sorted(spent.items())}
    for key in ("torch's fused kernel", "native kernel", "NaN-rule check"):
        us.setdefault(f"multihead: {key}", 0.0)
    part = {key.split(": ", 1)[1]: us.get(key, 0.0) for key in us if key.startswith("multihead: ")}
    kernel = part["torch's fused kernel"] + part["native kernel"]
    us["sdpa: the rest"] = us.get("sdpa: attention function", 0.0) - us.get("sdpa: torch's fused kernel", 0.0)
    us["multihead: the rest"] = part["attention function"] - kernel - part["NaN-rule check"]
    split = {  # multihead's rest, layer by layer (each includes the inner timers' own cost)
        "the HF attention function around the kernel's entry, `functional.decode_step` or attend (keyword "
        "checks, config read, transpose)":
            part["attention function"] - part["attend"],
        "the kernel's entry around the backend and the check (folded checks, dispatch)":
            part["attend"] - part["decode step"] - part["NaN-rule check"],
        "the decode step around the kernel (GQA fold, views, the engine's choice)":
            part["decode step"] - kernel,
    }
    paired = {}  # multihead / sdpa per round of pass 1: one decode call (median) and one prefill call (mean)
    for what, by in alone_rounds.items():
        ratios = [m / s for m, s in zip(by["multihead"], by["sdpa"])]
        paired[what] = {"us_per_round": by, "ratios": ratios, "ratio": statistics.median(ratios)}
    return {"decode_calls": n,
            "alone_us_per_call": {key: {"median": statistics.median(t) * 1e6, "mean": sum(t) / len(t) * 1e6}
                                  for key, t in sorted(alone.items())},
            "alone_paired": paired, "load_per_round": alone_loads,
            "us_per_call": us, "multihead_rest_us_per_call": split}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000, help="attention calls per timing of the per-call part")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--generate-only", action="store_true", help="time generate only (no per-call parts)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or this thread's CPU time (only with --threads 1): on a shared machine")
    ap.add_argument("--model", default=None,
                    help="a real model instead of the random Llama: smollm2 (the bundled SmolLM2-135M), a .gguf or "
                         "a folder; the prompt is --prompt tokens of the King James Bible")
    ap.add_argument("--control", action="store_true",
                    help=f"also generate with transformers' sdpa registered as {CONTROL!r}: its ratio to sdpa is what "
                         "an identical implementation reads on this machine (the noise floor of the ratio)")
    ap.add_argument("--step-rounds", type=int, default=None,
                    help="generates of the step-by-step comparison (`paired_steps`; default: --rounds; 0: skip it)")
    ap.add_argument("--prefill-rounds", type=int, default=None,
                    help="cycles of prompt forwards in the step-by-step comparison (default: --step-rounds; 0: skip "
                         "them, and the generate estimate: a long prompt's prefill is benchmarks/gemma3_prefill.py's)")
    ap.add_argument("--cache", action="store_true",
                    help="also report the K/V cache a generate leaves under each implementation (bytes per layer, "
                         "against a cache of every position in every layer)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 64-token prompt, 8 new tokens, 2 rounds")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "hf_generate.json"))
    a = ap.parse_args(argv)
    if a.quick:
        a.layers, a.prompt, a.new_tokens, a.rounds, a.calls = 2, 64, 8, 2, 50
    if a.clock == "cpu":
        if a.threads != 1:
            ap.error("--clock cpu times one thread: use it with --threads 1")
        global clock
        clock = time.thread_time
    torch.set_num_threads(a.threads)
    if a.model:
        from multihead.corpus import load_corpus
        from multihead.interop.loaders import load_model

        loaded = load_model(a.model, fresh=True)  # its own copy: the benchmark switches implementations
        model, cfg = loaded.model.eval(), loaded.model.config
        a.layers, a.heads, a.kv_heads, a.width = (cfg.num_hidden_layers, cfg.num_attention_heads,
                                                  cfg.num_key_value_heads, cfg.hidden_size)
        text = load_corpus(max_chars=40 * a.prompt)[0]
        ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"][:, : a.prompt]
        prompt = ids  # (1, prompt)
        if a.json == str(Path(__file__).resolve().parent / "results" / "hf_generate.json"):
            a.json = str(Path(a.json).with_name("hf_generate_smollm2.json"))
    else:
        model = build(a.layers, a.heads, a.kv_heads, a.width, a.prompt + a.new_tokens + 8)
        prompt = torch.randint(0, model.config.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    load_start = os.getloadavg()
    if a.control:
        register_control()
    gen = time_generate(model, prompt, a.new_tokens, a.rounds, control=a.control)
    step_rounds = a.rounds if a.step_rounds is None else a.step_rounds
    steps = paired_steps(model, prompt, a.new_tokens, step_rounds, control=a.control,
                         prefill_rounds=a.prefill_rounds) if step_rounds else None
    cache = cache_bytes(model, prompt, a.new_tokens, ["sdpa", "multihead"]) if a.cache else None
    call = cold = loop = None
    if not a.generate_only:
        call = per_call(model, a.prompt + a.new_tokens // 2, a.calls, max(2, a.rounds // 2))
        cold = per_call_cold(model, a.prompt + a.new_tokens // 2, max(4, 2 * a.rounds))
        loop = in_loop(model, prompt, a.new_tokens, max(2, a.rounds // 2))
    report = {"meta": machine() | {"threads": a.threads, "clock": a.clock, "load_start": load_start,
                                   "load_end": os.getloadavg(),
                                   "argv": sys.argv[1:] if argv is None else list(argv)},
              "config": {"model": a.model or "random llama",
                         "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads, "width": a.width,
                         "prompt": a.prompt, "new_tokens": a.new_tokens, "rounds": a.rounds},
              "generate": gen, "paired_steps": steps, "per_call": call, "per_call_cold": cold, "in_loop": loop}
    if cache is not None:
        report["cache"] = cache
    s = gen["seconds"]
    print(f"greedy generate, {a.model or 'random'} {a.layers}-layer Llama, H={a.heads}, Hkv={a.kv_heads}, C={a.width}, "
          f"{a.prompt}-token prompt, {a.new_tokens} new tokens, {a.threads} thread(s), medians of {a.rounds} rounds\n")
    print("| implementation | s per generate |\n|---|---:|")
    print(f"| sdpa (transformers) | {s['sdpa']:.3f} |\n| multihead | {s['multihead']:.3f} |")
    print(f"\nratio multihead / sdpa: {gen['ratio']:.3f} (per round: "
          f"{', '.join(f'{r:.2f}' for r in gen['ratios'])}); same tokens: {gen['same_tokens']}")
    if a.control:
        print(f"control, sdpa again / sdpa: {gen['control_ratio']:.3f} (per round: "
              f"{', '.join(f'{r:.2f}' for r in gen['control_ratios'])})")
    print(f"CPU time: multihead / sdpa {gen['cpu_ratio']:.3f}"
          + (f", sdpa again / sdpa {gen['control_cpu_ratio']:.3f}" if a.control else "")
          + f"; load per round {', '.join(f'{x:.1f}' for x in gen['load_per_round'])}")
    if steps is not None:
        loads = ", ".join(f"{x:.1f}" for x in steps["load_per_round"])
        print(f"\nstep by step inside {steps['rounds']} generates (every implementation in every position of "
              f"a cycle of consecutive steps), medians of the ratios paired per cycle (load {loads}; same tokens "
              f"every round: {steps['same_tokens_every_round']}):")
        print("| clock | what | " + " | ".join(f"{i} / sdpa" for i in ("multihead", CONTROL)[:1 + a.control])
              + " | cycles |\n|---|---|" + "---:|" * (1 + a.control) + "---:|")
        for name in ("wall", "cpu"):
            part = steps[name]
            for what in ("decode_step", "prefill"):
                row = part[what]
                if row is None:
                    continue
                print(f"| {name} | {what.replace('_', ' ')} | "
                      + " | ".join(f"{row[f'{i}_ratio']:.4f}" for i in ("multihead", CONTROL)[:1 + a.control])
                      + f" | {row['cycles']} |")
            est = part["generate_ratio_estimate"]
            if est is None:
                continue
            print(f"| {name} | generate (prefill + {steps['new_tokens']} steps) | "
                  + " | ".join(f"{est[i]:.4f}" for i in ("multihead", CONTROL)[:1 + a.control]) + " | |")
    if cache is not None:
        print("\nthe K/V cache after the generate (transformers' own, under each implementation):")
        print("| implementation | MiB | a cache of every position in every layer, MiB | keys per layer |\n"
              "|---|---:|---:|---|")
        for impl, c in cache.items():
            keys = sorted({x["keys"] for x in c["layers"]})
            print(f"| {impl} | {c['bytes'] / 2**20:.1f} | {c['every_position_bytes'] / 2**20:.1f} | "
                  f"{', '.join(map(str, keys))} |")
    if call is None:
        print(f"\nwrote {write_json(a.json, report)}")
        return 0
    u = call["us_per_call"]
    print(f"\none decode-step attention call (S={call['S']}): sdpa {u['sdpa']:.1f} us, multihead "
          f"{u['multihead']:.1f} us ({call['extra_us']:+.1f} us per layer per token)")
    c = cold["us_per_call"]
    print(f"\nthe same call after the layer's MLP, each of the {cold['layers']} layers with its own K/V (caches "
          f"as in a decode step): sdpa {c['sdpa']:.1f} us, multihead {c['multihead']:.1f} us; "
          f"ratio {cold['ratio']:.3f} (per round: {', '.join(f'{r:.2f}' for r in cold['ratios'])}; load "
          f"{', '.join(f'{x:.1f}' for x in cold['load_per_round'])})")
    print("\nmultihead's call, profiled (cumulative us per call, cProfile adds its own overhead):")
    print("| function | calls per call | us per call |\n|---|---:|---:|")
    for row in call["profiled_breakdown"]:
        print(f"| {row['function']} | {row['calls_per_call']:.0f} | {row['us_per_call']:.1f} |")
    print(f"\nthe same decode-step calls inside generate ({loop['decode_calls']} calls of each), the attention "
          "functions alone (us per call):")
    print("| function | median | mean |\n|---|---:|---:|")
    for key, row in loop["alone_us_per_call"].items():
        print(f"| {key.split(':')[0]} | {row['median']:.1f} | {row['mean']:.1f} |")
    for what, row in loop["alone_paired"].items():
        print(f"\nmultihead / sdpa per round, one {what.replace(' ', ' call, ')} of the round: {row['ratio']:.3f} "
              f"(per round: {', '.join(f'{r:.2f}' for r in row['ratios'])}; load "
              f"{', '.join(f'{x:.1f}' for x in loop['load_per_round'])})")
    print("\nand their parts (means, with a timer around each part):")
    print("| part | us per call |\n|---|---:|")
    for key, us in loop["us_per_call"].items():
        print(f"| {key} | {us:.1f} |")
    print("\nmultihead's rest, by layer:")
    print("| layer | us per call |\n|---|---:|")
    for key, us in loop["multihead_rest_us_per_call"].items():
        print(f"| {key} | {us:.1f} |")
    path = write_json(a.json, report)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

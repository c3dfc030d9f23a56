"""Activation patching of every head: `multihead.heads.patch_scan` against TransformerLens 4
(`transformer_lens.patching.get_act_patch_attn_head_out_all_pos` on a TransformerBridge
wrapping the same transformers model), fp32, CPU.

    .venv/bin/python benchmarks/heads.py            # GPT-2-shaped: 6 layers, 8 heads, C 512, B 4, T 256
    .venv/bin/python benchmarks/heads.py --quick    # a smoke run (2 layers, T 32)
    .venv/bin/python benchmarks/heads.py --model smollm2           # SmolLM2-135M on 8 IOI pairs, 270 heads
    .venv/bin/python benchmarks/heads.py --model smollm2 --quick   # 1 pair, the first 2 layers

Both sides start from the clean and corrupted token batches and end with the (layers,
heads) table: TransformerLens' time includes its clean `run_with_cache`, multihead's its
clean recording. Rounds interleave the two in a shuffled order; reported are the medians
of the times and of the per-round ratios (of wall-clock and of process CPU time: every
side runs one thread, and on a shared machine CPU time is the steadier of the two), the
largest difference between the two tables
(over every round; the script exits 1 when it exceeds 1e-4), and each side's peak resident
memory above what it holds before the scan (sampled every 2 ms in a fresh process, after
a warm-up). TransformerLens runs its models on eager attention, one forward per head;
multihead keeps the fused kernel and starts each variant at its own layer from the cached
corrupted run. Before the rounds, each side's FLOPs in one scan are counted (torch's
FlopCounterMode; `--no-flops` skips it): the ratio of their matrix products outside
attention (addmm, mm) is the work an exact scan saves, beside which the time ratio reads.

GPT-2-shaped (random weights, random tokens): two pairs of inputs, the IOI-style one (the
corrupted batch is the clean one with the token at T/2 changed), where multihead's
variants also skip the shared prefix (positions before T/2 are the corrupted run's in every
variant of a causal model), and the worst case for that skip, the first token changed
(nothing shared). Targets: >= 3.5x on the first, >= 2.5x on the second. The metric,
logit 3 - logit 4 at the last position averaged over rows, is a `heads.AtPositions`
reading position T - 1 of every row (TransformerLens calls it on full logits: the plain
metric): multihead then computes the head there only and runs its variants' last block's
output projection and MLP there only. The third side, "multihead, plain metric", scans with
the same metric as a plain function (neither), in the same rounds. The warm-up is one scan.

SmolLM2 (`--model smollm2`, the bundled SmolLM2-135M-Instruct, 30 layers x 9 heads):
`multihead.heads.tasks.ioi(n)` pairs, metric logit(IO) - logit(S) at each prompt's last
token, every head's z. multihead takes the task's inputs as a user passes them (right-padded
`input_ids` and `attention_mask`), TransformerLens the `input_ids` (its patching functions
take tokens; a causal model's last real token never sees the padding after it). The
TransformerBridge wraps a deep copy of the model (booting it rewires the model it is
given). `--layers K` keeps the first K layers (a smaller scan for tests). The warm-up is
one forward of each side (TransformerLens builds its hooks there): a scan takes minutes.
Target: >= 4x. Both sides get the task's metric (`task.metric`, a `heads.AtPositions`: on
full logits the plain metric, which TransformerLens calls); multihead then computes the
head at the read positions only and rolls each row to end there. A third side, "multihead,
plain metric", scans with the same metric wrapped in a plain function, so the ratio without
those two is in the same rounds (`--no-plain` leaves it out).

Writes a Markdown table to stdout and JSON to benchmarks/results/heads.json
(heads_smollm2.json with --model smollm2; or --json).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine, write_json  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOLERANCE = 1e-4  # the two tables' largest difference allowed
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Setup:
    """One comparison's two models (the same weights) and inputs: `ours_*` are handed to
    `patch_scan`, `tl_*` to TransformerLens; `bridge()` boots TransformerLens on `theirs`."""

    ours: torch.nn.Module
    theirs: torch.nn.Module
    ours_clean: object
    ours_corrupted: object
    tl_clean: torch.Tensor
    tl_corrupted: torch.Tensor
    metric: object
    bridge: object
    detail: dict


def setup(layers: int, heads: int, width: int, B: int, T: int, vocab: int, at: int):
    import transformers

    import multihead.interop.hf  # noqa: F401  (registers "multihead")

    cfg = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=max(T, 64),
                                  vocab_size=vocab)
    torch.manual_seed(0)
    ours = transformers.GPT2LMHeadModel(cfg).eval()
    theirs = transformers.GPT2LMHeadModel(copy.deepcopy(cfg)).eval()
    theirs.load_state_dict(ours.state_dict())
    ours.set_attn_implementation("multihead")
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, vocab, (B, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, at] = (clean[:, at] + torch.randint(1, vocab, (B,), generator=g)) % vocab  # one token changed
    answer, wrong = 3, 4

    def at_last(last):  # (B, vocab): each row's logits at T - 1
        return (last[:, answer] - last[:, wrong]).mean()

    from multihead.heads import AtPositions

    # = (logits[:, -1, answer] - logits[:, -1, wrong]).mean() on full logits
    metric = AtPositions(at_last, [-1] * B, "logit 3 - logit 4 at the last position")
    return ours, theirs, clean, corrupted, metric


def tl_bridge(theirs, vocab: int):
    from tokenizers import Tokenizer, models
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab)}}, unk_token="[UNK]")))
    return TransformerBridge.boot_transformers("gpt2", hf_model=theirs, tokenizer=tok)


def setup_gpt2(args, at: int) -> Setup:
    ours, theirs, clean, corrupted, metric = setup(args.layers, args.heads, args.width, args.batch, args.tokens,
                                                   args.vocab, at)
    return Setup(ours, theirs, clean, corrupted, clean, corrupted, metric, lambda: tl_bridge(theirs, args.vocab),
                 {"changed_position": at})


def first_layers(model, k: int):
    """A deep copy of a transformers decoder (`model.model.layers`) keeping its first k layers."""
    total = len(model.model.layers)
    if not 1 <= k <= total:
        raise SystemExit(f"--layers must be in [1, {total}] for this model; received {k}")
    model = copy.deepcopy(model)
    model.model.layers = model.model.layers[:k]
    model.config.num_hidden_layers = k
    return model


def setup_smollm2(args, n: int) -> Setup:
    from multihead.heads.tasks import ioi
    from multihead.interop.loaders import load_model

    loaded = load_model("smollm2")  # the session's model: read here, never changed
    ours = loaded.model if args.layers in (None, len(loaded.model.model.layers)) else first_layers(loaded.model,
                                                                                                     args.layers)
    theirs = copy.deepcopy(ours)  # booting the bridge rewires the model it is given (eager attention, hooks)
    task = ioi(n, seed=args.seed, tokenizer=loaded.tokenizer)
    changed = (task.clean["input_ids"] != task.corrupted["input_ids"]).int().argmax(1)

    def bridge():
        from transformer_lens.model_bridge import TransformerBridge

        return TransformerBridge.boot_transformers("smollm2", hf_model=theirs, tokenizer=loaded.tokenizer)

    cfg = ours.config
    return Setup(ours, theirs, task.clean, task.corrupted, task.clean["input_ids"], task.corrupted["input_ids"],
                 task.metric, bridge,
                 {"pairs": len(task), "tokens": list(task.clean["input_ids"].shape), "changed_positions":
                  changed.tolist(), "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "width": cfg.hidden_size, "first_prompt": task.texts[0],
                  "first_corrupted": task.corrupted_texts[0]})


def run_ours(ours, clean, corrupted, metric, info=None):
    from multihead.heads import patch_scan

    return patch_scan(ours, clean, corrupted, metric, info=info)


def run_tl(bridge, clean, corrupted, metric):
    from transformer_lens import patching

    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean)
        return patching.get_act_patch_attn_head_out_all_pos(bridge, corrupted, cache, metric)


def _sides(s: Setup, bridge, plain: bool = False):
    """The scans timed: multihead and TransformerLens on the same metric; with `plain`, also
    multihead on that metric as a plain function (without what an AtPositions metric allows:
    the head and the last block's projection and MLP at the read positions only, rows rolled
    to end there)."""
    sides = {"multihead": lambda info=None: run_ours(s.ours, s.ours_clean, s.ours_corrupted, s.metric, info),
             "transformer_lens": lambda info=None: run_tl(bridge, s.tl_clean, s.tl_corrupted, s.metric)}
    if plain:
        sides[PLAIN] = lambda info=None: run_ours(s.ours, s.ours_clean, s.ours_corrupted, lambda lg: s.metric(lg))
    return sides


PLAIN = "multihead, plain metric"


def _warm_up(args, s: Setup, bridge, fns) -> dict:
    """GPT-2-shaped: one scan of each side (its tables are the first compared); SmolLM2: one
    forward of each (TransformerLens' hooks are built at its first run; a scan takes minutes)."""
    if args.model == "gpt2":
        return {name: fn() for name, fn in fns.items()}
    with torch.no_grad():
        if "multihead" in fns:
            s.ours(**s.ours_clean) if isinstance(s.ours_clean, dict) else s.ours(s.ours_clean)
        if "transformer_lens" in fns:
            bridge.run_with_cache(s.tl_clean)
    return {}


def _peak(args) -> int:
    """In this (fresh) process: peak RSS bytes of one scan above the model and inputs."""
    s = setup_smollm2(args, args.n[0]) if args.model == "smollm2" else setup_gpt2(args, args.at)
    bridge = s.bridge() if args.peak == "tl" else None
    name = "transformer_lens" if args.peak == "tl" else "multihead"
    fn = _sides(s, bridge)[name]
    _warm_up(args, s, bridge, {name: fn})
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def sample():  # resident memory every 2 ms while the scan runs
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    fn()
    done.set()
    t.join()
    print(json.dumps({"peak_bytes": max(0, max(peak[0], rss()) - base)}))
    return 0


def _peak_args(args, side: str, key: int) -> list[str]:
    """The command of one side's peak-memory process; key: the changed position (gpt2), the pairs (smollm2)."""
    cmd = [sys.executable, __file__, "--peak", side, "--model", args.model, "--threads", str(args.threads)]
    if args.model == "smollm2":
        return cmd + ["--n", str(key), "--seed", str(args.seed)] + (
            [] if args.layers is None else ["--layers", str(args.layers)])
    return cmd + ["--layers", str(args.layers), "--heads", str(args.heads), "--width", str(args.width),
                  "--batch", str(args.batch), "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                  "--at", str(key)]


LINEAR = ("addmm", "mm")  # the ops of the model's projections, MLP and output head (not attention's)


def _flops(fns) -> dict:
    """Each side's floating-point operations in one scan, by torch's FlopCounterMode, per op;
    "linear" is the projections', MLP's and output head's (addmm, mm): the work an exact scan
    redoes for every variant it runs from a layer on. Attention is left out of that sum: the
    counter sees TransformerLens' eager attention (bmm) but not a fused CPU kernel."""
    from torch.utils.flop_counter import FlopCounterMode

    out = {}
    for name in ("multihead", "transformer_lens"):
        with FlopCounterMode(display=False) as counter:
            fns[name]()
        ops = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}
        out[name] = {"by_op": ops, "linear": sum(n for op, n in ops.items() if op in LINEAR)}
    out["linear_ratio"] = out["transformer_lens"]["linear"] / max(1, out["multihead"]["linear"])
    return out


def _case(args, label: str, key: int, s: Setup) -> dict:
    """Both scans of one pair of inputs: rounds in shuffled order, then each side's peak memory."""
    bridge = s.bridge()
    fns = _sides(s, bridge, plain=not args.no_plain)
    tables = _warm_up(args, s, bridge, fns)
    diffs = [(tables["multihead"] - tables["transformer_lens"]).abs().max().item()] if tables else []
    flops = None if args.no_flops else _flops(fns)
    times = {name: [] for name in fns}
    cpu = {name: [] for name in fns}  # process CPU time: on a shared machine, steadier than the wall clock
    ratios, plain_ratios, cpu_ratios, loads, info = [], [], [], [], {}
    rng = random.Random(0)
    for i in range(args.rounds):
        order = list(fns)
        rng.shuffle(order)
        got, tables = {}, {}
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            tables[name] = fns[name](info) if name == "multihead" else fns[name]()
            got[name] = time.perf_counter() - t0
            times[name].append(got[name])
            cpu[name].append(time.process_time() - c0)
        ratios.append(got["transformer_lens"] / got["multihead"])
        cpu_ratios.append({name: cpu["transformer_lens"][-1] / cpu[name][-1] for name in fns
                           if name != "transformer_lens"})
        diffs.append((tables["multihead"] - tables["transformer_lens"]).abs().max().item())
        if PLAIN in got:
            plain_ratios.append(got["transformer_lens"] / got[PLAIN])
            diffs.append((tables[PLAIN] - tables["transformer_lens"]).abs().max().item())
        loads.append(os.getloadavg()[0])
        print(f"  round {i + 1}: multihead {got['multihead']:.2f} s, TransformerLens "  # a round takes a minute
              f"{got['transformer_lens']:.2f} s, {ratios[-1]:.2f}x"
              + (f" (plain metric {got[PLAIN]:.2f} s, {plain_ratios[-1]:.2f}x)" if PLAIN in got else "")
              + f"; CPU time {cpu_ratios[-1]['multihead']:.2f}x"
              + (f" (plain {cpu_ratios[-1][PLAIN]:.2f}x)" if PLAIN in got else "")
              + f", diff {max(diffs[-2:]):.1e}, load {loads[-1]:.2f}", flush=True)
    peaks = {name: None for name in fns}
    for side, name in (("ours", "multihead"), ("tl", "transformer_lens")):
        if args.no_peaks:
            break
        proc = subprocess.run(_peak_args(args, side, key), capture_output=True, text=True, timeout=3600)
        try:
            peaks[name] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]
        except (ValueError, IndexError, KeyError):
            peaks[name] = None
    case = {"inputs": label}
    case.update({"changed_position": key} if args.model == "gpt2" else s.detail)
    case.update({"prefix_skip": info, "flops": flops,
                 "results": [{"variant": name, "times_s": times[name], "median_s": statistics.median(times[name]),
                              "cpu_s": cpu[name], "cpu_median_s": statistics.median(cpu[name]),
                              "peak_bytes": peaks[name]} for name in fns],
                 "cpu_time_ratios": cpu_ratios,
                 "cpu_time_speedup_median": {name: statistics.median(r[name] for r in cpu_ratios)
                                             for name in fns if name != "transformer_lens"},
                 "ratios": ratios, "speedup_median": statistics.median(ratios), "loadavg_1min_per_round": loads,
                 **({"plain_metric_ratios": plain_ratios,
                     "plain_metric_speedup_median": statistics.median(plain_ratios)} if plain_ratios else {}),
                 "max_abs_diff": max(diffs)})
    return case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=["gpt2", "smollm2"], default="gpt2",
                    help="gpt2: a GPT-2-shaped model of random weights (default); smollm2: the bundled "
                         "SmolLM2-135M on tasks.ioi pairs")
    ap.add_argument("--layers", type=int, default=None, help="gpt2: layers (default 6); smollm2: keep the first K "
                                                             "(default all 30)")
    ap.add_argument("--heads", type=int, default=8, help="gpt2 only")
    ap.add_argument("--width", type=int, default=512, help="gpt2 only")
    ap.add_argument("--batch", type=int, default=4, help="gpt2 only")
    ap.add_argument("--tokens", type=int, default=256, help="gpt2 only")
    ap.add_argument("--vocab", type=int, default=1000, help="gpt2 only")
    ap.add_argument("--n", type=int, nargs="+", default=[8], help="smollm2: IOI pairs, one case per value "
                                                                   "(default 8; the target is read on the first)")
    ap.add_argument("--seed", type=int, default=0, help="smollm2: the pairs' draw (tasks.ioi's seed)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default: gpt2 5, smollm2 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--no-plain", action="store_true", help="skip the third side, multihead on the metric "
                    "as a plain function")
    ap.add_argument("--no-peaks", action="store_true", help="skip the peak-memory processes (one more scan a side)")
    ap.add_argument("--no-flops", action="store_true", help="skip counting each side's FLOPs (one more scan a side)")
    ap.add_argument("--quick", action="store_true", help="gpt2: 2 layers, 4 heads, C 64, T 32; smollm2: 1 pair, "
                                                         "the first 2 layers unless --layers; 2 rounds unless --rounds")
    ap.add_argument("--peak", choices=["ours", "tl"], help=argparse.SUPPRESS)
    ap.add_argument("--at", type=int, default=0, help=argparse.SUPPRESS)  # the changed position (--peak runs)
    ap.add_argument("--json", default=None, help="output (default benchmarks/results/heads.json, "
                                                 "heads_smollm2.json with --model smollm2)")
    args = ap.parse_args(argv)
    smol = args.model == "smollm2"
    if args.quick:
        if smol:
            args.n, args.layers = [1], 2 if args.layers is None else args.layers
        else:
            args.layers, args.heads, args.width, args.tokens, args.vocab = 2, 4, 64, 32, 101
        args.rounds = 2 if args.rounds is None else args.rounds
    if args.layers is None and not smol:
        args.layers = 6
    if args.rounds is None:
        args.rounds = 3 if smol else 5
    if args.rounds < 1 or min(args.n) < 1:
        ap.error(f"--rounds and --n must be >= 1; received {args.rounds} and {args.n}")
    if args.json is None:
        args.json = str(RESULTS / ("heads_smollm2.json" if smol else "heads.json"))
    torch.set_num_threads(args.threads)
    if args.peak:
        return _peak(args)
    try:
        import transformer_lens  # noqa: F401
    except ImportError as err:
        print(f"skipped: TransformerLens is not installed (pip install 'multihead[tl]'): {err}")
        return 0

    report = {
        "meta": {**machine(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "argv": sys.argv[1:] if argv is None else list(argv), "loadavg_start": list(os.getloadavg())},
        "cases": [],
    }
    if smol:
        from multihead.interop.loaders import InspectError, load_model

        try:
            cfg = load_model("smollm2").model.config
        except (InspectError, ImportError) as err:  # not installed; no float32 cache and no gguf
            print(f"skipped: SmolLM2 cannot be loaded: {err}")
            return 0
        layers = cfg.num_hidden_layers if args.layers is None else args.layers
        report["config"] = {"model": "smollm2", "pairs": args.n, "seed": args.seed, "layers": layers,
                            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                            "width": cfg.hidden_size, "what": "z",
                            "metric": "logit(IO) - logit(S) at the last token, mean over pairs",
                            "rounds": args.rounds, "threads": args.threads, "quick": args.quick}
        cases = [(f"tasks.ioi, {n} pair(s)", n) for n in args.n]
        print(f"patch_scan (z) of SmolLM2-135M, {layers} x {cfg.num_attention_heads} heads, tasks.ioi pairs, "
              f"{args.threads} thread(s), {args.rounds} rounds")
    else:
        report["config"] = {"layers": args.layers, "heads": args.heads, "width": args.width, "batch": args.batch,
                            "tokens": args.tokens, "vocab": args.vocab, "rounds": args.rounds,
                            "threads": args.threads, "quick": args.quick}
        cases = [("one token changed at T/2 (IOI-style)", args.tokens // 2), ("first token changed", 0)]
        print(f"patch_scan (z) of {args.layers} x {args.heads} heads, B={args.batch}, T={args.tokens}, "
              f"C={args.width}, {args.threads} thread(s), {args.rounds} rounds")
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    rows = []
    for label, key in cases:  # one setup at a time: each holds a second copy of the model
        s = setup_smollm2(args, key) if smol else setup_gpt2(args, key)
        if smol:
            print(f"{label}: {s.detail['tokens'][0]} x {s.detail['tokens'][1]} tokens", flush=True)
        report["cases"].append(case := _case(args, label, key, s))
        del s
        r = {x["variant"]: x for x in case["results"]}
        by_cpu = case["cpu_time_speedup_median"]
        plain = f"{r[PLAIN]['median_s']:.2f} s, {case['plain_metric_speedup_median']:.2f}x (CPU {by_cpu[PLAIN]:.2f}x)" \
            if PLAIN in r else "n/a"
        rows.append(f"| {label} | {r['multihead']['median_s']:.2f} | {r['transformer_lens']['median_s']:.2f} | "
                    f"{case['speedup_median']:.2f}x (CPU {by_cpu['multihead']:.2f}x) | {plain} | "
                    f"{'n/a' if case['flops'] is None else format(case['flops']['linear_ratio'], '.2f') + 'x'} | "
                    f"{mib(r['multihead']['peak_bytes'])} | "
                    f"{mib(r['transformer_lens']['peak_bytes'])} | {case['max_abs_diff']:.1e} |")
    print("| inputs | multihead s | TransformerLens s | speedup (by CPU time) | plain metric | FLOP ratio (linear) | "
          "multihead peak MiB | TL peak MiB | max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    report["meta"]["loadavg_end"] = list(os.getloadavg())
    diff = max(c["max_abs_diff"] for c in report["cases"])
    same = {"target": f"same numbers ({TOLERANCE:g})", "passed": diff <= TOLERANCE, "detail": f"max diff {diff:.2e}"}
    if smol:
        case = report["cases"][0]
        report["targets"] = [
            {"target": ">= 4x faster than TransformerLens", "passed": case["speedup_median"] >= 4.0,
             "detail": f"{case['pairs']} pair(s): median ratio {case['speedup_median']:.2f} (rounds "
                       f"{', '.join(f'{x:.2f}' for x in case['ratios'])}); prefix skip "
                       f"{'taken' if case['prefix_skip'].get('skipped') else 'not taken'}"
                       + "".join(f"; {c['pairs']} pair(s): {c['speedup_median']:.2f}" for c in report["cases"][1:])
                       + "".join(f"; {c['pairs']} pair(s), the metric as a plain function: "
                                 f"{c['plain_metric_speedup_median']:.2f}" for c in report["cases"]
                                 if "plain_metric_speedup_median" in c)},
            same]
    else:
        ioi, worst = report["cases"]

        def plain(c):
            by_cpu = c["cpu_time_speedup_median"]
            return f" (CPU time {by_cpu['multihead']:.2f})" + ("" if PLAIN not in by_cpu else (
                f"; the metric as a plain function {c['plain_metric_speedup_median']:.2f} "
                f"(CPU time {by_cpu[PLAIN]:.2f})")) + ("" if c["flops"] is None else (
                f"; linear FLOPs, TransformerLens / multihead, {c['flops']['linear_ratio']:.2f}"))
        report["targets"] = [
            {"target": ">= 3.5x faster than TransformerLens (IOI-style inputs)",
             "passed": ioi["speedup_median"] >= 3.5,
             "detail": f"median ratio {ioi['speedup_median']:.2f}{plain(ioi)}"},
            {"target": ">= 2.5x faster than TransformerLens (first token changed: nothing shared)",
             "passed": worst["speedup_median"] >= 2.5,
             "detail": f"median ratio {worst['speedup_median']:.2f}{plain(worst)}"}, same]
    print("Targets: " + "; ".join(f"{t['target']}: {'met' if t['passed'] else 'NOT met'} ({t['detail']})"
                                  for t in report["targets"]))
    print(f"load average: start {report['meta']['loadavg_start']}, end {report['meta']['loadavg_end']}")
    write_json(args.json, report)
    if not same["passed"]:
        print(f"FAILED: the two tables differ by {diff:.2e} > {TOLERANCE:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

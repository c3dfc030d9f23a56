"""heads' scans across processes: P gloo ranks x 1 thread (`group=`) against 1 process x 1
thread (`group=None`), fp32, CPU.

    .venv/bin/python benchmarks/heads_distributed.py              # 2 ranks: GPT-2 6 x 8 and SmolLM2 IOI
    .venv/bin/python benchmarks/heads_distributed.py --ranks 4
    .venv/bin/python benchmarks/heads_distributed.py --quick      # a smoke run (tiny GPT-2, 1 round)

Cases: `patch_scan` (z) of benchmarks/heads.py's GPT-2 shape (6 layers, 8 heads, C 512,
B 4, T 256, vocab 1000) with the token at T/2 changed (IOI-style: the prefix skip) and with
the first token changed (nothing shared); `attribution_scan` on the first pair; and
`patch_scan` of SmolLM2-135M on `multihead.heads.tasks.ioi(8)` (30 layers x 9 heads).

Every rank holds the model. One world runs every case: in each round, in an order shuffled
the same way on every rank, rank 0 times the single-process scan while the other ranks wait
in a barrier (their CPU time during it is reported: ~0 means they left both cores to it),
then every rank runs the scan with the group and rank 0 times it from a barrier to its
return (every rank returns after the same final collective). Reported: medians of the
times and of the per-round ratios, and whether the tables are bitwise equal. patch_scan
shares its setup (rank 0 records the clean run while rank 1 makes the corrupted run; each
self-check forward runs on one rank); what every rank still repeats is the argument checks,
the decisions on what the runs made, and for an `AtPositions` metric (SmolLM2's IOI)
`aligned`'s two check forwards, so the speed-up stays below P. Also reported: the single
process's CPU seconds over the busiest rank's, the speed-up the split of the work allows
when each rank has a core of its own (on a loaded machine the wall-clock ratio says more
about the other load), and the load average at the start and end of every case.

Writes a Markdown table to stdout and JSON to benchmarks/results/heads_distributed.json
(or --json).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import random
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine, write_json  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def gpt2_pair(layers: int, heads: int, width: int, B: int, T: int, vocab: int, at: int):
    import transformers

    import multihead.interop.hf  # noqa: F401  (registers "multihead")

    cfg = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=max(T, 64),
                                  vocab_size=vocab, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.set_attn_implementation("multihead")
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, vocab, (B, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, at] = (clean[:, at] + torch.randint(1, vocab, (B,), generator=g)) % vocab

    def metric(logits):
        return (logits[:, -1, 3] - logits[:, -1, 4]).mean()
    return model, clean, corrupted, metric


def cases(args) -> list[tuple[str, object]]:
    """(label, zero-argument scan taking group=) of every case."""
    from multihead import heads

    out = []
    shape = (2, 4, 64, args.batch, 32, 101) if args.quick else (6, 8, 512, args.batch, 256, 1000)
    L, H, C, B, T, V = shape
    for label, at in ((f"GPT-2 {L}x{H} patch_scan, token T/2 changed", T // 2),
                      (f"GPT-2 {L}x{H} patch_scan, first token changed", 0)):
        model, clean, corrupted, metric = gpt2_pair(L, H, C, B, T, V, at)
        out.append((label, lambda group, m=model, a=clean, b=corrupted, f=metric:
                    heads.patch_scan(m, a, b, f, group=group)))
        if at:
            out.append((f"GPT-2 {L}x{H} attribution_scan, token T/2 changed",
                        lambda group, m=model, a=clean, b=corrupted, f=metric:
                        heads.attribution_scan(m, a, b, f, group=group)))
    if not args.quick and "smollm2" in args.cases:
        from multihead.heads import tasks
        from multihead.interop.loaders import load_model

        loaded = load_model("smollm2")
        task = tasks.ioi(args.ioi_pairs, tokenizer=loaded.tokenizer)
        out.append((f"SmolLM2-135M IOI patch_scan ({args.ioi_pairs} pairs)",
                    lambda group, m=loaded.model, t=task: heads.patch_scan(m, t.clean, t.corrupted, t.metric,
                                                                           group=group)))
    return out


def _same(a, b) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def worker(rank: int, world: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    group = dist.group.WORLD
    report = []
    try:
        for label, scan in cases(args):
            load_start = list(os.getloadavg())
            single = scan(None) if rank == 0 else None  # warm-up, and the tables
            dist.barrier()
            shared = scan(group)
            times = {"one process": [], f"{world} ranks": []}
            idle_cpu, cpu_times = [], {name: [] for name in times}  # this rank's CPU seconds
            ratios = []
            rng = random.Random(0)  # the same order on every rank
            for _ in range(args.rounds):
                order = list(times)
                rng.shuffle(order)
                got = {}
                for name in order:
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    if name == "one process":
                        if rank == 0:
                            scan(None)
                        dist.barrier()  # the others wait here while rank 0 scans alone
                    else:
                        scan(group)
                    got[name] = time.perf_counter() - t0
                    cpu_times[name].append(time.process_time() - c0)
                    if name == "one process" and rank != 0:
                        idle_cpu.append(time.process_time() - c0)
                    times[name].append(got[name])
                ratios.append(got["one process"] / got[f"{world} ranks"])
            cpu = [None] * world
            dist.all_gather_object(cpu, (idle_cpu, cpu_times[f"{world} ranks"]))
            busiest = [max(c[1][i] for c in cpu) for i in range(args.rounds)]  # the rank that worked most
            single_cpu = cpu_times["one process"]
            if rank == 0:
                report.append({"case": label, "equal_bitwise": _same(single, shared),
                               "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()),
                               "results": [{"variant": k, "times_s": v, "median_s": statistics.median(v)}
                                           for k, v in times.items()],
                               "ratios": ratios, "speedup_median": statistics.median(ratios),
                               "idle_ranks_cpu_s_while_one_process": [c[0] for c in cpu[1:]],
                               "cpu_s_one_process": single_cpu, "cpu_s_busiest_rank": busiest,
                               "cpu_speedup_median": statistics.median(a / b for a, b in zip(single_cpu, busiest))})
                print(f"  {label}: {statistics.median(times['one process']):.2f} s / "
                      f"{statistics.median(times[f'{world} ranks']):.2f} s = {statistics.median(ratios):.2f}x; "
                      f"CPU s one process / busiest rank = {report[-1]['cpu_speedup_median']:.2f}x; load "
                      f"{load_start[0]:.1f} -> {report[-1]['loadavg_end'][0]:.1f}", flush=True)
        if rank == 0:
            results.put(report)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks, 1 thread each")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4, help="GPT-2 batch (B)")
    ap.add_argument("--ioi-pairs", type=int, default=8)
    ap.add_argument("--cases", default="gpt2,smollm2", help="comma-separated: gpt2 (always), smollm2")
    ap.add_argument("--quick", action="store_true", help="tiny GPT-2, 1 round, no SmolLM2")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "heads_distributed.json"))
    args = ap.parse_args(argv)
    if args.ranks < 2:
        ap.error(f"--ranks must be >= 2; received {args.ranks}")
    if args.quick:
        args.rounds = 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    meta = {**machine(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "loadavg_start": list(os.getloadavg())}
    print(f"{args.ranks} gloo ranks x 1 thread vs 1 process x 1 thread, {args.rounds} rounds, "
          f"load average {meta['loadavg_start']}", flush=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    report_cases = results.get()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return 1
    meta["loadavg_end"] = list(os.getloadavg())
    print(f"| case | 1 process s | {args.ranks} ranks s | speed-up | CPU s ratio | tables bitwise equal |")
    print("|---|---|---|---|---|---|")
    for c in report_cases:
        r = {x["variant"]: x["median_s"] for x in c["results"]}
        print(f"| {c['case']} | {r['one process']:.2f} | {r[f'{args.ranks} ranks']:.2f} | "
              f"{c['speedup_median']:.2f}x | {c['cpu_speedup_median']:.2f}x | {c['equal_bitwise']} |")
    scans = [c for c in report_cases if "patch_scan" in c["case"]]
    report = {"meta": meta,
              "config": {"ranks": args.ranks, "rounds": args.rounds, "batch": args.batch, "quick": args.quick,
                         "ioi_pairs": args.ioi_pairs, "threads_per_rank": 1},
              "cases": report_cases,
              "targets": [{"target": f"{args.ranks} ranks >= 1.7x faster than 1 process (patch_scan cases)",
                           "passed": all(c["speedup_median"] >= 1.7 for c in scans),
                           "detail": "; ".join(f"{c['case']}: {c['speedup_median']:.2f}x" for c in scans)},
                          {"target": "tables bitwise equal", "passed": all(c["equal_bitwise"] for c in report_cases),
                           "detail": ""}],
              "note": "measured on a shared machine; re-run on a quiet one before quoting"}
    print(f"load average at the end {meta['loadavg_end']}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

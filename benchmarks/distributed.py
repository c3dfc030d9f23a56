"""Distributed benchmark on CPU/gloo: ring attention (sequence across processes) and
tensor-parallel heads, each rank a process with one thread.

    python benchmarks/distributed.py                 # full size (several minutes on 2 cores)
    python benchmarks/distributed.py --seq-len 8192  # smaller ring run
    python benchmarks/distributed.py --quick         # smoke run, nothing written

Ring: causal attention, zigzag layout, B=1, H=Hkv=8, D=64, float32, forward and
forward+backward. One process with 2 threads (torch's fused CPU kernel) against 2
ranks with 1 thread each (the cores are shared fairly) and 4 ranks with 1 thread each
(oversubscribed: 4 processes on 2 cores, so its time says little). Peak memory per
rank: the growth of the resident set (VmHWM, reset through /proc/self/clear_refs)
from just before the inputs are made to the end of the backward, so it counts
inputs, outputs, gradients and every temporary. Bytes sent per rank are counted by
wrapping `torch.distributed.batch_isend_irecv` and compared with the formula

    forward  (P - 1) * 2 * B * Hkv * (N/P) * D * itemsize          (K and V, P - 1 hops)
    backward (P - 1) * 2 * B * Hkv * (N/P) * D * itemsize          (K and V again)
             + P * 2 * B * Hkv * (N/P) * D * 4                     (dK, dV in float32, P hops home)

Tensor parallel: `Attention(1024, 16)` at N=4096, B=1, float32, forward+backward, on
1 rank (the plain module) and on 2 ranks (`shard_heads`); time, parameter bytes and
peak memory per rank. Also the MLA replication: parameter and cache bytes per rank of a
sharded `LatentAttention`, the latent (replicated) against the sharded parts.

Medians of --repeats runs; the machine is shared, so times are noisy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------- jobs


def _ring_job(rank: int, world: int, cfg: dict) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from multihead.distributed import ring_attention

    sent = {"bytes": 0}
    if world > 1:
        original = dist.batch_isend_irecv

        def counting(ops):
            sent["bytes"] += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
            return original(ops)

        dist.batch_isend_irecv = counting
    B, H, Hkv, D, N = 1, cfg["heads"], cfg["heads"], 64, cfg["seq_len"]
    T = N // world
    rows = []
    for _ in range(cfg["repeats"] + 1):  # the first run warms up and is dropped
        gc.collect()
        rss0 = _status("VmRSS")
        _reset_peak()
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
        k = torch.randn(B, Hkv, T, D, generator=g, requires_grad=True)
        v = torch.randn(B, Hkv, T, D, generator=g, requires_grad=True)
        dout = torch.randn(B, H, T, D, generator=g)
        if world > 1:
            dist.barrier()
        sent["bytes"] = 0
        t0 = time.perf_counter()
        if world == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = ring_attention(q, k, v, causal=True, layout="zigzag")
        t1 = time.perf_counter()
        fwd_bytes = sent["bytes"]
        out.backward(dout)
        t2 = time.perf_counter()
        peak = _status("VmHWM") - rss0
        rows.append({"forward_s": t1 - t0, "forward_backward_s": t2 - t0, "peak_bytes": peak,
                     "sent_forward": fwd_bytes, "sent_backward": sent["bytes"] - fwd_bytes})
        del q, k, v, dout, out
    rows = rows[1:]
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    med["runs"] = rows
    return med


def _tp_job(rank: int, world: int, cfg: dict) -> dict:
    import copy
    import gc

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from multihead import Attention, LatentAttention
    from multihead.distributed import shard_heads

    def local_bytes(module) -> int:
        return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in module.parameters())

    torch.manual_seed(0)
    attn = Attention(cfg["d_model"], cfg["tp_heads"])
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        attn = shard_heads(attn, mesh)
    C, N = cfg["d_model"], cfg["tp_seq_len"]
    rows = []
    for _ in range(cfg["repeats"] + 1):
        gc.collect()
        rss0 = _status("VmRSS")
        _reset_peak()
        x = torch.randn(1, N, C, generator=torch.Generator().manual_seed(1), requires_grad=True)
        t0 = time.perf_counter()
        y = attn(x)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        rows.append({"forward_s": t1 - t0, "forward_backward_s": t2 - t0, "peak_bytes": _status("VmHWM") - rss0})
        del x, y
        attn.zero_grad(set_to_none=True)
    rows = rows[1:]
    result = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    result["param_bytes"] = local_bytes(attn)
    result["runs"] = rows
    # MLA: which bytes shrink with P and which are replicated (the latent path).
    mla = LatentAttention(C, cfg["tp_heads"], cfg["kv_rank"], head_dim=C // cfg["tp_heads"], rope_dim=32)
    full = {name: local_bytes(getattr(mla, name)) for name in ("q_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj",
                                                               "o_proj")}
    if world > 1:
        mla = shard_heads(copy.deepcopy(mla), mesh)
    per_rank = {name: local_bytes(getattr(mla, name)) for name in full}
    cache = mla.new_cache(1, 1)
    result["mla"] = {"param_bytes_per_rank": per_rank, "param_bytes_unsharded": full,
                     "latent_cache_bytes_per_token_per_rank": cache.nbytes,
                     "sharded_mha_cache_bytes_per_token_per_rank": 2 * cfg["d_model"] * 4 // world}
    return result


JOBS = {"ring": _ring_job, "tp": _tp_job}


def _entry(job: str, rank: int, world: int, threads: int, port: int, cfg: dict, out) -> None:
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=1800))
        out.put((rank, "ok", JOBS[job](rank, world, cfg)))
    except BaseException:  # reported to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run_world(job: str, world: int, threads: int, cfg: dict, log) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # big buffers are returned to the OS when freed
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(job, r, world, threads, port, cfg, out)) for r in range(world)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < world:
            rank, status, payload = out.get(timeout=3600)
            if status == "error":
                raise RuntimeError(f"{job} rank {rank} of {world} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    log(f"  {job}: {world} process(es) x {threads} thread(s) done in {time.perf_counter() - start:.0f} s")
    return [results[r] for r in range(world)]


# --------------------------------------------------------------------- report


def run(cfg: dict, log) -> dict:
    from machine_info import machine  # benchmarks/ is on sys.path

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "load_average_1min_at_start": os.getloadavg()[0], "config": cfg, "ring": {}, "tp": {}}
    N, H, D = cfg["seq_len"], cfg["heads"], 64
    for world, threads in ((1, 2), (2, 1), (4, 1)):
        ranks = run_world("ring", world, threads, cfg, log)
        T = N // world
        kv = 2 * 1 * H * T * D * 4
        entry = {"threads_per_rank": threads, "ranks": ranks,
                 "forward_s": max(r["forward_s"] for r in ranks),
                 "forward_backward_s": max(r["forward_backward_s"] for r in ranks),
                 "peak_bytes_per_rank": max(r["peak_bytes"] for r in ranks)}
        if world > 1:
            entry["sent_forward_formula"] = (world - 1) * kv
            entry["sent_backward_formula"] = (world - 1) * kv + world * kv  # dK/dV in float32 = itemsize 4
            entry["sent_forward_per_rank"] = [r["sent_forward"] for r in ranks]
            entry["sent_backward_per_rank"] = [r["sent_backward"] for r in ranks]
        report["ring"][str(world)] = entry
    for world in (1, 2):
        ranks = run_world("tp", world, 1, cfg, log)
        report["tp"][str(world)] = {"ranks": ranks, "forward_s": max(r["forward_s"] for r in ranks),
                                    "forward_backward_s": max(r["forward_backward_s"] for r in ranks),
                                    "peak_bytes_per_rank": max(r["peak_bytes"] for r in ranks),
                                    "param_bytes_per_rank": max(r["param_bytes"] for r in ranks),
                                    "mla": ranks[0]["mla"]}
    return report


def render(report: dict) -> str:
    m, cfg = report["machine"], report["config"]
    mib = 2 ** 20
    ring, tp = report["ring"], report["tp"]
    one = ring["1"]
    lines = [
        f"Ring attention, causal, zigzag, N = {cfg['seq_len']}, B = 1, H = Hkv = {cfg['heads']}, D = 64, fp32, "
        f"forward + backward; {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {report['date'][:10]}; "
        f"medians of {cfg['repeats']} runs (load average at start {report['load_average_1min_at_start']:.1f}).",
        "",
        "| setup | forward | fwd + bwd | time vs 1 process | peak memory / rank | vs 1 process | "
        "sent / rank fwd, bwd (formula) |",
        "|---|---|---|---|---|---|---|",
    ]
    for world, e in ring.items():
        name = "1 process, 2 threads" if world == "1" else f"{world} ranks x 1 thread" + (
            " (oversubscribed)" if world == "4" else "")
        sent = "-"
        if world != "1":
            sent = (f"{max(e['sent_forward_per_rank']) / mib:.0f}, {max(e['sent_backward_per_rank']) / mib:.0f} MiB "
                    f"({e['sent_forward_formula'] / mib:.0f}, {e['sent_backward_formula'] / mib:.0f})")
        lines.append(f"| {name} | {e['forward_s']:.2f} s | {e['forward_backward_s']:.2f} s | "
                     f"{e['forward_backward_s'] / one['forward_backward_s']:.2f}x | "
                     f"{e['peak_bytes_per_rank'] / mib:.0f} MiB | "
                     f"{e['peak_bytes_per_rank'] / one['peak_bytes_per_rank']:.2f}x | {sent} |")
    lines += [
        "",
        f"Tensor parallel `Attention({cfg['d_model']}, {cfg['tp_heads']})`, N = {cfg['tp_seq_len']}, B = 1, fp32, "
        f"1 thread per rank:",
        "",
        "| ranks | forward | fwd + bwd | parameters / rank | peak activation memory / rank |",
        "|---|---|---|---|---|",
    ]
    for world, e in tp.items():
        lines.append(f"| {world} | {e['forward_s']:.2f} s | {e['forward_backward_s']:.2f} s | "
                     f"{e['param_bytes_per_rank'] / mib:.1f} MiB | {e['peak_bytes_per_rank'] / mib:.0f} MiB |")
    mla1, mla2 = tp["1"]["mla"], tp["2"]["mla"]
    lines += [
        "",
        f"MLA (`LatentAttention({cfg['d_model']}, {cfg['tp_heads']}, kv_rank={cfg['kv_rank']}, rope_dim=32)`) "
        "under `shard_heads`, parameter KiB per rank, 1 -> 2 ranks: "
        + ", ".join(f"{k} {mla1['param_bytes_per_rank'][k] / 1024:.0f} -> {mla2['param_bytes_per_rank'][k] / 1024:.0f}"
                    for k in mla1["param_bytes_per_rank"])
        + f"; latent cache {mla2['latent_cache_bytes_per_token_per_rank']} bytes per token on every rank "
        f"(replicated), against {mla2['sharded_mha_cache_bytes_per_token_per_rank']} for a 2-way sharded MHA "
        "cache of the same width.",
    ]
    return "\n".join(lines)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description="ring attention and tensor-parallel heads across gloo processes")
    p.add_argument("--seq-len", type=int, default=16384, help="ring: sequence length N (divisible by 8)")
    p.add_argument("--heads", type=int, default=8, help="ring: heads H = Hkv")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per setup (after one warm-up)")
    p.add_argument("--d-model", type=int, default=1024, help="tensor parallel: model width")
    p.add_argument("--tp-heads", type=int, default=16, help="tensor parallel: heads")
    p.add_argument("--tp-seq-len", type=int, default=4096, help="tensor parallel: sequence length")
    p.add_argument("--kv-rank", type=int, default=256, help="MLA latent rank")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one run, nothing written")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "distributed.json",
                   help="where to write the results")
    p.add_argument("--render", type=Path, default=None, help="print the table of an earlier run's JSON")
    args = p.parse_args()
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return
    cfg = {"seq_len": args.seq_len, "heads": args.heads, "repeats": args.repeats, "d_model": args.d_model,
           "tp_heads": args.tp_heads, "tp_seq_len": args.tp_seq_len, "kv_rank": args.kv_rank}
    if args.quick:
        cfg.update(seq_len=512, repeats=1, d_model=128, tp_seq_len=256, kv_rank=32)
    report = run(cfg, lambda s: print(s, file=sys.stderr, flush=True))
    print(render(report))
    if not args.quick:
        from machine_info import finish  # benchmarks/ is on sys.path
        _write_atomic(args.json, json.dumps(finish(report), indent=1) + "\n")


if __name__ == "__main__":
    main()

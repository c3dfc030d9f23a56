"""Activation patching at length: `multihead.heads.patch_scan` (and `path_patch_scan`) of
SmolLM2-135M at T = 4,096 positions, fp32, CPU: peak resident memory above the loaded model
and time per head, and what TransformerLens 4 does with the same 4,096 positions.

    .venv/bin/python benchmarks/heads_long.py                   # T 4096, 6 heads of patch_scan
    .venv/bin/python benchmarks/heads_long.py --tokens 1024 --heads 9 --path
    .venv/bin/python benchmarks/heads_long.py --tl              # also TransformerLens (see below)

Clean is the first T tokens of the bundled KJV; corrupted is clean with one token changed:
the first (nothing shared: every variant runs every position) and, with --middle, the one
at T/2 (the prefix skip halves the positions). The metric is a logit difference at the
last position. A full scan is 270 heads (hours at 4,096 positions on two cores), so each
measurement runs in a fresh process until `--heads` heads are done (the scan's `progress=`
callback stops it) and reports: the setup (the clean recording, the corrupted run and the
scan's checks), the seconds per head of the forwards measured (the first variants are those
of layer 0, the most expensive: every block above runs), the extrapolated full scan (each
variant priced by the blocks it runs), and the peak resident memory above what the process
held after loading the model (sampled every 5 ms). `--max-memory` sets the scan's budget
per forward (default: the automatic 1 GiB, one variant a forward at this length).

TransformerLens (--tl): `get_act_patch_attn_head_out_all_pos` starts from
`run_with_cache(clean)` on a TransformerBridge around a copy of the model; it runs eager
attention and caches every hook, the attention scores and pattern of every layer among
them (30 x 9 x T x T floats each: 18 GB each at 4,096). It runs in a process capped at
--tl-cap bytes of address space (default 6e9: the machine has 24 GiB and is shared);
reported is how it ends (the error and when) and its peak.

The machine is shared: the load average is recorded with every measurement.
Writes JSON to benchmarks/results/heads_long.json (or --json).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine, write_json  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class _Enough(Exception):
    """Raised from the progress callback once the heads asked for are done."""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """Peak resident memory above a baseline, sampled every 5 ms on a thread."""

    def __init__(self):
        self.base, self.peak, self.done = _rss(), 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        while not self.done.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(0, max(self.peak, _rss()) - self.base)


def _inputs(lm, T: int, at: int):
    import torch

    from multihead.corpus import load_corpus

    text, _ = load_corpus(max_chars=12 * T)
    ids = torch.tensor(lm.encode(text)[:T])[None]
    assert ids.shape[1] == T, f"the corpus gave {ids.shape[1]} tokens, fewer than {T}"
    corrupted = ids.clone()
    corrupted[0, at] = (ids[0, at] + 1) % lm.model.config.vocab_size
    a, b = int(ids[0, -1]), int(ids[0, -2])

    def metric(logits):
        return logits[:, -1, a] - logits[:, -1, b]
    return ids, corrupted, metric


def _one(args) -> int:
    """In this fresh process: one measurement (args.one: "patch", "path" or "tl"); prints JSON."""
    import torch

    from multihead import heads
    from multihead.interop.loaders import load_model

    torch.set_num_threads(args.threads)
    lm = load_model("smollm2")
    model = lm.model
    at = args.tokens // 2 if args.at == "middle" else 0
    clean, corrupted, metric = _inputs(lm, args.tokens, at)
    with torch.no_grad():  # warm-up at 64 positions: lazily built state is not the scan's
        model(clean[:, :64])
    if args.one == "tl":
        return _one_tl(args, model, lm, clean, corrupted, metric)
    marks: list[tuple[float, int]] = []

    def progress(done, total, eta):
        marks.append((time.perf_counter(), done))
        if done >= args.heads:
            raise _Enough
    kw = {} if args.max_memory is None else {"max_memory": args.max_memory}
    load0 = os.getloadavg()[0]
    peak = _Peak()
    t0 = time.perf_counter()
    try:
        if args.one == "patch":
            info = {}
            heads.patch_scan(model, clean, corrupted, metric, progress=progress, info=info, **kw)
        else:
            info = {}
            heads.path_patch_scan(model, clean, corrupted, metric, receivers="logits", progress=progress, **kw)
    except _Enough:
        pass
    used = peak.stop()
    setup = marks[0][0] - t0 if marks else None  # the recordings, the checks and the first forward
    per_head = None
    if len(marks) >= 2:
        (ta, na), (tb, nb) = marks[0], marks[-1]
        per_head = (tb - ta) / max(1, nb - na)
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    full = mean_per_head = None
    if len(marks) >= 2 and args.one == "patch":  # variants (head 0, layer i) in order, one a forward
        blocks = sum(L - i for i in range(1, len(marks)))  # those after the first forward
        per_block = (marks[-1][0] - marks[0][0]) / blocks
        full = (setup or 0) - per_block * L + per_block * H * sum(L - i for i in range(L))
        mean_per_head = per_block * sum(L - i for i in range(L)) / L
    print(json.dumps({"scan": args.one, "tokens": args.tokens, "changed_position": at,
                      "full_scan_estimate_s": full, "mean_seconds_per_head_estimate": mean_per_head,
                      "peak_above_model_bytes": used, "setup_and_first_forward_s": setup,
                      "marks": [(t - t0, n) for t, n in marks], "seconds_per_head": per_head,
                      "info": info, "loadavg": [load0, os.getloadavg()[0]],
                      "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    return 0


def _one_tl(args, model, lm, clean, corrupted, metric) -> int:
    import copy

    import torch

    theirs = copy.deepcopy(model)
    out = {"scan": "tl", "tokens": args.tokens, "cap_bytes": args.tl_cap}
    t0 = time.perf_counter()
    peak = _Peak()
    try:
        from transformer_lens import patching
        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_transformers("smollm2", hf_model=theirs, tokenizer=lm.tokenizer)
        out["n_ctx"] = getattr(getattr(bridge, "cfg", None), "n_ctx", None)
        with torch.no_grad():
            _, cache = bridge.run_with_cache(clean)
            out["clean_run_with_cache_s"] = time.perf_counter() - t0
            out["cache_bytes"] = sum(t.numel() * t.element_size() for t in cache.values())
            patching.get_act_patch_attn_head_out_all_pos(bridge, corrupted, cache, metric)
        out["ended"] = "finished"
    except BaseException as err:  # noqa: BLE001 (what it does is the measurement: MemoryError, a RuntimeError)
        out["ended"] = f"{type(err).__name__}: {str(err)[:300]}"
    out["seconds"] = time.perf_counter() - t0
    out["peak_above_model_bytes"] = peak.stop()
    print(json.dumps(out))
    return 0


def _spawn(args, what: str, at: str, cap: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--one", what, "--tokens", str(args.tokens), "--heads", str(args.heads),
           "--threads", str(args.threads), "--at", at]
    if args.max_memory is not None:
        cmd += ["--max-memory", str(args.max_memory)]
    if cap:
        cmd += ["--tl-cap", str(cap)]

    def limit():
        if cap:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, preexec_fn=limit)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"scan": what, "ended": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-1500:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=6, help="heads measured per scan (the first of layer 0 first)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-memory", type=float, default=None, help="patch_scan's max_memory= (bytes)")
    ap.add_argument("--middle", action="store_true", help="also the pair with the token at T/2 changed")
    ap.add_argument("--path", action="store_true", help="also path_patch_scan (receivers='logits')")
    ap.add_argument("--tl", action="store_true", help="also TransformerLens, in a process capped at --tl-cap")
    ap.add_argument("--tl-cap", type=float, default=6e9, help="address-space cap of the TransformerLens process")
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--one", choices=["patch", "path", "tl"], help=argparse.SUPPRESS)
    ap.add_argument("--at", choices=["first", "middle"], default="first", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "heads_long.json"))
    args = ap.parse_args(argv)
    if args.max_memory is not None:
        args.max_memory = int(args.max_memory)
    if args.one:
        return _one(args)
    report = {"meta": {**machine(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                       "loadavg_start": list(os.getloadavg())},
              "config": {"tokens": args.tokens, "heads": args.heads, "threads": args.threads,
                         "max_memory": args.max_memory}, "runs": []}
    plan = [("patch", "first")] + [("patch", "middle")] * args.middle + [("path", "first")] * args.path
    for what, at in plan:
        r = _spawn(args, what, at)
        report["runs"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "marks"}))
    if args.tl:
        r = _spawn(args, "tl", "first", int(args.tl_cap))
        report["runs"].append(r)
        print(json.dumps(r))
    report["meta"]["loadavg_end"] = list(os.getloadavg())
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

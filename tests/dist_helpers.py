"""The launcher of the tests that run a torch.distributed world (not a test module).

`run_world(fn, world, ...)` runs `fn(rank, world)` on `world` gloo ranks on 127.0.0.1, one
thread each, and returns their results by rank. A rank that raises fails the test at once
(the survivors are killed); so does a rank that exits without a result, and a world that
does not finish within its bound. gloo's own timeout bounds every collective, so a rank
left waiting for one that failed raises instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, pg_timeout: float, out) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        # pickled here: torch sends a tensor through a multiprocessing queue as a handle that the
        # reader fetches from this process, which may have exited by then; plain pickle copies it
        out.put((rank, "ok", pickle.dumps(fn(rank, world))))
    except BaseException:  # reported to the parent, which fails the test
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# What the fork server imports once, before it forks any rank, so that no rank spends seconds
# importing it. One list for every world: the server starts with the first world of a test
# process and serves every later one, whatever list that one would set. (DTensor imports
# torch._dynamo on first use; a module that is not installed is passed over.)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.tensor.parallel", "multihead.distributed",
           "transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
           "multihead.interop.hf", "multihead.heads.scan", "multihead.heads.path_patching")


def run_world(fn, world: int, *, timeout: float, pg_timeout: float) -> list:
    """`fn(rank, world)` (a module-level function) on `world` gloo ranks; their results by rank.

    timeout: seconds the whole world may run before the test fails.
    pg_timeout: seconds gloo waits in a collective before the waiting rank raises.
    """
    # Every rank of every world is forked from one server that has run no torch op, so no
    # thread pool is forked with it.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, __name__, fn.__module__])
    out = ctx.Queue()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children: one thread per rank
    try:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, pg_timeout, out), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env
    try:
        results = _collect(fn.__name__, procs, out, world, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
    return [results[r] for r in range(world)]


def _collect(name: str, procs: list, out, world: int, timeout: float) -> dict[int, object]:
    """Every rank's result, failing the test at the first error, silent exit or the deadline."""
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world:
        if time.monotonic() > deadline:
            pytest.fail(f"{name}: the world of {world} did not finish within {timeout:.0f} s; "
                        f"ranks done: {sorted(results)}")
        try:
            rank, status, payload = out.get(timeout=0.5)
        except queue_mod.Empty:
            silent = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in results]
            if silent:
                pytest.fail(f"{name}: rank(s) {silent} exited (code "
                            f"{[procs[i].exitcode for i in silent]}) without a result")
            continue
        if status == "error":
            pytest.fail(f"{name}: rank {rank} of {world} raised:\n{payload}")
        results[rank] = pickle.loads(payload)
    return results


# ------------------------------------------------- the heads scans' worlds


def scan_models():
    """A small random GPT-2 (MHA) and Llama (GQA, RoPE) on multihead's attention, the same on
    every rank, and their inputs: ({"gpt2", "llama"}, clean (2, 8), {"middle": one token
    changed at 4 (a shared prefix: the prefix skip and its self-check), "first": the first
    token changed (nothing shared)})."""
    import transformers

    import multihead.interop.hf  # noqa: F401  (registers "multihead")

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=3, n_head=4, n_positions=16, vocab_size=61, bos_token_id=0, eos_token_id=0)).eval()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=61, max_position_embeddings=16, bos_token_id=0, eos_token_id=0)).eval()
    for m in (gpt2, llama):
        m.set_attn_implementation("multihead")
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 61, (2, 8), generator=g)
    middle, first = clean.clone(), clean.clone()
    middle[:, 4] = (clean[:, 4] + 1) % 61
    first[:, 0] = (clean[:, 0] + 1) % 61
    return {"gpt2": gpt2, "llama": llama}, clean, {"middle": middle, "first": first}


def last_token_metric(logits):
    """The scans' metric: logit 3 - logit 4 at the last position, averaged."""
    return (logits[:, -1, 3] - logits[:, -1, 4]).mean()


def error_recorder(got: dict) -> Callable[[str, Callable[[], object]], None]:
    """`expect(name, call)`: runs `call` and records in `got` the error it raised on this rank
    (its type, message and notes; None when it returned) and the seconds it took: a world's
    test then checks that every rank raised the same error, in bounded time."""
    def expect(name, call):
        start = time.monotonic()
        try:
            call()
            got[name] = None
        except Exception as e:  # every rank must land here
            got[name] = f"{type(e).__name__}: {e} {' '.join(getattr(e, '__notes__', []))}"
        got[name + " seconds"] = time.monotonic() - start
    return expect


def check_every_rank_raised(results: list[dict], seconds: float, what: str) -> None:
    """Each rank's `error_recorder` record: every call raised (None: it returned) within
    `seconds` (longer: it waited in a collective), and `after`, the rank's check that the
    world still gives one process's `what` after the errors, is True."""
    for rank, got in enumerate(results):
        assert got["after"] is True, f"rank {rank}: the {what} after the errors differs from one process's"
        for name, msg in got.items():
            if name.endswith("seconds"):
                assert msg < seconds, f"rank {rank}: {name} took {msg:.1f} s (waited in a collective?)"
            elif name != "after":
                assert msg is not None, f"rank {rank}: {name} did not raise"

"""The decode step's second engine (`kernels.decode.gemm`: the scores and the values as two
batched GEMMs, the keys the tall operand) and the per-process choice between it and torch's
kernel: exact against the NumPy float64 reference (GQA, MQA, MHA, batches, a few queries,
Dv != D, a cache's view), taken only where it may, fixed by the plan or timed once per case
with the faster kept, and the NaN rule unchanged through it."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import assert_close
from multihead import reference as R
from multihead.functional import attend
from multihead.kernels import MachinePlan, decode, machine_plan, native, set_machine_plan
from multihead.kernels.machine import FASTEST_ROUNDS, measured_choices


def _qkv(B=1, H=8, Hkv=2, T=1, S=300, D=16, Dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv or D))
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes)


def _reference(q, k, v, scale=None):
    return torch.from_numpy(R.attention(*(t.detach().double().numpy() for t in (q, k, v)), scale=scale))


def _plan(engine=None) -> MachinePlan:
    """A plan on a 16 KiB L2, so that the small shapes here stream (K/V bytes per head above
    it), with the engine fixed or (None) left to the timing."""
    return MachinePlan(16 << 10, 32 << 20, "set", decode_engine=engine)


@pytest.fixture
def plan():
    """Set a plan for the test (`plan(engine)`); the process's plan and timings come back after."""
    before = machine_plan()

    def use(engine=None):
        set_machine_plan(_plan(engine))

    yield use
    set_machine_plan(before)


@pytest.mark.parametrize("H, Hkv", [(8, 2), (9, 3), (4, 1), (6, 6)])  # GQA, MQA, MHA
@pytest.mark.parametrize("B, T", [(1, 1), (2, 1), (1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gemm_equals_the_reference(H, Hkv, B, T, dtype):
    q, k, v = _qkv(B=B, H=H, Hkv=Hkv, T=T, dtype=dtype)
    out = decode.gemm(q, k, v, 0.3)
    assert out.shape == (B, H, T, 16) and out.dtype == dtype
    assert_close(out, _reference(q, k, v, scale=0.3), dtype, what=f"gemm B={B} H={H} Hkv={Hkv} T={T}")


def test_gemm_with_a_value_width_of_its_own_and_a_cache_view(plan):
    plan()
    q, _, _ = _qkv()
    g = torch.Generator().manual_seed(1)
    k_buf, v_buf = torch.randn(2, 2, 512, 16, generator=g), torch.randn(2, 2, 512, 24, generator=g)
    k, v = k_buf[:, :, :300], v_buf[:, :, :300]  # a static cache: capacity 512, 300 keys held
    q = q.expand(2, -1, -1, -1).contiguous()
    assert decode.gemm_applies(q, k, v)  # batch and heads merge without a copy
    out = decode.gemm(q, k, v, 0.25)
    assert out.shape == (2, 8, 1, 24)
    assert_close(out, _reference(q, k, v, scale=0.25), torch.float32, what="gemm over a cache view")


def test_gemm_applies_only_where_it_may(plan):
    plan()
    q, k, v = _qkv()
    assert decode.gemm_applies(q, k, v)
    assert not decode.gemm_applies(*(t.bfloat16() for t in (q, k, v)))  # its CPU GEMM would round the scores
    few = _qkv(S=40)  # 40 * 32 * 4 = 5 KiB per head: in the 16 KiB L2
    assert not decode.gemm_applies(*few)
    wide = _qkv(H=66, Hkv=2)  # 33 folded rows: torch's kernel splits the queries itself
    assert not decode.gemm_applies(*wide)
    kt = k.transpose(0, 1).contiguous().transpose(0, 1).expand(2, -1, -1, -1)  # heads and batch do not merge
    assert not decode.gemm_applies(q.expand(2, -1, -1, -1), kt, v.expand(2, -1, -1, -1))
    q.requires_grad_(True)
    assert not decode.gemm_applies(q, k, v)
    with torch.no_grad():
        assert decode.gemm_applies(q, k, v)


def _count(monkeypatch, name: str, delay: float = 0.0) -> list:
    """Count calls of decode.<name> (slowed by `delay` seconds each)."""
    calls = []
    inner = getattr(decode, name)

    def spy(*args, **kwargs):
        calls.append(1)
        if delay:
            time.sleep(delay)
        return inner(*args, **kwargs)

    monkeypatch.setattr(decode, name, spy)
    return calls


@pytest.mark.parametrize("engine", ["gemm", "flash"])
def test_the_plan_fixes_the_engine_and_attend_follows_it(plan, monkeypatch, engine):
    plan(engine)
    calls = _count(monkeypatch, "gemm")
    q, k, v = _qkv()
    out, _ = attend(q, k, v, causal=True)  # one query: causality changes nothing
    assert len(calls) == (engine == "gemm")
    assert_close(out, _reference(q, k, v), torch.float32, what=f"attend with the {engine} engine")
    assert measured_choices() == {}  # nothing timed: the plan said


def test_the_engine_is_timed_once_per_case_and_the_faster_kept(plan, monkeypatch):
    plan()
    q, k, v = _qkv()
    calls = _count(monkeypatch, "gemm", delay=0.01)  # far slower than torch's kernel on 300 keys
    _count(monkeypatch, "native", delay=0.01)  # and so is the native kernel, where it is built
    assert decode.engine(q, k, v, 0.25) == "flash"
    assert len(calls) == FASTEST_ROUNDS
    threads = torch.get_num_threads()
    assert measured_choices() == {"decode_engine": {f"float32, {threads} threads, 4 rows, D 16, streamed": "flash"}}
    assert machine_plan().as_dict()["measured"] == measured_choices()
    attend(q, k, v)
    assert decode.engine(q, k, v, 0.25) == "flash" and len(calls) == FASTEST_ROUNDS  # kept: not timed again
    other = _qkv(H=4, Hkv=2)  # 2 rows: another case, timed on its own
    assert decode.engine(*other, 0.25) == "flash" and len(calls) == 2 * FASTEST_ROUNDS
    monkeypatch.undo()
    plan()  # a new plan: the timings are forgotten
    assert measured_choices() == {}
    _count(monkeypatch, "_flash", delay=0.01)
    _count(monkeypatch, "native", delay=0.01)
    assert decode.engine(q, k, v, 0.25) == "gemm"
    out, _ = attend(q, k, v)
    assert_close(out, _reference(q, k, v), torch.float32, what="attend after the timing chose gemm")


@pytest.mark.parametrize("where", ["query", "one key", "one value", "every key"])
@pytest.mark.parametrize("engine", ["gemm", "native"])
def test_nan_rule_through_the_engines(plan, where, engine):
    """Through `attend` and its NaN check, a NaN reaches exactly the rows it would through
    torch's kernel: the query's row, or every row of the K/V head that holds it; the other
    rows are exact. The native engine where this machine builds it (`kernels.native`)."""
    if engine == "native" and native.library() is None:
        pytest.skip(f"no native library: {native.unavailable()}")
    plan(engine)
    q, k, v = _qkv()
    if where == "query":
        q[0, 5, 0, 1] = float("nan")
    elif where == "one key":
        k[0, 1, 30, 0] = float("nan")
    elif where == "one value":
        v[0, 0, 7, 2] = float("nan")
    else:
        k[0, 0, :, 3] = float("nan")
    out, _ = attend(q, k, v)
    kv_nan = (torch.isnan(k).any(-1).any(-1) | torch.isnan(v).any(-1).any(-1)).repeat_interleave(4, dim=1)
    want = torch.isnan(q).any(-1) | kv_nan[..., None]  # (B, H, T)
    assert torch.equal(torch.isnan(out).any(-1), want)
    assert torch.isnan(out[want]).all()
    assert_close(out[~want[..., 0]], _reference(q, k, v)[~want[..., 0]], torch.float32, what="rows without NaN")


def test_an_unknown_engine_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^MachinePlan.decode_engine must be one of None, 'flash', 'gemm', 'native'; "
                                         r"received 'fast'$"):
        MachinePlan(decode_engine="fast")
    with pytest.raises(ValueError, match="decode_engine must be one of"):
        machine_plan().with_choices(decode_engine="GEMM")

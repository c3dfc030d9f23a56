"""The decode step's native engine (`kernels.decode.native`, the C kernel `decode_step.c` that
`kernels.native` builds for the machine): exact against the NumPy float64 reference over
GQA/MQA/MHA, batches, a few queries, the usual head widths, key counts around its block and
vector edges, a cache's strided view, and the key parts it merges when the items do not
divide among the threads; taken only where it may (the NaN rule through it:
test_decode_engine.py, beside the GEMMs'); and a machine
without a compiler or with the kernel turned off keeps its torch engines, with the reason."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_close
from multihead import reference as R
from multihead.functional import attend
from multihead.kernels import MachinePlan, decode, machine_plan, native, set_machine_plan

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native kernel: {native.unavailable()}")


def _qkv(B=1, H=8, Hkv=2, T=1, S=300, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D))
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64).float() for shape in shapes)


def _reference(q, k, v, scale):
    return torch.from_numpy(R.attention(*(t.detach().double().numpy() for t in (q, k, v)), scale=scale))


@pytest.fixture
def threads(monkeypatch):
    """Run the test body at a thread count of its own, every thread given a share however few
    the keys (`decode._GRAIN` 1: the small shapes here split as a long step would); the
    count comes back after."""
    monkeypatch.setattr(decode, "_GRAIN", 1)
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("H, Hkv", [(8, 2), (9, 3), (4, 1), (6, 6), (32, 8)])  # GQA, MQA, MHA
@pytest.mark.parametrize("B, T", [(1, 1), (2, 1), (1, 3)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_native_equals_the_reference(H, Hkv, B, T, n_threads, threads):
    threads(n_threads)
    q, k, v = _qkv(B=B, H=H, Hkv=Hkv, T=T)
    out = decode.native(q, k, v, 0.3)
    assert out.shape == (B, H, T, 16) and out.dtype == torch.float32
    assert_close(out, _reference(q, k, v, 0.3), torch.float32,
                 what=f"native B={B} H={H} Hkv={Hkv} T={T} threads={n_threads}")


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("S", [1, 3, 63, 64, 65, 129, 1000])  # around the 64-key block and the vector's keys
def test_native_at_the_usual_head_widths_and_key_counts(D, S):
    q, k, v = _qkv(H=8, Hkv=2, S=S, D=D, seed=S)
    q = q * 3  # sharper softmax: the running max moves from block to block
    assert_close(decode.native(q, k, v, D ** -0.5), _reference(q, k, v, D ** -0.5), torch.float32,
                 what=f"native D={D} S={S}")


@pytest.mark.parametrize("B, Hkv", [(1, 1), (1, 3), (3, 1)])  # items that 2 threads do not share evenly
def test_the_key_parts_merge_exactly(B, Hkv, threads):
    threads(2)
    q, k, v = _qkv(B=B, H=4 * Hkv, Hkv=Hkv, S=777)
    k[..., 500:, :] *= 4  # the parts' maxima differ: the merge's weights matter
    assert_close(decode.native(q, k, v, 0.5), _reference(q, k, v, 0.5), torch.float32, what=f"parts B={B} Hkv={Hkv}")


def test_native_over_a_cache_view():
    g = torch.Generator().manual_seed(1)
    k_buf, v_buf = torch.randn(2, 2, 512, 32, generator=g), torch.randn(2, 2, 512, 32, generator=g)
    k, v = k_buf[:, :, :300], v_buf[:, :, :300]  # a static cache: capacity 512, 300 keys held
    q = torch.randn(2, 8, 1, 32, generator=g)
    assert decode.native_applies(q, k, v)
    assert_close(decode.native(q, k, v, 0.25), _reference(q, k, v, 0.25), torch.float32, what="native over a view")
    heads_last = k_buf.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)[:, :, :300]  # (B, S, Hkv, D) storage
    assert_close(decode.native(q, heads_last, v, 0.25), _reference(q, heads_last, v, 0.25), torch.float32,
                 what="native over a (B, S, Hkv, D) layout")


def test_native_applies_only_where_it_may():
    q, k, v = _qkv()
    assert decode.native_applies(q, k, v)
    assert not decode.native_applies(*(t.double() for t in (q, k, v)))  # float32 only
    width = native.library().mh_vector_width()
    assert not decode.native_applies(*_qkv(D=width + 4))  # a width its vectors do not divide
    assert not decode.native_applies(q, k, torch.randn(1, 2, 300, 32))  # Dv != D
    assert not decode.native_applies(*_qkv(H=66, Hkv=2))  # 33 folded rows, 36 padded: over 32
    assert decode.native_applies(*_qkv(H=64, Hkv=2))  # 32 rows
    assert not decode.native_applies(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)  # a strided last dim
    assert not decode.native_applies(q, k[:, :, :0], v[:, :, :0])  # no key


def _plan(engine=None) -> MachinePlan:
    return MachinePlan(16 << 10, 32 << 20, "set", decode_engine=engine)  # 300 keys of 16 stream past a 16 KiB L2


@pytest.fixture
def plan():
    before = machine_plan()
    yield lambda engine=None: set_machine_plan(_plan(engine))
    set_machine_plan(before)


def test_the_plan_can_fix_native_and_attend_follows_it(plan, monkeypatch):
    plan("native")
    calls = []
    inner = decode.native_checked
    monkeypatch.setattr(decode, "native_checked", lambda *a: calls.append(1) or inner(*a))
    q, k, v = _qkv()
    out, _ = attend(q, k, v)
    assert calls == [1]
    assert_close(out, _reference(q, k, v, 0.25), torch.float32, what="attend with the native engine")
    q64, k64, v64 = (t.double() for t in (q, k, v))  # float64: the plan's "native" is torch's kernel here
    assert decode.engine(q64, k64, v64, 0.25) == "flash"
    out64, _ = attend(q64, k64, v64)
    assert calls == [1]
    assert_close(out64, _reference(q, k, v, 0.25), torch.float64, what="float64 under a native plan")


def test_a_case_kept_native_leaves_a_strided_step_to_torch(plan):
    """What a case keeps says nothing of a later step's layout: a step of the case timed
    "native" whose K has a strided last dim (which the kernel does not read) runs torch's
    kernel and gives the reference's answer."""
    from multihead.kernels.machine import remember

    plan()
    q, k, v = _qkv()
    strided = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert decode.gemm_applies(q, strided, v) and not decode.native_applies(q, strided, v)
    remember("decode_engine", f"float32, {torch.get_num_threads()} threads, 4 rows, D 16, streamed", "native")
    assert decode.engine(q, k, v, 0.25) == "native"  # kept for the case
    out, _ = attend(q, strided, v, scale=0.25)
    assert_close(out, _reference(q, k, v, 0.25), torch.float32, what="a strided K in a case kept native")


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """`native.library()` asked anew under the test's environment; the process's library after."""
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path))
    native.reset()
    yield tmp_path
    monkeypatch.undo()
    native.reset()


def test_turned_off_the_step_keeps_its_torch_engines(fresh_library, monkeypatch, plan):
    monkeypatch.setenv("MULTIHEAD_NATIVE", "0")
    assert native.library() is None
    assert native.unavailable() == "MULTIHEAD_NATIVE is set to turn it off"
    q, k, v = _qkv()
    assert not decode.native_applies(q, k, v)
    plan()
    assert decode.engine(q, k, v, 0.25) in ("flash", "gemm")
    plan("native")
    assert decode.engine(q, k, v, 0.25) == "flash"
    out, _ = attend(q, k, v)
    assert_close(out, _reference(q, k, v, 0.25), torch.float32, what="attend with the kernel turned off")


def test_no_compiler_is_named(fresh_library, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert native.library() is None
    assert native.unavailable() == "no C compiler: 'no-such-compiler-here' is not on PATH (set CC to one)"
    assert list(fresh_library.rglob("*")) == []  # nothing written


def test_a_failing_compiler_is_named_and_leaves_nothing(fresh_library, monkeypatch):
    monkeypatch.setenv("CC", "false")
    assert native.library() is None
    assert native.unavailable().startswith(f"{shutil.which('false')} could not build decode_step.c and band.c (exit 1)")
    assert [p.name for p in fresh_library.rglob("*") if p.is_file()] == []  # no half-written library


def test_the_build_is_kept_and_not_repeated(fresh_library):
    first = native.build()
    assert first.parent == fresh_library / "native" and first.name.startswith("native-")
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp  # found, not built again
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left beside it
    lib = native.library()
    assert lib is not None and native.unavailable() is None
    assert lib.mh_vector_width() in (8, 16) and native.vector_width() == lib.mh_vector_width()


def test_a_damaged_library_in_the_cache_is_built_again(fresh_library):
    """A file the loader refuses (here: not a library at all) is removed and built once more."""
    built = native.build()
    damaged = built.with_name("damaged")
    damaged.write_bytes(b"not an ELF file")
    damaged.replace(built)  # a new file at the library's name, as a copy or a crash would leave it
    lib = native.library()
    assert lib is not None, native.unavailable()
    assert lib.mh_vector_width() in (8, 16) and built.read_bytes()[:4] == b"\x7fELF"


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MULTIHEAD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.cache_dir() == tmp_path / "multihead" / "native"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert native.cache_dir() == Path.home() / ".cache" / "multihead" / "native"
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "mine"))
    assert native.cache_dir() == tmp_path / "mine" / "native"


def test_a_long_cache_on_two_threads_with_parts(threads):
    """20,000 keys over 3 K/V heads on 2 threads: 2 parts per head, 313 blocks each."""
    threads(2)
    q, k, v = _qkv(H=9, Hkv=3, S=20000, D=64, seed=7)
    assert_close(decode.native(q, k, v, 0.125), _reference(q, k, v, 0.125), torch.float32, what="20,000 keys, 2 parts")


@pytest.mark.parametrize("S", [3, 4, 5, 7, 10])
def test_three_threads_split_few_keys_into_parts_none_empty(S, threads):
    """One K/V head on 3 threads: 3 parts of S keys; at S = 4 ceil-sized parts would leave the
    last one empty (a 0/0 in the merge). Each part holds S // 3 or S // 3 + 1 keys."""
    threads(3)
    if torch.get_num_threads() != 3:
        pytest.skip("this torch caps the threads below 3")
    q, k, v = _qkv(H=4, Hkv=1, S=S, seed=S)
    assert_close(decode.native(q, k, v, 0.25), _reference(q, k, v, 0.25), torch.float32, what=f"3 parts of {S} keys")


@pytest.mark.parametrize("where", ["nan in q", "nan in a key", "nan in a value", "inf in a key", "clean"])
def test_the_kernel_flags_the_rows_the_nan_rule_reads(where):
    """`native_checked` says whether a row of its output is not finite or zero throughout,
    as `functional._nan_or_zero_row` would on the same output, so the step need not look
    again (a clean output: no second call)."""
    from multihead.functional import _nan_or_zero_row

    q, k, v = _qkv(H=9, Hkv=3, S=100, D=32)
    t, at = {"q": (q, (0, 4, 0, 3)), "a key": (k, (0, 1, 17, 5)), "a value": (v, (0, 2, 50, 0))}.get(
        where.split(" in ")[-1], (q, None))
    if at is not None:
        t[at] = float("nan") if where.startswith("nan") else float("inf")
    out, bad = decode.native_checked(q, k, v, 32 ** -0.5)
    assert bad == _nan_or_zero_row(out)
    assert bad == (where != "clean")


@pytest.mark.parametrize("S", [1, 50, 3000])
@pytest.mark.parametrize("grain", [1, 32768, 1 << 40])  # every thread; torch's grain; one thread always
def test_any_share_of_threads_gives_the_same_answer(S, grain, threads, monkeypatch):
    """How many threads take a step (those with `_GRAIN` floats of K and V each) and its parts
    change who computes what, never the answer beyond rounding."""
    threads(2)
    monkeypatch.setattr(decode, "_GRAIN", grain)
    q, k, v = _qkv(H=9, Hkv=3, S=S, D=64, seed=S)
    assert_close(decode.native(q, k, v, 0.125), _reference(q, k, v, 0.125), torch.float32,
                 what=f"S={S} grain={grain}")


def test_a_strided_query_is_read_where_it_lies():
    """q as the HF attention function hands it, a transposed view `(B, T, H, D) -> (B, H, T, D)`
    with T = 3, and a query whose last dim is strided, which `native_applies` refuses."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 8, 16, generator=g).transpose(1, 2)  # (B, H, T, D), not contiguous
    _, k, v = _qkv(B=2, T=3)
    assert not q.is_contiguous() and decode.native_applies(q, k, v)
    assert_close(decode.native(q, k, v, 0.25), _reference(q, k, v, 0.25), torch.float32, what="transposed q")
    assert not decode.native_applies(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)


def test_the_buffers_follow_q_not_the_default_dtype():
    """With torch's default dtype float64, the kernel's output is still the float32 it writes."""
    q, k, v = _qkv()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = decode.native(q, k, v, 0.25)
    finally:
        torch.set_default_dtype(before)
    assert out.dtype == torch.float32
    assert_close(out, _reference(q, k, v, 0.25), torch.float32, what="native under a float64 default dtype")

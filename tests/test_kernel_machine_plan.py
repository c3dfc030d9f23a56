"""The kernels' machine plan: read from sysfs (a fake tree here), its rules giving the tuned
constants on a 2 MiB L2, replaceable and put back, and the kernels exact under every plan
(against a float64 softmax written out, not against another kernel)."""

from __future__ import annotations

import math

import pytest
import torch

import multihead.kernels as kernels
from multihead.functional import scaled_dot_product_attention
from multihead.kernels import decode, explicit_tiles, native
from multihead.kernels.machine import MachinePlan, read_caches
from multihead.masks import causal, sliding_window
from multihead.score_mods import softcap


def _fake_cpu0(root, caches):
    for i, (level, kind, size) in enumerate(caches):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


@pytest.fixture
def restore_plan():
    before = kernels.set_machine_plan(None)
    yield
    kernels.set_machine_plan(before)


def test_read_caches_from_sysfs(tmp_path):
    amd = _fake_cpu0(tmp_path / "amd", [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                        (3, "Unified", "32768K")])
    assert read_caches(amd) == (1 << 20, 32 << 20)
    no_l3 = _fake_cpu0(tmp_path / "arm", [(1, "Data", "64K"), (2, "Unified", "4M")])
    assert read_caches(no_l3) == (4 << 20, 4 << 20)
    assert read_caches(tmp_path / "absent") is None
    broken = _fake_cpu0(tmp_path / "broken", [(2, "Unified", "lots")])
    assert read_caches(broken) is None


def test_machine_plan_reads_the_os_once(tmp_path, monkeypatch, restore_plan):
    from multihead.kernels import machine
    # a fake sysfs: the plan must come from what the OS says, and this machine's caches are unknown
    monkeypatch.setattr(machine, "CACHE_ROOT", _fake_cpu0(tmp_path, [(2, "Unified", "512K"), (3, "Unified", "8M")]))
    kernels.set_machine_plan(None)
    plan = kernels.machine_plan()
    assert (plan.l2_bytes, plan.l3_bytes, plan.source) == (512 << 10, 8 << 20, "sysfs")
    assert kernels.machine_plan() is plan  # kept for the process
    monkeypatch.setattr(machine, "CACHE_ROOT", tmp_path / "absent")  # a machine whose sysfs says nothing
    kernels.set_machine_plan(None)
    assert kernels.machine_plan() == MachinePlan()  # unreadable: the tuned machine's caches
    assert kernels.machine_plan().source == "default"


@pytest.mark.parametrize("l2", [256 << 10, 1 << 20, 2 << 20, 3 << 20, 32 << 20])
def test_rules_give_the_tuned_constants_on_a_2_mib_l2(l2):
    plan = MachinePlan(l2, 260 << 20, "sysfs")
    assert plan.min_split_bytes == l2  # one core's L2: 2 MiB, the constant tuned there, on a 2 MiB L2
    assert plan.explicit_tile == 256  # measured, not derived: the same on every machine
    assert plan.as_dict()["min_split_bytes"] == l2 and plan.as_dict()["overridden"] == []


def test_overrides_and_errors(restore_plan):
    plan = MachinePlan(1 << 20, 32 << 20, "sysfs").with_choices(explicit_tile=48)
    assert (plan.explicit_tile, plan.min_split_bytes, plan.source) == (48, 1 << 20, "set")
    assert plan.as_dict()["explicit_tile"] == 48 and plan.as_dict()["overridden"] == []
    before = kernels.set_machine_plan(plan)
    assert kernels.machine_plan() is plan and explicit_tiles.default_tile() == 48
    assert kernels.set_machine_plan(before) is plan
    with pytest.raises(ValueError, match="is not one; valid: min_split_bytes, explicit_tile, flops_per_thread"):
        MachinePlan().with_choices(tile=3)
    with pytest.raises(ValueError, match=r"^MachinePlan.explicit_tile must be an int >= 1; received 0$"):
        MachinePlan().with_choices(explicit_tile=0)
    split = MachinePlan(1 << 20).with_choices(min_split_bytes=5).with_choices(min_split_bytes=7)
    assert split.min_split_bytes == 7 and split.overrides == (("min_split_bytes", 7),)
    with pytest.raises(ValueError, match=r"^MachinePlan.l2_bytes must be an int >= 1; received 0$"):
        MachinePlan(l2_bytes=0)
    with pytest.raises(TypeError, match=r"^MachinePlan.l2_bytes must be an int >= 1; received 1.5 \(float\)$"):
        MachinePlan(l2_bytes=1.5)
    with pytest.raises(TypeError, match=r"^MachinePlan override min_split_bytes must be an int >= 1; received 2.5"):
        MachinePlan(overrides=(("min_split_bytes", 2.5),))
    with pytest.raises(TypeError, match="takes a MachinePlan or None, got dict"):
        kernels.set_machine_plan({"l2_bytes": 1})


def _reference(q, k, v, allowed=None, cap=None):
    """softmax(q k^T / sqrt(D) [softcapped] [masked]) v in float64, K/V heads repeated for GQA."""
    G = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(G, 1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


def test_decode_split_exact_under_every_plan(restore_plan):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 1, 32), torch.randn(1, 2, 301, 32), torch.randn(1, 2, 301, 32)
    ref = _reference(q, k, v)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # 2 K/V heads on 3 threads: the split is worth it when the bytes are
    try:
        for split in (1, 64 << 20):  # every step splits / none does
            kernels.set_machine_plan(MachinePlan(1 << 20, 32 << 20).with_choices(min_split_bytes=split))
            assert decode.split_bytes() == split
            assert (decode.key_splits(q, k, v) > 1) == (split == 1)
            out = scaled_dot_product_attention(q, k, v)
            torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("tile, rate", [(3, 20e9), (64, 1e9), (256, 20e9), (512, 1e12)])
def test_block_sparse_exact_under_every_plan(tile, rate, restore_plan):
    kernels.set_machine_plan(MachinePlan(1 << 20, 32 << 20).with_choices(explicit_tile=tile, flops_per_thread=rate))
    torch.manual_seed(1)
    N = 300
    q, k, v = torch.randn(1, 4, N, 16), torch.randn(1, 2, N, 16), torch.randn(1, 2, N, 16)
    i = torch.arange(N)
    allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 64)
    out = scaled_dot_product_attention(q, k, v, mask=sliding_window(64) & causal(), backend="tiles")
    torch.testing.assert_close(out.double(), _reference(q, k, v, allowed), rtol=0, atol=1e-5)
    capped = scaled_dot_product_attention(q, k, v, causal=True, score_mod=softcap(20.0), backend="tiles")
    torch.testing.assert_close(capped.double(), _reference(q, k, v, i[:, None] >= i[None, :], 20.0),
                               rtol=0, atol=1e-5)


def test_decode_profile_records_the_machine(tmp_path):
    """benchmarks/decode_profile.py --quick runs (it asserts the step against a float64 softmax),
    and its JSON says which machine: the cache sizes the kernels read, the plan, the load at
    its start and end. Not a timing assertion."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "decode_profile.py"), "--quick", "--threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    m = report["machine"]
    assert (m["l2_bytes"], m["l3_bytes"]) == (read_caches() or (None, None))
    plan = dict(m["kernel_plan"])
    assert isinstance(plan.pop("measured"), dict)  # what that process timed: its own
    assert plan == {k: v for k, v in kernels.machine_plan().as_dict().items() if k != "measured"}
    assert len(m["loadavg_start"]) == 3 and len(m["loadavg_end"]) == 3 and m["threads"] == 1
    native_row = ["native engine"] if native.library() is not None else []  # where the C kernel builds
    assert [r["part"] for r in report["rows"]] == ["K pass", "softmax", "V pass", "flash call", "gemm engine",
                                                  *native_row, "multihead step", "region"]
    assert abs(sum(r["share_cpu"] for r in report["rows"][:3]) - 1) < 1e-9
    for r in report["rows"]:  # the share of both read rates, for the steps only
        if r["pct_read"] is None:
            assert r["pct_read_kv"] is None
        else:
            assert r["pct_read_kv"] == pytest.approx(r["pct_read"] * report["read_gb_s"] / report["read_kv_gb_s"])
    x = report["compute"]  # the native step beside its reads and its compute, from the same medians
    if native_row:
        step = next(r["wall_us"] for r in report["rows"] if r["part"] == "native engine")
        assert x["step_us"] == pytest.approx(step)
        assert x["read_us"] == pytest.approx(report["config"]["kv_bytes"] / report["read_kv_gb_s"] / 1e3)
        keys = report["config"]["Hkv"] * report["config"]["L"]
        assert x["compute_us"] == pytest.approx(x["ns_per_key"] * 1e-3 * keys)
        if x["overlap"] is not None:
            assert x["overlap"] == pytest.approx((x["read_us"] + x["compute_us"] - x["step_us"])
                                                 / min(x["read_us"], x["compute_us"]))
    else:
        assert x is None


def test_cpu_fields_reads_the_first_value_of_each_field_asked():
    """`cpu_fields` against /proc/cpuinfo read here: the first "model name" and "flags" lines,
    a field no line has left out."""
    from pathlib import Path

    from multihead.kernels.machine import cpu_fields

    info = Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo on this OS")
    first = {}
    for line in info.read_text().splitlines():
        name, _, value = line.partition(":")
        first.setdefault(name.strip(), value.strip())
    got = cpu_fields("model name", "flags", "no such field")
    assert got == {n: first[n] for n in ("model name", "flags") if n in first}


def test_fastest_keeps_the_incumbent_unless_another_wins_by_the_margin():
    """Each run is called `rounds` times in turn; a challenger must beat the incumbent's best
    time by 1 - margin (a run that sleeps 20 ms against one that sleeps 0 wins by far; the
    same run under two names ties, and the tie keeps the incumbent)."""
    import time

    from multihead.kernels.machine import fastest

    order = []

    def run(name, seconds):
        return lambda: order.append(name) or time.sleep(seconds)

    assert fastest({"slow": run("slow", 0.02), "quick": run("quick", 0.0)}, "slow", rounds=3) == "quick"
    assert order == ["slow", "quick"] * 3
    assert fastest({"slow": run("slow", 0.02), "quick": run("quick", 0.0)}, "quick") == "quick"
    assert fastest({"a": run("a", 0.005), "b": run("b", 0.005)}, "a", margin=0.5) == "a"
    assert fastest({"a": run("a", 0.005), "b": run("b", 0.005)}, "b", margin=0.5) == "b"

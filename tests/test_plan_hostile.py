"""plan under hostile configs: a huge layer count answers at once, in closed
form and equal to counting layer by layer; a named pipe, socket or device is refused
before it is opened, in one line, exit 2."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead.plan import account, read_config
from multihead.plan.geometry import MixtureOfExperts
from plan_public_configs import CONFIGS

HUGE = 2**40  # the largest layer count a config may hold (configs.MAX_FIELD)


@pytest.mark.parametrize("name", ["qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "deepseek-v3", "deepseek-v2-lite",
                                  "gemma-3-1b", "gemma-3-4b", "mixtral-8x7b", "gpt-oss-20b"])
def test_huge_layer_count_answers_at_once(name):
    cfg = copy.deepcopy(CONFIGS[name])
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] = HUGE
    text.pop("layer_types", None)  # a list of 2**40 entries cannot be in a 4 MiB file
    start = time.perf_counter()
    model = read_config(cfg)
    acc = account(model, context=4096)
    took = time.perf_counter() - start
    assert took < 1.0, f"{name} with 2**40 layers took {took:.1f} s"
    assert acc["geometry"]["n_layers"] == HUGE
    if model.moe is not None:
        # every layer past the dense ones is MoE at step 1; the closed form must say so
        moe = model.moe
        brute_head = sum(moe.is_moe_layer(i) for i in range(1000))
        assert model.n_moe_layers >= HUGE - 1000 * moe.layer_freq or brute_head == 0
        assert model.n_moe_layers == moe.count_moe_layers(HUGE)
    if name.startswith("gemma-3"):  # 5 local layers per global one
        assert model.n_window_layers == HUGE - HUGE // 6


@settings(max_examples=300, deadline=None)
@given(n_layers=st.integers(1, 120), first_dense=st.integers(0, 130), freq=st.integers(1, 7),
       offset=st.integers(0, 3), dense=st.lists(st.integers(0, 140), max_size=8))
def test_moe_layer_count_in_closed_form_equals_counting(n_layers, first_dense, freq, offset, dense):
    moe = MixtureOfExperts(n_experts=8, top_k=2, d_expert=16, first_dense=first_dense, layer_freq=freq,
                           freq_offset=offset, dense_layers=tuple(dense))
    assert moe.count_moe_layers(n_layers) == sum(moe.is_moe_layer(i) for i in range(n_layers))


@settings(max_examples=100, deadline=None)
@given(n_layers=st.integers(1, 200), pattern=st.integers(1, 9))
def test_gemma3_window_layers_in_closed_form_equal_counting(n_layers, pattern):
    cfg = copy.deepcopy(CONFIGS["gemma-3-1b"])
    cfg.pop("layer_types", None)
    cfg.update(num_hidden_layers=n_layers, sliding_window_pattern=pattern)
    model = read_config(cfg)
    assert model.n_window_layers == sum(1 for i in range(n_layers) if (i + 1) % pattern)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need POSIX")
def test_named_pipe_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    # one real process (a regression would block it: the timeout ends it) runs the three cases
    driver = ("import sys\nfrom multihead.cli import main\n"
              f"for argv in ([{str(fifo)!r}], [{str(tmp_path)!r}], [{str(fifo)!r}, {str(fifo)!r}]):\n"
              "    flag = '--model' if len(argv) == 1 else '--compare'\n"
              "    print('exit', main(['plan', flag, *argv]), file=sys.stderr, flush=True)\n")
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=30)
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and len(lines) == 6, r.stderr
    for error, code in zip(lines[0::2], lines[1::2]):
        assert code == "exit 2" and error.startswith("multihead plan: error: ") and "config.json" in error
        assert "named pipe" in error or "without a config.json" in error
    assert time.perf_counter() - start < 20


def test_devices_and_sockets_are_refused_naming_the_kind(tmp_path):
    with pytest.raises(ValueError, match="/dev/zero is a device, not a regular file"):
        read_config("/dev/zero")
    import socket

    path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(path))
        with pytest.raises(ValueError, match="is a socket, not a regular file"):
            read_config(path)
    finally:
        sock.close()

"""`make run`, as the Makefile writes it, on SmolLM2: the summary a person reads (at most 30
lines: every head's role, per role the strongest heads, the induction heads with their
causal check, the files, the next command), the files it says it wrote, and the causal
check's numbers, the same on the screen and in out/heads.json. The command is taken from
`make -n run` and run in a temporary folder, so the test runs what a fresh clone runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _make_run_command() -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("no make here")
    venv = Path(sys.executable).parent.parent
    r = subprocess.run(["make", "-n", "-s", "-C", str(ROOT), "run", f"VENV={venv}"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "-m multihead inspect" in ln)
    argv = shlex.split(line)
    return [sys.executable, *argv[1:]]


@pytest.mark.slow
def test_make_run_shows_the_summary_and_writes_its_files(tmp_path, smollm2):
    argv = _make_run_command()
    assert "--model" in argv and argv[argv.index("--model") + 1] == "smollm2", argv
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) <= 30, r.stdout
    assert lines[0].startswith("smollm2 (HuggingFaceTB/SmolLM2-135M-Instruct): 30 layers x 9 heads"), lines[0]
    counts = {ln.split()[0]: int(ln.split()[1]) for ln in lines if ln.startswith("  ") and not ln.startswith("  top ")
              and ln.split()[1].isdigit()}
    assert sum(counts.values()) == 270 and "induction" in counts and "previous_token" in counts, counts

    induction = next(ln for ln in lines if ln.startswith("induction heads"))
    assert len(re.findall(r"L\d+H\d \d\.\d\d", induction)) == 4, induction
    intact = re.search(r"causal check: loss \(nats\) on the repeated half of 2 x 40 random tokens repeated once, "
                       r"heads mean-ablated; intact (\d+\.\d\d)", r.stdout)
    row = re.search(r"top 4 \((L\d+H\d ?){4}\): (\d+\.\d\d); 4 random heads: (\d+\.\d\d) \(median of 5 draws\)",
                    r.stdout)
    assert intact and row, r.stdout
    ablated, at_random = float(row.group(2)), float(row.group(3))
    # the claim the screen makes: the induction heads matter more than as many random heads
    assert ablated > at_random + 0.5 and ablated > float(intact.group(1)), r.stdout

    out = tmp_path / "out"
    for name, label in (("head_view.html", "HTML head view"), ("heads.png", "PNG grid"),
                        ("heads.json", "full table (JSON)")):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
        assert f"{label}: {(out / name).resolve()}" in r.stdout
    assert (out / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads((out / "heads.json").read_text(encoding="utf-8"))
    assert len(table["roles"]) == 270 and len(table["summaries"]) == 270
    check = table["causal_check"]
    assert f"{check['metric_intact']:.2f}" == intact.group(1)
    assert f"{check['by_k'][0]['ablated']:.2f}" == row.group(2) and len(check["by_k"][0]["random"]) == 5
    assert lines[-1].startswith("next: multihead heads scan --task ioi --model smollm2"), lines[-1]

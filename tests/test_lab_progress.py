"""lab.progress: the progress line of one training and the count and ETA across several."""

from __future__ import annotations

import io

from multihead.lab.progress import Overall, Progress


def test_progress_line_has_steps_loss_rate_and_eta():
    stream = io.StringIO()
    bar = Progress(100, "demo", stream=stream)
    for step in range(1, 101):
        bar.update(step, 1.0 / step, tokens=64)
    out = stream.getvalue().strip().splitlines()
    assert 5 <= len(out) <= 12, "a non-terminal stream gets about one line per 10%"
    assert out[-1].startswith("demo [" + "#" * 24 + "] 100/100 loss 0.0100 ")
    assert "tok/s ETA 0:00" in out[-1]


def test_progress_across_runs_shows_k_of_n_and_the_overall_eta():
    overall = Overall(runs=3, steps=30)
    lines = []
    for _ in range(3):
        stream = io.StringIO()
        bar = Progress(10, overall.next_label("heads H=1"), stream=stream, overall=overall)
        for step in range(1, 11):
            bar.update(step, 1.0)
        lines.append(stream.getvalue().splitlines()[-1])
    assert [line.split()[0] for line in lines] == ["[1/3]", "[2/3]", "[3/3]"]
    assert all("| all 3 runs ETA" in line for line in lines)
    assert overall.done == 30 and lines[-1].endswith("all 3 runs ETA 0:00")

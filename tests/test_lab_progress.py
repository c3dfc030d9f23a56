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


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _simulate(total=200, step_s=1.0, first_extra=300.0, eval_every=20, eval_s=8.0):
    """A training whose evaluation before step 1 takes `first_extra` s and every `eval_every`
    steps `eval_s` s: (lines printed, {step: ETA shown}, the true time left at each step)."""
    clock, stream = FakeClock(), io.StringIO()
    bar = Progress(total, "induction", stream=stream, clock=clock)
    clock.t += first_extra
    shown, truth, times = {}, {}, {}
    for step in range(1, total + 1):
        clock.t += step_s
        bar.update(step, 1.0)
        shown[step] = bar.rate.eta(step, clock.t)
        times[step] = clock.t
        if step % eval_every == 0:
            clock.t += eval_s
    end = clock.t
    for step in times:
        truth[step] = end - times[step]
    return stream.getvalue().splitlines(), shown, truth, bar


def test_no_eta_during_warm_up_then_one_from_the_rate_since_warm_up():
    lines, shown, truth, bar = _simulate()
    warm = bar.rate.anchor[0]
    assert 2 <= warm <= 20
    # the old ETA at step 1 was (300 + 1) s * 199 steps: 16h38 for a 9-minute run
    assert all(shown[s] is None for s in range(1, warm + 1))
    assert "ETA (measuring)" in lines[0]
    # once an evaluation past the warm-up is in the average, within 20% of the truth; once a
    # few are, within 10% (the average since the warm-up counts them as they come), give or
    # take the one evaluation (8 s) that may or may not fall in what is left
    for step in range(2 * 20, 200, 7):
        tol = 0.2 if step < 80 else 0.1
        assert abs(shown[step] - truth[step]) <= tol * truth[step] + 8, (step, shown[step], truth[step])


def test_the_expected_total_is_said_once_when_first_known():
    lines, shown, truth, bar = _simulate()
    said = [line for line in lines if "expected about" in line]
    assert len(said) == 1 and said[0].startswith("induction: expected about ")
    assert "s/step after" in said[0] and "warm-up steps" in said[0]
    real_total = 300 + 200 * 1.0 + (200 // 20) * 8.0
    assert 0.8 * real_total <= bar.expected_s <= 1.1 * real_total


def test_overall_eta_waits_for_warm_up_and_counts_time_between_runs():
    clock = FakeClock()
    overall = Overall(runs=3, steps=30, clock=clock)
    etas = []
    for _ in range(3):
        clock.t += 5.0  # building the model, the held-out batches
        bar = Progress(10, overall.next_label("heads"), stream=io.StringIO(), overall=overall, clock=clock)
        for step in range(1, 11):
            clock.t += 1.0
            bar.update(step, 1.0)
            etas.append(overall.eta())
    assert etas[0] is None and etas[-1] == 0.0
    # after the first run, 1 s a step plus 5 s between runs: 1.5 s a step over what is left
    done_after_first = 10
    assert abs(etas[done_after_first + 1 - 1] - 1.5 * 19) < 0.2 * 1.5 * 19


def test_an_evaluation_right_after_the_warm_up_is_not_priced_into_every_step():
    # lab induction: 800 steps, evaluations every 20, warm-up 20: the interval after step 20
    # holds an evaluation; priced into every step it said "1h19" for a run of about 20 min
    lines, shown, truth, bar = _simulate(total=800, step_s=1.0, first_extra=30.0, eval_every=20, eval_s=5.0)
    real_total = 30 + 800 + 40 * 5.0
    assert 0.9 * real_total <= bar.expected_s <= 1.1 * real_total, bar.expected_s


def test_overall_eta_is_never_below_the_current_runs():
    clock = FakeClock()
    overall = Overall(runs=2, steps=200, clock=clock)
    for step_s in (0.1, 1.0):  # the second run is 10x slower (more heads)
        bar = Progress(100, overall.next_label("heads"), stream=io.StringIO(), overall=overall, clock=clock)
        for step in range(1, 101):
            clock.t += step_s
            bar.update(step, 1.0)
            line = bar.line(step, 1.0)
            if "ETA (measuring)" not in line.split("|")[0] and step < 100 and step_s == 1.0:
                this = line.split("|")[0].split("ETA ")[1].strip()
                every = line.split("all 2 runs ETA ")[1]
                to_s = lambda t: int(t.split(":")[0]) * 60 + int(t.split(":")[1])  # noqa: E731
                assert to_s(every) >= to_s(this), line


def test_several_runs_say_one_expected_total():
    clock = FakeClock()
    overall = Overall(runs=3, steps=300, clock=clock)
    text = ""
    for _ in range(3):
        stream = io.StringIO()
        bar = Progress(100, overall.next_label("heads"), stream=stream, overall=overall, clock=clock)
        for step in range(1, 101):
            clock.t += 1.0
            bar.update(step, 1.0)
        text += stream.getvalue()
    said = [line for line in text.splitlines() if "expected about" in line]
    assert len(said) == 1 and said[0].startswith("all 3 runs: expected about 5:00 in all"), said

"""docs/heads-circuit.md quotes what examples/ioi_circuit.py and examples/path_patch_timing.py
wrote (docs/heads-circuit/results.json, timings.json): every decimal number and percentage
between its results marks must be one of theirs as the doc rounds it (or a head's name, or one
of the few numbers quoted from Wang et al.), and the heads it names by class must be the
classes results.json holds. No model is run here."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "heads-circuit.md"
RESULTS = json.loads((ROOT / "docs" / "heads-circuit" / "results.json").read_text())
TIMINGS = json.loads((ROOT / "docs" / "heads-circuit" / "timings.json").read_text())
LITERATURE = {"10.7", "11.10", "87%"}  # GPT-2 small's negative name movers and circuit faithfulness (Wang et al.)
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+\.\d+%?|(?<![\w.])\d+%")


def _values(obj):
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield float(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _values(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _values(v)


def _allowed() -> set[str]:
    out = set(LITERATURE)
    skip = {"tables", "prompts"}  # the full tables hold every cell: only the quoted summaries count
    for source in (TIMINGS, {k: v for k, v in RESULTS.items() if k not in skip}):
        for x in _values(source):
            for v in (x, abs(x)):
                for d in range(5):
                    out.add(f"{v:.{d}f}")
                    out.add(f"{100 * v:.{d}f}%")
                out.add(repr(v))
    out |= set(RESULTS["effects"]["direct"])  # head names, "23.3"
    return out


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index("<!-- results -->"), text.index("<!-- /results -->")
    return text[start:end]


def test_every_quoted_number_is_in_the_results():
    allowed = _allowed()
    found = [m.group(0).lstrip("+") for m in NUMBER.finditer(_section())]
    assert len(found) > 40, "the results section quotes no numbers: the check could not fail"
    bad = sorted({x for x in found if x not in allowed and x.lstrip("-") not in allowed})
    assert not bad, f"docs/heads-circuit.md quotes numbers results.json/timings.json do not hold: {bad}"


def _heads(pairs) -> str:
    return ", ".join(f"{a}.{b}" for a, b in pairs)


def test_the_classes_named_are_the_results_classes():
    rows = _section()
    text = " ".join(rows.split())
    c = RESULTS["classes"]
    for layer, h in c["name_movers"]:
        assert re.search(rf"\| {layer}\.{h} \|[^\n]*\| name mover \|", rows), f"{layer}.{h} not a name mover row"
    for layer, h in c["negative_movers"]:
        assert re.search(rf"\| {layer}\.{h} \| -", rows), f"{layer}.{h} not a negative row"
    assert f"name movers {_heads(c['name_movers']).replace(', ', ' and ')}" in text
    assert f"one head passes, {_heads(c['s_inhibition'])}" in text
    assert c["induction_duplicate"] == [[17, 4]] and "17.4 through the values" in text
    circuit = _heads(RESULTS["circuit"]).split(", ")
    assert f"The circuit is the {len(circuit)} heads above" in text
    named = re.search(r"The circuit is the \d+ heads above \(([^)]*)\)", text).group(1)
    assert sorted(named.split(", ")) == sorted(circuit)


def test_the_timing_table_ratios_follow_from_the_seconds():
    g = TIMINGS["gpt2_shaped"]
    for key, ratio in g["ratio_to_patch_scan"].items():
        assert abs(g["best"][key] / g["best"]["patch_scan"] - ratio) < 0.006
    assert max(g["ratio_to_patch_scan"].values()) <= 3.0, "the path scans' target: at most 3x patch_scan"
    assert g["loop_vs_scan_max_diff"] < 1e-5

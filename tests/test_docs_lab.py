"""docs/lab.md quotes the committed runs: every number in its tables and every
paragraph it says the experiment wrote are read off docs/lab/<experiment>/results.json, and
each conclusion is what the current code writes from those numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "lab.md").read_text(encoding="utf-8")
EXPERIMENTS = ("heads", "kv", "mla", "induction")


def results(name: str) -> dict:
    return json.loads((ROOT / "docs" / "lab" / name / "results.json").read_text(encoding="utf-8"))


def table_after(header_start: str) -> list[list[str]]:
    """The cells of the Markdown table whose header line starts with `header_start`."""
    lines = DOC.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.parametrize("name, key", [("heads", "conclusion"), ("kv", "summary"), ("mla", "summary"),
                                       ("induction", "summary")])
def test_the_paragraph_the_experiment_wrote_is_quoted_verbatim(name, key):
    text = results(name)["results"][key]
    assert text in DOC, f"docs/lab.md does not quote docs/lab/{name}/results.json's {key}:\n{text}"


def test_each_run_is_dated_and_its_time_said():
    for name in EXPERIMENTS:
        res = results(name)
        day = res["date"][:10]
        assert re.search(rf"`{name}`[^.]*{day}", DOC), f"docs/lab.md does not date the {name} run ({day})"


def test_heads_table_is_the_results():
    r = results("heads")["results"]["by_heads"]
    rows = table_after("| heads | head_dim |")
    assert len(rows) == len(r)
    for cells, x in zip(rows, r):
        assert cells[0] == str(x["n_heads"]) and cells[1] == str(x["head_dim"])
        assert cells[2] == f"{x['final_loss_mean']:.4f} ± {x['final_loss_std']:.4f}"
        assert cells[3] == f"{100 * x['final_accuracy_mean']:.1f}%"
        assert cells[4] == (f"{x['steps_to_threshold_mean']:.0f} ({x['steps_to_threshold_min']}-"
                            f"{x['steps_to_threshold_max']})")


def test_kv_table_is_the_results():
    r = results("kv")["results"]["rows"]
    rows = table_after("| variant | KV heads / rank |")
    assert [c[0] for c in rows] == [x["name"] for x in r]
    for cells, x in zip(rows, r):
        assert cells[2] == f"{x['params']:,}"
        assert cells[4] == f"{x['cache_bytes_per_token_bf16']:,}"
        assert cells[5] == f"{x['cache_vs_mha']:.3f}"
        decode = f"{x['decode_us_per_token']:.0f}"
        if "decode_naive_us_per_token" in x:
            decode += f" ({x['decode_naive_us_per_token']:.0f} naive)"
        assert cells[6] == decode


def test_mla_tables_are_the_results():
    r = results("mla")["results"]
    rows = table_after("| model | cache bytes/token")
    assert [c[0] for c in rows] == [x["name"] for x in r["runs"]]
    for cells, x in zip(rows, r["runs"]):
        assert cells[1] == f"{x['cache_bytes_per_token']:,}" and cells[2] == f"{x['cache_vs_mha']:.3f}"
        assert cells[3] == f"{x['val_bpc']:.3f}" and cells[4] == f"{x['bpc_vs_mha']:+.3f}"
    rows = table_after("| MHA -> to_mla, kv_rank |")
    for cells, c in zip(rows, r["conversions"], strict=True):
        assert cells[0] == str(c["kv_rank"])
        assert cells[1] == ", ".join(f"{e:.3f}" for e in c["kv_reconstruction_error"])
        assert cells[2] == f"{c['val_bpc_converted']:.3f}" and cells[3] == f"{c['val_bpc_finetuned']:.3f}"


def test_each_conclusion_is_what_the_current_code_writes_from_the_committed_numbers():
    from multihead.lab import heads, induction, mla_report
    from multihead.lab.configs import HeadsConfig, InductionConfig, MLAConfig

    def cfg_of(cls, res):
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in res["config"].items()
                  if k in cls.__dataclass_fields__}
        return cls(**fields)

    res = results("mla")
    again = {"results": {"runs": res["results"]["runs"], "conversions": res["results"]["conversions"]}}
    mla_report.summarise_mla(cfg_of(MLAConfig, res), again)
    assert again["results"]["summary"] == res["results"]["summary"]
    res = results("heads")
    assert heads.conclusion(cfg_of(HeadsConfig, res), res["results"]["by_heads"]) == res["results"]["conclusion"]
    res = results("induction")
    r = dict(res["results"])
    # the analysis alone, rerun on the recorded evals: a run to redo it trains a model
    induction._analyse(cfg_of(InductionConfig, res), {"results": r})
    # (the run adds the head-ablation sentences after the analysis)
    assert res["results"]["summary"].startswith(r["summary"])

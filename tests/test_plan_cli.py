"""`multihead plan` at the command line: text, --json, --model, --compare, bad input."""

import json
import subprocess
import sys

import pytest

from multihead.cli import main
from plan_public_configs import CONFIGS as PUBLIC_CONFIGS

CONFIG_NAMES = ["gpt2", "llama-3-8b", "gemma-2-9b", "deepseek-v2-lite"]


@pytest.fixture()
def configs(tmp_path):
    CONFIGS = PUBLIC_CONFIGS

    paths = {}
    for name in CONFIG_NAMES:
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(CONFIGS[name]))
    return paths


def run(capsys, *argv):
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_recommend_json(capsys):
    code, out, err = run(capsys, "--params", "7B", "--context", "32k", "--accelerator", "h100-80gb",
                         "--batch-size", "16", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "multihead.plan.recommend/1"
    assert doc["request"]["params"] == 7_000_000_000 and doc["request"]["context"] == 32768
    assert doc["device"]["name"] == "h100-80gb" and doc["device"]["n_devices"] == 1
    pick = doc["pick"]
    assert pick["label"] == "GQA-4" and pick["fits"] is True and pick["rank"] == 1
    assert pick["geometry"]["d_model"] == pick["geometry"]["n_heads"] * pick["geometry"]["head_dim"]
    assert doc["alternatives"][0] == pick
    assert [a["rank"] for a in doc["alternatives"]] == list(range(1, len(doc["alternatives"]) + 1))
    assert {"q", "k", "v", "o"} == set(doc["init"])
    assert doc["check"]["command"].startswith("multihead lab induction")
    assert doc["bias"]["use"] is False
    assert isinstance(doc["warnings"], list) and isinstance(doc["notes"], list)


def test_recommend_text_is_an_aligned_table(capsys):
    code, out, _ = run(capsys, "--params", "125M", "--context", "2k", "--accelerator", "rtx-4090")
    assert code == 0
    assert "pick      MHA, 12 heads of 64, 12 KV heads, d_model 768" in out
    lines = out.split("alternatives, ranked:\n")[1].splitlines()
    header, rule, first = lines[0], lines[1], lines[2]
    assert header.split()[:3] == ["#", "variant", "H"]
    # Every column starts where its dashes start.
    starts = [i for i, ch in enumerate(rule) if ch == "-" and (i == 0 or rule[i - 1] == " ")]
    assert first[starts[1]:].startswith("MHA")
    assert "check     multihead lab induction --variant mha --n-layers 2 --d-model 768 --n-heads 12\n" in out


def test_recommend_warnings_reach_the_output(capsys):
    code, out, _ = run(capsys, "--params", "7B", "--context", "64k", "--variant", "mha",
                       "--n-heads", "32", "--head-dim", "16", "--d-model", "512")
    assert code == 0
    assert "warning: head_dim 16 is below 32" in out
    code, out, _ = run(capsys, "--params", "7B", "--context", "64k", "--variant", "MHA")
    assert "warning: MHA with 32 heads at 64K context" in out
    code, out, _ = run(capsys, "--params", "125M", "--n-kv-heads", "5", "--json")
    assert "n_heads (12) must be divisible by n_kv_heads (5); valid: 1, 2, 3, 4, 6, 12; using 4 (every KV head " \
           "serves the same number of query heads)" in json.loads(out)["warnings"]


def test_custom_device_and_devices(capsys):
    code, out, _ = run(capsys, "--params", "7B", "--memory", "48GiB", "--bandwidth", "960GB/s",
                       "--json")
    dev = json.loads(out)["device"]
    assert (dev["name"], dev["memory_bytes"], dev["bandwidth_bytes_per_s"]) == (
        "custom", 48 * 2**30, 960 * 10**9)
    code, out, _ = run(capsys, "--params", "70B", "--n-accelerators", "8", "--json")
    assert json.loads(out)["device"]["n_devices"] == 8


def test_config_json(capsys, configs):
    code, out, err = run(capsys, "--model", configs["llama-3-8b"], "--context", "8k",
                         "--batch-size", "4", "--accelerator", "a100-80gb", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "multihead.plan.account/1"
    (m,) = doc["models"]
    assert m["params"]["total"] == 8_030_261_248
    assert m["params"]["attention_per_layer"] == 41_943_040
    assert m["kv_cache"]["bytes_per_token"] == 131_072
    assert m["kv_cache"]["bytes"] == 131_072 * 8192 * 4
    assert m["device"]["fits"] is True and m["device"]["n_devices"] == 1
    assert m["flops"]["decode_per_token"] > m["flops"]["prefill_per_token"] > 0


def test_config_text_and_default_context(capsys, configs):
    code, out, _ = run(capsys, "--model", configs["gpt2"])
    assert code == 0
    assert "124,439,808" in out and "36,864 B" in out
    assert "KV @ 1K x 1" in out  # n_positions is the default context


def test_compare(capsys, configs):
    files = [configs[n] for n in CONFIG_NAMES]
    code, out, _ = run(capsys, "--compare", *files, "--context", "16k", "--json")
    assert code == 0
    models = json.loads(out)["models"]
    assert [m["name"] for m in models] == CONFIG_NAMES
    assert [m["params"]["total"] for m in models] == [
        124_439_808, 8_030_261_248, 9_241_705_984, 15_706_484_224]
    assert models[3]["kv_cache"]["decompressed_bytes_per_token"] == 276_480
    assert any("beyond the 1,024 positions" in w for w in models[0]["warnings"])
    code, text, _ = run(capsys, "--compare", *files, "--context", "16k")
    header = text.splitlines()[0]
    assert all(n in header for n in CONFIG_NAMES)
    assert "4096 on 21/42 layers" in text


def test_list_accelerators(capsys):
    code, out, _ = run(capsys, "--list-accelerators", "--json")
    names = [d["name"] for d in json.loads(out)["devices"]]
    assert {"h100-80gb", "h200", "a100-40gb", "a100-80gb", "rtx-4090", "l4", "m2-max",
            "cpu"} <= set(names)
    code, out, _ = run(capsys, "--list-accelerators")
    assert "h100-80gb" in out and "3,350 GB/s" in out


@pytest.mark.parametrize("argv, message", [
    (["--params=-7B"], "parameter count must be positive; received '-7B'"),
    (["--params", "7Q"], "write it like 125M, 1.3B, 7b, 70B, 1.2T"),
    (["--params", "7B", "--n-heads", "0"], "--n-heads must be positive; received 0"),
    (["--params", "7B", "--batch-size", "-2"], "--batch-size must be positive; received -2"),
    (["--params", "7B", "--batch-size", "two"], "--batch-size must be a whole number; received 'two'"),
    (["--params", "7B", "--context", "32kb"], "could not read context length '32kb'"),
    (["--params", "7B", "--accelerator", "h100"],
     "unknown device 'h100' (did you mean h100-80gb or h100-pcie?); valid: h100-80gb"),
    (["--params", "7B", "--dtype", "fp12"], "unknown dtype 'fp12'; valid: fp32, bf16"),
    (["--params", "7B", "--priority", "speed"], "--priority must be inference or training"),
    (["--params", "7B", "--variant", "flash"], "variant must be one of mha, gqa, mqa, mla"),
    (["--params", "7B", "--memory", "48GiB"], "a custom accelerator needs both --memory and"),
    (["--params", "7B", "--d-model", "4096", "--n-heads", "30"], "must be divisible by n_heads"),
    ([], "give exactly one of --params SIZE"),
    (["--params", "7B", "--model", "x.json"], "received --params, --model"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("multihead plan: error: ") and message in err
    assert err.count("\n") == 1


def test_bad_config_files(capsys, tmp_path, configs):
    not_json = tmp_path / "a.json"
    not_json.write_text("this is not json")
    not_model = tmp_path / "b.json"
    not_model.write_text(json.dumps({"vocab": {"a": 1}}))
    unknown = tmp_path / "c.json"
    unknown.write_text(json.dumps({"model_type": "rwkv"}))
    cases = [
        (not_json, "is not JSON"),
        (not_model, "is not a model config: it has no 'model_type'"),
        (unknown, "unknown model_type 'rwkv'; supported: bert, deepseek_v2"),
        (tmp_path / "missing.json", "cannot read"),
    ]
    for path, message in cases:
        code, _, err = run(capsys, "--model", path)
        assert code == 2 and message in err and err.count("\n") == 1
    code, _, err = run(capsys, "--model", configs["gpt2"], "--d-model", "512")
    assert code == 2 and "--d-model apply when recommending" in err


def test_subprocess_entry_point(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "multihead", "plan", "--params", "1.3B", "--json"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["pick"]["geometry"]["head_dim"] == 128
    bad = subprocess.run([sys.executable, "-m", "multihead", "plan", "--params", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip() == ("multihead plan: error: parameter count must be positive; "
                                  "received '0' (e.g. 125M, 1.3B, 7b, 70B, 1.2T)")


def test_config_folder_reads_its_config_json(capsys, tmp_path):
    folder = tmp_path / "Meta-Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PUBLIC_CONFIGS["llama-3-8b"]))
    code, out, _ = run(capsys, "--model", folder, "--json")
    model = json.loads(out)["models"][0]
    assert code == 0 and model["name"] == "Meta-Llama-3-8B"
    assert model["params"]["total"] == 8_030_261_248


def test_invalid_kv_heads_are_explained_on_the_pick_line(capsys):
    code, out, _ = run(capsys, "--params", "7B", "--n-kv-heads", "7")
    pick = next(line for line in out.splitlines() if line.startswith("pick "))
    assert pick.endswith("(4 KV heads, not 7: KV heads must divide the 32 query heads)")
    code, out, _ = run(capsys, "--params", "7B", "--n-kv-heads", "7", "--json")
    assert json.loads(out)["pick_note"] == "4 KV heads, not 7: KV heads must divide the 32 query heads"


def test_json_request_carries_what_plan_md_documents(capsys):
    # docs/plan.md: `request` is what was asked, with n_devices resolved.
    code, out, _ = run(capsys, "--params", "70B", "--context", "8k", "--json")
    req = json.loads(out)["request"]
    assert set(req) == {"params", "context", "batch", "priority", "dtype", "weights_dtype", "d_model",
                        "n_layers", "n_heads", "n_kv_heads", "head_dim", "variant", "kv_rank",
                        "vocab_size", "device", "n_devices"}
    assert (req["device"], req["n_devices"]) == ("h100-80gb", 4)  # 70B in bf16: 4 x 80 GiB
    assert req["params"] == 70_000_000_000 and req["n_kv_heads"] is None


def test_tiny_budget_warning_in_the_output(capsys):
    code, out, _ = run(capsys, "--params", "7")
    assert code == 0
    assert "warning: the budget is tiny: 7 parameters; did you mean 7M or 7B?" in out


def test_compare_table_never_prints_none(capsys, tmp_path):
    paths = []
    for name, cfg in PUBLIC_CONFIGS.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "--compare", *paths, "--accelerator", "h100-80gb")
    assert code == 0
    assert "None" not in out and "nan" not in out.lower() and "e+" not in out
    # MoE rows: Mixtral's 8 experts of 14336, top 2, in all 32 layers; active parameters.
    assert "8 x 14336, top 2, 32/32 layers" in out and "12,879,925,248 (12.9B)" in out
    assert "999,885,952 (1B)" in out  # Gemma-3-1B: not "1e+03M"

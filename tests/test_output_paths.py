"""A command's output files (--png, --html, --table) never land in the folder of the model it
reads (a --png onto model.safetensors replaced the weights, exit 0) and two of its flags never
name one file (the PNG was silently replaced by the HTML page)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from multihead.cli import main
from multihead.errors import UsageError
from multihead.files import output_file

transformers = pytest.importorskip("transformers")


def _digest(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, vocab_size=64,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_output_file_refuses_the_models_folder_and_a_second_flags_file(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    weights = model / "model.safetensors"
    weights.write_bytes(b"weights")
    for inside in (weights, model / "new.png", model / "sub" / "x.png"):
        with pytest.raises(UsageError, match=r"--png '.*' is inside the model's own folder .*; multihead never writes"):
            output_file("--png", str(inside), "out.png", source=model)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    with pytest.raises(UsageError, match="inside the model's own folder"):  # a file source: its folder
        output_file("--png", str(tmp_path / "beside.png"), "out.png", source=gguf)
    assert output_file("--png", str(tmp_path / "out.png"), "out.png", source=model) == tmp_path / "out.png"
    taken: dict = {}
    output_file("--png", str(tmp_path / "same"), "a.png", taken=taken)
    with pytest.raises(UsageError, match=r"--html '.*same' is the file --png writes too; give each its own file"):
        output_file("--html", str(tmp_path / "same"), "a.html", taken=taken)
    assert weights.read_bytes() == b"weights"


@pytest.mark.parametrize("argv", [
    ["heads", "circuit", "--n", "2", "--png", "{m}/model.safetensors"],
    ["heads", "circuit", "--n", "2", "--html", "{m}/config.json"],
    ["heads", "scan", "--task", "ioi", "--png", "{m}/model.safetensors"],
    ["heads", "path", "--task", "ioi", "--receivers", "logits", "--html", "{m}/config.json"],
    ["heads", "importance", "--prune-curve", "--png", "{m}/model.safetensors"],
    ["inspect", "a b c", "--table", "{m}/config.json"],
    ["heads", "circuit", "--n", "2", "--png", "{t}/same", "--html", "{t}/same"],
    ["inspect", "a b c", "--png", "{t}/same", "--html", "{t}/same"],
])
def test_commands_refuse_to_write_into_the_models_folder_or_one_file_twice(llama_folder, tmp_path, capsys, argv):
    before = _digest(llama_folder)
    argv = [a.format(m=llama_folder, t=tmp_path) for a in argv]
    assert main([*argv[:2], "--model", str(llama_folder), *argv[2:]] if argv[0] == "heads"
                else [argv[0], "--model", str(llama_folder), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert "inside the model's own folder" in err or "writes too; give each its own file" in err, err
    assert _digest(llama_folder) == before
    assert not (tmp_path / "same").exists()

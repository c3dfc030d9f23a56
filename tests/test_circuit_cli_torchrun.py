"""`multihead heads circuit` under torchrun: two CPU ranks (gloo on 127.0.0.1, a free port) give what one
process gives, rank 0 alone prints and writes, and the world finishes within a bound.

The model is a tiny float32 Llama saved to a folder with a word-level tokenizer that knows the IOI
prompts' words (built here from the templates, names, places and objects), so the command runs its
real path: load the folder, draw the prompts, score, patch, report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_helpers
from multihead.cli import main
from multihead.heads import tasks

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORLD_TIMEOUT = 180  # seconds the launcher and its two ranks may run before the test fails (a hang fails here)
SRC = str(Path(__file__).resolve().parent.parent / "src")


def word_tokenizer():
    """A byte-level word tokenizer whose vocabulary is every word of the IOI prompts (one token each)."""
    from tokenizers import decoders, models, pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = {"<unk>": 0}
    fills = [dict(A=" " + n, B=" " + n, PLACE=p, OBJECT=o) for n in tasks.IOI_NAMES[:10]
             for p, o in zip(tasks.IOI_PLACES, tasks.IOI_OBJECTS)]
    for template in tasks.IOI_TEMPLATES:
        for fill in fills:
            for piece, _ in pre.pre_tokenize_str(template.format(**fill)):
                words.setdefault(piece, len(words))
    tk = tokenizers.Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer, tk.decoder = pre, decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("ioi-llama")
    tok = word_tokenizer()
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, vocab_size=len(tok),
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _args(folder, *extra) -> list[str]:
    return ["heads", "circuit", "--model", str(folder), "--n", "5", "--method", "eap-ig", "--steps", "2", "--top",
            "8", "--threads", "1", "--json", *extra]


def test_two_ranks_under_torchrun_give_one_process_result(folder, tmp_path, capsys):
    assert main(_args(folder)) == 0
    one = json.loads(capsys.readouterr().out)
    png = tmp_path / "circuit.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(dist_helpers.free_port()), "-m", "--", "multihead",
                *_args(folder, "--png", str(png))]
    proc = subprocess.Popen(launcher, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=WORLD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"two ranks did not finish within {WORLD_TIMEOUT} s:\n{err[-3000:]}")
    assert proc.returncode == 0, "\n".join(line for line in err.splitlines() if "Warning" not in line)[-6000:]
    many = json.loads(out)  # one JSON document: rank 1 printed nothing
    assert many["processes"] == 2 and one["processes"] == 1
    assert png.read_bytes()[:4] == b"\x89PNG" and many["png"] == str(png)
    assert many["n"] == one["n"] == 5 and many["edges_total"] == one["edges_total"]
    # float32, rows summed in another grouping (one chunk alone, a chunk per rank): equal to rounding
    a = {t["edge"]: t["score"] for t in one["top"]}
    b = {t["edge"]: t["score"] for t in many["top"]}
    scale = max(abs(v) for v in a.values())
    assert set(a) == set(b) and all(abs(a[e] - b[e]) <= 1e-4 * scale for e in a), (a, b)
    for key in ("metric_clean", "metric_corrupted", "cpr", "cmd"):
        assert many["curve"][key] == pytest.approx(one["curve"][key], rel=1e-4, abs=1e-6), key
    assert many["curve"]["edges_kept"] == one["curve"]["edges_kept"]


def test_world_size_without_torchrun_is_refused(folder, monkeypatch, capsys):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(_args(folder)) == 2
    assert "WORLD_SIZE is 2 but MASTER_ADDR, MASTER_PORT, RANK is not set: run the command under torchrun" in \
        capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert main(_args(folder)) == 2
    assert "WORLD_SIZE must be the number of processes (torchrun sets it); received 'two'" in capsys.readouterr().err

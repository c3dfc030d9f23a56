"""Text to ids as the model's tokenizer reads it (`multihead.tokens`), and the tasks'
and CLIs' refusals of ids that are not the model's: an --answer the tokenizer reads as its
unknown token, a tokenizer whose ids exceed the model's vocabulary, an IOI prompt made of
unknown tokens, induction ids that are not token ids.

Fast: a word-level tokenizer (made here with `tokenizers`) over a tiny random Llama; one
tokenizer adds a BOS and one does not, so `prefix` and the tasks are checked both ways."""

from __future__ import annotations

import json

import pytest
import torch

from multihead.cli import main

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = ["[UNK]", "[PAD]", "<bos>", "Mary", "John", "Anna", "Tom", "and", "went", "to", "the", "store", ",",
         "gave", "a", "drink", "."]


def _tokenizer(words=WORDS, bos: bool = True):
    """A word-level tokenizer over `words`; with `bos`, it puts <bos> before every text (as Gemma's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                bos_token="<bos>")


def _folder(tmp_path, tokenizer, vocab_size: int):
    import multihead.interop.hf  # noqa: F401

    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, vocab_size=vocab_size,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_prefix_is_what_the_tokenizer_puts_before_a_text():
    from multihead.tokens import pieces, prefix

    with_bos, without = _tokenizer(), _tokenizer(bos=False)
    assert prefix(with_bos) == [2] and with_bos("Mary went")["input_ids"] == [2, 3, 8]
    assert prefix(without) == [] and without.bos_token_id == 2  # a bos_token defined but not added
    assert pieces(with_bos, "Mary went") == [3, 8]


@pytest.mark.parametrize("bos", [True, False])
def test_tasks_start_every_sequence_with_the_tokenizers_own_prefix(bos):
    from multihead.heads import tasks

    tok = _tokenizer(WORDS + ["Then", "had", "fun", "at", "lot", "of"], bos=bos)
    ind = tasks.induction(3, 5, vocab=tok)
    assert ind.offset == int(bos) and ind.clean.shape == (3, 10 + int(bos))
    if bos:
        assert (ind.clean[:, 0] == 2).all() and (ind.corrupted[:, 0] == 2).all() and (ind.reference[:, 0] == 2).all()
    assert not (ind.clean[:, int(bos):] == 2).any()  # the <bos> is never drawn as an ordinary token
    assert tasks.induction(3, 5, vocab=tok, bos=None).offset == 0
    assert tasks.induction(3, 5, vocab=50).offset == 0  # plain ids: no tokenizer, no prefix


def test_induction_refuses_ids_that_are_not_token_ids():
    from multihead.heads import tasks

    with pytest.raises(TypeError, match="integers; received 1.5"):
        tasks.induction(2, 3, vocab=[1.5, 3.7])
    with pytest.raises(TypeError, match="integers; received 1.0"):
        tasks.induction(2, 3, vocab=torch.tensor([1.0, 3.0]))
    with pytest.raises(TypeError, match="integers; received True"):
        tasks.induction(2, 3, vocab=[True, 3])
    with pytest.raises(ValueError, match=">= 0; received -4"):
        tasks.induction(2, 3, vocab=[-4, 3, 5])
    for bad in (2.5, True, "2"):
        with pytest.raises(TypeError, match="bos must be a token id"):
            tasks.induction(2, 3, vocab=10, bos=bad)
    for bad in (-1, 10):
        with pytest.raises(ValueError, match=r"bos must be a token id \(0 to 9\)"):
            tasks.induction(2, 3, vocab=10, bos=bad)
    assert tasks.induction(2, 3, vocab=10, bos=9).clean[:, 0].tolist() == [9, 9]
    with pytest.raises(ValueError, match="n must be between 1 and 100,000"):
        tasks.induction(10**12, 3, vocab=10)
    with pytest.raises(TypeError, match="seed must be an int, or None"):
        tasks.induction(2, 3, vocab=10, seed=1.5)


def test_induction_takes_numpy_ints_ranges_and_sets_as_ids():
    """NumPy integers are token ids (bos, vocab); a range, a set or an array of ids is a vocab,
    not a tokenizer; NumPy floats and bools are refused as Python's are."""
    import numpy as np

    from multihead.heads import tasks

    task = tasks.induction(3, 4, vocab=np.int64(10), bos=np.int64(2), seed=1)
    assert (task.clean[:, 0] == 2).all() and task.clean[:, 1:].max() < 10
    for vocab in (range(5, 10), {5, 6, 7, 8, 9}, np.arange(5, 10), torch.arange(5, 10)):
        drawn = tasks.induction(3, 4, vocab=vocab, bos=None, seed=1).clean
        assert set(drawn.flatten().tolist()) <= set(range(5, 10)), vocab
    with pytest.raises(TypeError, match="integers; received 1.5"):
        tasks.induction(2, 3, vocab=np.array([1.5, 2.5]))
    with pytest.raises(TypeError, match="bos must be a token id"):
        tasks.induction(2, 3, vocab=10, bos=np.bool_(True))
    with pytest.raises(ValueError, match=r"bos must be a token id \(0 to 9\)"):
        tasks.induction(2, 3, vocab=np.int64(10), bos=np.int64(10))


def test_prefix_names_what_is_no_tokenizer():
    from multihead.tokens import prefix

    for bad in (None, "gpt2"):
        with pytest.raises(TypeError, match=f"prefix reads a Hugging Face tokenizer; received {type(bad).__name__}"):
            prefix(bad)


def test_seed_none_is_a_fresh_draw_in_both_tasks():
    from multihead.heads import tasks

    tok = _tokenizer(WORDS + ["Then", "had", "fun", "at", "lot", "of"])
    draws = [tasks.induction(4, 30, seed=None, vocab=1000).clean for _ in range(2)]
    assert draws[0].shape == (4, 60) and not torch.equal(draws[0], draws[1])
    assert torch.equal(tasks.induction(4, 30, seed=7, vocab=1000).clean, tasks.induction(4, 30, seed=7,
                                                                                         vocab=1000).clean)
    with pytest.raises(ValueError, match="unknown token"):  # None is accepted: the refusal is the prompts'
        tasks.ioi(2, seed=None, tokenizer=tok)


def test_ioi_refuses_a_tokenizer_that_reads_its_prompts_as_unknown_tokens():
    from multihead.heads import tasks

    names_only = _tokenizer(["[UNK]", "[PAD]", "<bos>", "Mary", "John", "Anna", "Tom", "Sarah"])
    with pytest.raises(ValueError, match=r"reads \d+ of the \d+ tokens of the IOI prompt .* unknown token '\[UNK\]'"):
        tasks.ioi(2, tokenizer=names_only)
    with pytest.raises(ValueError, match="n .the number of pairs. must be between 1 and 100,000; received "
                                         "1000000000000"):
        tasks.ioi(10**12, tokenizer=names_only)


def _heads(capsys, *argv):
    capsys.readouterr()  # what saving the folder wrote (a progress bar) is not the command's
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    return code, out, err


PAIR = ["--clean", "Mary and John went to the store , John gave a drink to", "--corrupted",
        "Mary and John went to the store , Mary gave a drink to"]


@pytest.mark.parametrize("command", ["scan", "path"])
def test_an_answer_read_as_the_unknown_token_is_refused_by_scan_and_path(capsys, tmp_path, command):
    folder = _folder(tmp_path, _tokenizer(), len(WORDS))
    extra = ["--receivers", "logits"] if command == "path" else []
    code, out, err = _heads(capsys, command, "--model", str(folder), *PAIR, "--answer", "Zed", "--wrong", "John",
                            *extra)
    assert code == 2, (out, err)
    assert "--answer 'Zed' is not in this model's vocabulary" in err and len(err.strip().splitlines()) == 1, err
    code, out, err = _heads(capsys, command, "--model", str(folder), *PAIR, "--answer", "Mary", "--wrong", "John",
                            *extra, "--json")
    assert code == 0, err
    assert json.loads(out)["metric_clean"] is not None


@pytest.mark.parametrize("argv", [
    ["scan", *PAIR, "--answer", "Mary", "--wrong", "John"],
    ["path", *PAIR, "--answer", "Mary", "--wrong", "John", "--receivers", "logits"],
    ["induction", "--n", "2", "--length", "4"],
    ["scan", "--task", "induction", "--n", "2", "--length", "4"],
])
def test_a_tokenizer_with_ids_beyond_the_models_vocabulary_is_one_line_exit_2(capsys, tmp_path, argv):
    folder = _folder(tmp_path, _tokenizer(), 3)  # the model knows ids 0-2; the tokenizer has 17
    code, out, err = _heads(capsys, argv[0], "--model", str(folder), *argv[1:])
    assert code == 2, (out, err)
    assert "the model's vocabulary has 3 ids (0-2)" in err and "does not belong to this model" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_windows_cut_from_a_stream_begin_as_a_text_does():
    from multihead.tokens import windows

    body = torch.arange(100, 200)
    assert windows([2], body, [0, 10], 5).tolist() == [[2, 100, 101, 102, 103], [2, 110, 111, 112, 113]]
    assert windows([], body, [0, 95], 5).tolist() == [[100, 101, 102, 103, 104], [195, 196, 197, 198, 199]]
    # the prune curve's and lab uptrain's windows on the real models: tests/test_gemma3_tokens.py

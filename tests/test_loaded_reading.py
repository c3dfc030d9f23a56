"""What the head tools' commands read through a loaded model (`multihead.interop.loaded`),
whatever its source: its inputs for a text, the token after a text, its logits, the last
real position, the ids before every text, what random tokens are drawn from, and whether
it predicts the next token. Each is checked against the tokenizer or model it wraps, read
directly, for a transformers LM (a word-level tokenizer over a tiny random Llama, with a
BOS and an EOS it adds to every text) and for a `multihead lab` checkpoint."""

from __future__ import annotations

import pytest
import torch

from multihead.interop.loaded import ModelError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = ["[UNK]", "[PAD]", "<bos>", "</s>", "Mary", "John", "went", "to", "the", "store"]


def _tokenizer(bos: bool = True, eos: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    single = " ".join(["<bos>"] * bos + ["$A"] + ["</s>"] * eos)
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<bos>", 2), ("</s>", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                bos_token="<bos>", eos_token="</s>")


def _hf(bos: bool = True, eos: bool = False):
    from multihead.interop.loaded import HFModel

    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, vocab_size=len(WORDS),
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=32)
    torch.manual_seed(0)
    return HFModel(transformers.LlamaForCausalLM(cfg), _tokenizer(bos, eos), name="tiny-llama")


def _lab():
    from multihead.checkpoint import Vocab
    from multihead.decoder import LabConfig, LabTransformer
    from multihead.interop.loaders import LabModel

    torch.manual_seed(0)
    model = LabTransformer(LabConfig(vocab_size=3, max_len=8, d_model=8, n_heads=2)).eval()
    return LabModel(model, Vocab("char", ("a", "b", "c")), name="lab")


def test_a_transformers_lm_reads_text_as_its_tokenizer_does():
    lm = _hf(bos=True, eos=True)
    enc = lm.inputs("Mary went to the store")
    # the tokenizer's own ids: <bos> first, </s> last
    want = lm.tokenizer("Mary went to the store")["input_ids"]
    assert lm.input_ids(enc).tolist() == [want] and want == [2, 4, 6, 7, 8, 9, 3]
    assert enc["attention_mask"].tolist() == [[1] * 7]
    # the answer is read at the last word, not at </s> (position 6)
    assert lm.last_real_position([2, 4, 6, 7, 8, 9, 3]) == 5
    assert lm.last_real_position([3, 3]) == 1  # nothing but special tokens: the last position
    assert lm.prefix_ids() == [2] and _hf(bos=False).prefix_ids() == []
    assert lm.token_after("Mary went to the", "store") == (9, "store")
    with pytest.raises(ValueError, match="--wrong 'Anna' is not in this model's vocabulary"):
        lm.token_after("Mary went to the", "Anna", "--wrong")
    assert lm.token_source is lm.tokenizer and lm.word_tokenizer("--task ioi") is lm.tokenizer
    assert lm.why_not_lm() is None


def test_a_transformers_lm_forward_is_its_own_logits():
    lm = _hf()
    enc = lm.inputs("John went to the store")
    with torch.no_grad():
        want = lm.model(**enc).logits
        assert torch.equal(lm.forward(enc), want)
        assert torch.equal(lm.forward(lm.input_ids(enc)), want)  # ids alone: no mask, the same for one text
        assert torch.equal(lm.logits(lm.model(**enc)), want)
    with pytest.raises(ModelError, match=r"the model's output \(dict\) holds no logits"):
        lm.logits({"hidden": want})


def test_a_lab_checkpoint_reads_its_plain_vocabulary():
    lab = _lab()
    ids = lab.inputs("abca")
    assert ids.tolist() == [[0, 1, 2, 0]] and lab.input_ids(ids) is ids
    assert lab.last_real_position([0, 1, 2, 0]) == 3 and lab.prefix_ids() == []
    assert lab.token_after("ab", "c") == (2, "c")
    with pytest.raises(ValueError, match="--answer 'ab' is 2 tokens for this model; give one token"):
        lab.token_after("ab", "ab")
    assert lab.token_source == 3 and lab.random_tokens == "uniform over the vocabulary"
    with pytest.raises(ModelError, match="--task ioi needs a model with a word-level tokenizer"):
        lab.word_tokenizer("--task ioi")
    assert lab.why_not_lm() is None
    with torch.no_grad():
        assert torch.equal(lab.forward(ids), lab.model(ids))


def test_an_encoder_is_not_a_language_model():
    from multihead.interop.loaded import HFModel

    cfg = transformers.BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  vocab_size=len(WORDS), max_position_embeddings=32)
    torch.manual_seed(0)
    bert = HFModel(transformers.BertModel(cfg), _tokenizer(), name="tiny-bert")
    assert bert.why_not_lm() == "has no language-model head"
    masked = HFModel(transformers.BertForMaskedLM(cfg), _tokenizer(), name="tiny-bert-mlm")
    assert masked.why_not_lm() == "is a bidirectional encoder"


def test_heads_scan_names_the_tokens_where_a_lab_models_texts_part(tmp_path, capsys):
    """The one reading serves every model: a lab checkpoint's unequal --clean/--corrupted are
    refused with the tokens where they part, as a transformers model's are."""
    from multihead.checkpoint import save_lab_checkpoint
    from multihead.cli import main

    lab = _lab()
    save_lab_checkpoint(tmp_path / "lab", lab.model, lab.vocab, experiment="heads")
    argv = ["heads", "scan", "--model", str(tmp_path / "lab"), "--answer", "a", "--wrong", "b"]
    assert main([*argv, "--clean", "ab", "--corrupted", "abc"]) == 2
    err = capsys.readouterr().err
    assert "--clean is 2 tokens and --corrupted 3 tokens" in err
    assert "--corrupted goes on after token 1 with ['c']" in err
    assert main([*argv, "--clean", "abc", "--corrupted", "abb"]) == 0  # the same length: scanned
    out = capsys.readouterr().out
    assert "patching z from clean into corrupted" in out
    assert main([*argv, "--clean", "abc", "--corrupted", "ab"]) == 2
    assert "--clean goes on after token 1 with ['c']" in capsys.readouterr().err

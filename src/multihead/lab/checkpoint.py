"""Lab checkpoints (a folder with `model.safetensors` and a `config.json`): the format
lives in `multihead.checkpoint`, one floor below the tools, so inspect and heads open a
checkpoint without importing lab; its names are re-exported here."""

from multihead.checkpoint import Vocab, is_lab_checkpoint, load_lab_checkpoint, save_lab_checkpoint

__all__ = ["Vocab", "is_lab_checkpoint", "load_lab_checkpoint", "save_lab_checkpoint"]

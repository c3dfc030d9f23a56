"""The small transformers the experiments train: `multihead.decoder` (one floor below the
tools, so inspect and heads open lab checkpoints without importing lab), re-exported here."""

from multihead.decoder import Block, LabConfig, LabTransformer, make_attention

__all__ = ["Block", "LabConfig", "LabTransformer", "make_attention"]

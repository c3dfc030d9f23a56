"""The data that flows through `multihead.inspect`: what was captured from a model.

`capture()` produces an `AttentionCapture`; `head_roles()` scores it; `render_html()`
and the PNG writers draw it. Kept in its own small module so the views can be built and
tested on synthetic captures without loading a model. The floor under the views: it
imports none of them (a notebook's `_repr_html_` reaches its page through the package).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(repr=False)
class AttentionCapture:
    """Per-head attention weights of one text through one model.

    Attributes:
        tokens: the T token strings as the tokenizer split them (special tokens included).
        token_ids: the T token ids.
        layers: the captured layer indices (into the model's layers).
        heads: the captured head indices (the same for every captured layer).
        weights: float32 `(len(layers), len(heads), T, T)`: weights[i, j, t, s] is how much
            token t attends to token s in layer layers[i], head heads[j]. Rows sum to 1.
        n_layers, n_heads: the model's full geometry (for labels and range checks).
        model: a short name or path of the model.
        meta: anything else worth showing (truncation notes, model type, ...).
    """

    tokens: list[str]
    token_ids: list[int]
    layers: list[int]
    heads: list[int]
    weights: torch.Tensor
    n_layers: int
    n_heads: int
    model: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        L, H, T, S = self.weights.shape
        assert (L, H) == (len(self.layers), len(self.heads)), "weights do not match layers/heads"
        assert T == S == len(self.tokens), "weights do not match the tokens"

    def __repr__(self) -> str:
        """A few lines, never the weights: model, tokens, what was captured, the tensor's shape."""
        T = len(self.tokens)
        shown = " ".join(str(t) for t in self.tokens[:8]) + (" ..." if T > 8 else "")
        every = len(self.layers) == self.n_layers and len(self.heads) == self.n_heads
        what = ("every head" if every else
                f"layers {_spans(self.layers)} x heads {_spans(self.heads)}")
        return (f"AttentionCapture(model={self.model!r}, {T} tokens: {shown!r},\n"
                f"  {self.n_layers} layers x {self.n_heads} heads; captured {what}: weights "
                f"{tuple(self.weights.shape)} {str(self.weights.dtype).removeprefix('torch.')}"
                f"{', meta: ' + ', '.join(map(str, self.meta)) if self.meta else ''})")

    def _repr_html_(self) -> str:
        """Jupyter shows a capture as its head view: the page of `render_html` (roles from
        `head_roles`) in a sandboxed iframe, self-contained and offline like the file.

        The page is drawn by `multihead.inspect.notebook_html`, looked up on use through the
        package's public names: the view modules (html, roles) read these types, so this
        module names none of them (no circle between the files)."""
        from multihead.inspect import notebook_html

        return notebook_html(self)

    def head(self, layer: int, head: int) -> torch.Tensor:
        """The `(T, T)` weights of one captured (layer, head), by model indices."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} was not captured; captured: {self.layers}")
        if head not in self.heads:
            raise ValueError(f"head {head} was not captured; captured: {self.heads}")
        return self.weights[self.layers.index(layer), self.heads.index(head)]


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> '0-3,7' (what --only-heads accepts)."""
    out, i = [], 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        out.append(str(indices[i]) if i == j else f"{indices[i]}-{indices[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True)
class HeadRole:
    """The role scores of one head: each in [0, 1] unless said otherwise."""

    layer: int
    head: int
    scores: dict  # role name -> score
    role: str  # the label, chosen by the documented rules and guards
    score: float  # its score
    runner_up: str = ""  # the next eligible role ("" if none), so a close call shows
    runner_up_score: float = 0.0

    def __repr__(self) -> str:
        second = (f", runner_up={self.runner_up!r}, runner_up_score={self.runner_up_score:.4g}"
                  if self.runner_up else "")
        return (f"HeadRole(layer={self.layer}, head={self.head}, role={self.role!r}, score={self.score:.4g}"
                f"{second}, scores={{{len(self.scores)} roles}})")

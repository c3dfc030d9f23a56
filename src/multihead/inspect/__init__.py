"""See what every head of a real model does: capture per-head weights, score head roles,
draw them (self-contained HTML, PNG). Heavy imports (transformers, matplotlib) happen
inside the functions that need them."""

from multihead.inspect.capture_types import AttentionCapture, HeadRole

__all__ = ["AttentionCapture", "HeadRole"]

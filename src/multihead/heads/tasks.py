"""The tasks `multihead heads` measures heads with, on the bundled King James Bible.

- Sentence encoders (the bundled MiniLM, any encoder without an LM head): *verse-half
  retrieval*. Verses (lines of at least 8 words, every 37th, spread over the book) are cut
  in two at their middle word; a half is embedded as the mean of the last hidden states over its real
  tokens, L2-normalized. The loss is InfoNCE (van den Oord et al., 2018): cross-entropy of
  the first halves' cosine similarities to every second half in the batch, temperature
  0.05, the right partner being the target; accuracy is top-1 retrieval of the partner
  among 32 second halves (held-out verses, 32 at a time). It asks what a sentence embedding is for: that related
  text lands close.
- Causal language models (lab checkpoints, HF causal LMs): next-token cross-entropy and
  top-1 accuracy on the verses.

`logits(model, out)` is what a scan's logit difference reads: the output's `.logits`,
else (a base model) the last hidden states times the input embeddings (the tied
unembedding; for a sentence encoder, a token-similarity read-out rather than a
trained head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.corpus import load_corpus

TEMPERATURE = 0.05
POOL = 32  # candidates per retrieval


def kjv_verses(n: int, start: int = 0, min_words: int = 8, path: str | None = None, stride: int = 1) -> list[str]:
    """n verses (lines of >= min_words words): every `stride`-th from the `start`-th on, of the
    bundled KJV or a UTF-8 file (a stride spreads them over the book: neighbouring verses,
    a genealogy's, are too alike to tell apart)."""
    text, _ = load_corpus(path)  # refuses a device or pipe (/dev/zero would be read forever)
    out = []
    lines = [line.strip() for line in text.splitlines() if len(line.split()) >= min_words]
    stride = max(1, min(stride, len(lines) // max(1, n)))  # a short corpus: as spread as it allows
    for line in lines[start::stride]:
        out.append(line)
        if len(out) == n:
            break
    if len(out) < 2:
        raise ValueError(f"the corpus has {len(out)} lines of {min_words}+ words from line {start}; need at least 2")
    return out


def halves(verses: list[str]) -> tuple[list[str], list[str]]:
    a, b = [], []
    for v in verses:
        w = v.split()
        a.append(" ".join(w[:len(w) // 2]))
        b.append(" ".join(w[len(w) // 2:]))
    return a, b


def embed(model, tokenizer, texts: list[str], max_length: int = 64) -> Tensor:
    """Mean-pooled, L2-normalized last hidden states `(N, C)` (sentence-transformers' recipe)."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    out = model(**enc)
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # (N, T, C)
    keep = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
    return F.normalize((h * keep).sum(1) / keep.sum(1).clamp_min(1), dim=-1)


def contrastive_loss(model, tokenizer, verses: list[str]) -> Tensor:
    """InfoNCE of first halves against the batch's second halves (temperature 0.05)."""
    a, b = halves(verses)
    sim = embed(model, tokenizer, a) @ embed(model, tokenizer, b).T / TEMPERATURE  # (N, N)
    return F.cross_entropy(sim, torch.arange(len(verses)))


def retrieval_accuracy(model, tokenizer, verses: list[str], pool: int = POOL) -> float:
    """Top-1 accuracy of finding each first half's second half among the `pool` second halves
    of its group (the verses taken `pool` at a time; a last short group is left out)."""
    a, b = halves(verses)
    pool = min(pool, len(verses))
    hits = []
    with torch.no_grad():
        ea, eb = embed(model, tokenizer, a), embed(model, tokenizer, b)
    for s in range(0, len(verses) - pool + 1, pool):
        sim = ea[s:s + pool] @ eb[s:s + pool].T
        hits.append(sim.argmax(1) == torch.arange(pool))
    return torch.cat(hits).float().mean().item()


def logits(model, out) -> Tensor:
    """A run's logits; a base model's: last hidden states @ input embeddings^T."""
    if isinstance(out, Tensor):
        return out
    lg = getattr(out, "logits", None)
    if isinstance(lg, Tensor):
        return lg
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h @ model.get_input_embeddings().weight.T


def next_token_loss(logits_: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits_[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

"""Head roles: what each captured head attends to, as scores in [0, 1].

Each role is a mean of attention mass on the keys it names (previous, next, current
and first token, delimiters: Clark et al., 2019; Xiao et al., 2023), TransformerLens'
duplicate-token and induction patterns, Olsson et al.'s (2022) prefix matching, and the
normalised entropy; `head_roles` ranks heads by them.

Details: docs/inspect.md, "Head roles: the formulas and the ranking".
"""

from __future__ import annotations

import string

import torch
from torch import Tensor

from multihead.checks import check_int
from multihead.inspect.capture_types import AttentionCapture, HeadRole
from multihead.inspect.rowstats import RowSums, TextContext, duplicate_token_block, induction_block

__all__ = [
    "ROLES",
    "attention_entropy",
    "capture_statistics",
    "delimiter_positions",
    "duplicate_token_pattern",
    "head_roles",
    "induction_pattern",
    "induction_scores",
    "mul_score",
    "previous_token_pattern",
    "role_scores",
    "text_context",
    "transformer_lens_scores",
]

ROLES = ("previous_token", "next_token", "current_token", "first_token", "delimiter", "duplicate_token",
         "induction", "prefix_matching")
MIN_SCORE = 0.4
BROAD_ENTROPY = 0.75
MIN_MATCH_ROWS = 2
MIN_PREFIX = 0.1
TL_SCORES = {"previous_token_head": "tl_previous_token", "duplicate_token_head": "tl_duplicate_token",
             "induction_head": "tl_induction"}
_PUNCT = set(string.punctuation) | set("«»“”‘’„…–—·")
_PIECE_MARKERS = ("##", "\u0120", "\u2581", "\u010a")  # WordPiece, GPT-2 space/newline, SentencePiece


# --------------------------------------------------------------------- patterns


def previous_token_pattern(T: int) -> Tensor:
    """TransformerLens' previous-token pattern `(T, T)`: 1 at [i, i-1] for i >= 1."""
    pattern = torch.zeros(T, T)
    if T > 1:
        pattern[1:, :-1] = torch.eye(T - 1)
    return pattern


def duplicate_token_pattern(ids: Tensor, causal: bool = True) -> Tensor:
    """TransformerLens' duplicate-token pattern `(T, T)`: 1 where ids[j] == ids[i], j != i,
    j < i (also j > i when not causal). The definition: `rowstats.duplicate_token_block`."""
    ids = torch.as_tensor(ids).reshape(-1)
    T = ids.shape[0]
    return duplicate_token_block(ids, 0, T, 0, T, causal).float()


def induction_pattern(ids: Tensor) -> Tensor:
    """TransformerLens' induction pattern `(T, T)`: 1 where ids[j-1] == ids[i], j-1 != i,
    1 <= j <= i (the duplicate pattern shifted one key to the right, lower triangle).
    The definition: `rowstats.induction_block`."""
    ids = torch.as_tensor(ids).reshape(-1)
    T = ids.shape[0]
    return induction_block(ids, 0, T, 0, T).float()


def mul_score(weights: Tensor, pattern: Tensor, *, exclude_bos: bool = True,
              exclude_current: bool = True) -> Tensor | None:
    """TransformerLens' "mul" score over the rows where `pattern` has a 1.

    weights `(..., T, T)`, pattern `(T, T)` of 0/1. Returns `(...)`, or None when no row
    of the pattern has a 1.
    """
    rows = pattern.bool().any(dim=-1)  # (T,)
    if not bool(rows.any()):
        return None
    a = weights.clone()
    if exclude_bos:
        a[..., :, 0] = 0
    if exclude_current:
        a.diagonal(dim1=-2, dim2=-1).zero_()
    a = a[..., rows, :]
    p = pattern[rows].to(a.dtype)
    den = a.sum(dim=(-2, -1))
    num = (a * p).sum(dim=(-2, -1))
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(den))


def _strip_piece(token: str) -> str:
    for marker in _PIECE_MARKERS:
        token = token.replace(marker, "")
    return token.strip()


def delimiter_positions(tokens: list[str], special_tokens=()) -> list[int]:
    """Positions j >= 1 whose token is special ([SEP], </s>, ...) or punctuation only."""
    special = set(special_tokens)
    out = []
    for j, tok in enumerate(tokens):
        if j == 0:
            continue
        core = _strip_piece(tok)
        if tok in special or (core and all(ch in _PUNCT for ch in core)):
            out.append(j)
    return out


def _is_causal(capture: AttentionCapture) -> bool:
    if "causal" in capture.meta:
        return bool(capture.meta["causal"])
    T = capture.weights.shape[-1]
    return T > 1 and bool((capture.weights.triu(1) == 0).all())


def attention_entropy(weights: Tensor, causal: bool) -> Tensor:
    """Mean normalised row entropy of weights `(..., T, T)` -> `(...)` in [0, 1]
    (`rowstats`' normalized_entropy)."""
    T = weights.shape[-1]
    lead = weights.shape[:-2]
    W = weights.reshape(-1, T, T)
    ctx = TextContext(ids=torch.zeros(T, dtype=torch.long), plain=torch.ones(T, dtype=torch.bool),
                      delimiter=torch.zeros(T, dtype=torch.bool), causal=bool(causal))
    acc = RowSums(W.shape[0], ctx)
    step = max(1, (1 << 23) // max(1, W.shape[0] * T))
    for t0 in range(0, T, step):
        acc.add(W[:, t0:t0 + step], t0)
    return acc.result()["normalized_entropy"].reshape(lead)


def text_context(tokens: list[str], token_ids, special_tokens=(), causal: bool = True) -> TextContext:
    """The `TextContext` the row statistics read: ids, plain tokens (a special token repeated,
    [SEP] ... [SEP], is structure, not a duplicate) and delimiter positions."""
    special = set(special_tokens)
    T = len(token_ids)
    delim = torch.zeros(T, dtype=torch.bool)
    delim[delimiter_positions(tokens, special_tokens)] = True
    return TextContext(ids=torch.as_tensor(list(token_ids), dtype=torch.long),
                       plain=torch.tensor([tok not in special for tok in tokens], dtype=torch.bool),
                       delimiter=delim, causal=bool(causal))


def _context(capture: AttentionCapture) -> TextContext:
    return text_context(capture.tokens, capture.token_ids, capture.meta.get("special_tokens", ()),
                        _is_causal(capture))


# --------------------------------------------------------------------- scores


ROLE_STATISTICS = ("previous_token", "next_token", "current_token", "first_token", "delimiter", "duplicate_token",
                   "induction")


def capture_statistics(capture: AttentionCapture, *, transformer_lens: bool = False) -> dict[str, Tensor]:
    """Every `rowstats` statistic of every captured head, `(len(layers), len(heads))` each,
    from the capture's weights, a block of rows at a time (as `summaries` does beside the
    kernel)."""
    W = capture.weights  # (L, h, T, T)
    L, h, T, S = W.shape
    ctx = _context(capture)
    step = max(1, (1 << 23) // max(1, h * S))
    per_layer = []
    for li in range(L):
        acc = RowSums(h, ctx, S, transformer_lens=transformer_lens)
        for t0 in range(0, T, step):
            acc.add(W[li, :, t0:t0 + step], t0)
        per_layer.append(acc.result())
    return {name: torch.stack([d[name] for d in per_layer]) for name in per_layer[0]}


def role_scores(capture: AttentionCapture) -> dict[str, Tensor]:
    """Each role's score for every captured head: {role: `(len(layers), len(heads))`}.

    Roles that the text cannot show (no delimiter, no repeated token) are absent.
    Formulas and sources: docs/inspect.md; computed by `rowstats.RowSums`.
    """
    return _role_view(capture_statistics(capture))


def _role_view(stats: dict[str, Tensor]) -> dict[str, Tensor]:
    """The role scores among the statistics, under their role names ("entropy" is the normalised one)."""
    out = {name: stats[name] for name in ROLE_STATISTICS if name in stats}
    out["entropy"] = stats["normalized_entropy"]
    return out


def _match_rows(capture: AttentionCapture) -> dict[str, int]:
    """Query rows with a match in the duplicate-token and induction patterns (as scored)."""
    return _context(capture).match_rows()


def transformer_lens_scores(capture: AttentionCapture, *, exclude_bos: bool = False,
                            exclude_current_token: bool = False) -> dict[str, Tensor]:
    """TransformerLens' head-detector scores of every captured head, `(len(layers), len(heads))`
    per detector: {"previous_token_head", "duplicate_token_head", "induction_head"}.

    As `transformer_lens.head_detector.detect_head(model, text, name)` computes them with its
    defaults: the detection pattern of the token ids (all tokens, BOS / [CLS] included),
    and the "mul" score sum(A' * P) / sum(A') over every row, A' = A with the BOS column
    and the diagonal zeroed only when `exclude_bos` / `exclude_current_token` are set.
    Where that is 0 / 0 (a head whose every weight was excluded) the score is 0, not NaN.
    """
    if not isinstance(capture, AttentionCapture):
        raise TypeError(f"transformer_lens_scores takes an AttentionCapture; received {type(capture).__name__}")
    W = capture.weights.double().clone()  # (L, h, T, T)
    T = W.shape[-1]
    ids = torch.tensor(capture.token_ids)
    patterns = {
        "previous_token_head": previous_token_pattern(T),
        "duplicate_token_head": duplicate_token_pattern(ids, causal=True),
        "induction_head": induction_pattern(ids),
    }
    if exclude_bos:
        W[..., :, 0] = 0
    if exclude_current_token:
        W.diagonal(dim1=-2, dim2=-1).zero_()
    den = W.sum(dim=(-2, -1))  # (L, h)
    out = {}
    for name, pattern in patterns.items():
        num = (W * pattern.double()).sum(dim=(-2, -1))
        out[name] = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(den)).float()
    return out


def head_roles(capture, *, prefix_matching: Tensor | None = None,
               min_score: float = MIN_SCORE, transformer_lens: bool = False) -> list[HeadRole]:
    """The ranked role table: one `HeadRole` per captured head, highest score first.

    Args:
        capture: an `AttentionCapture` (from `multihead.inspect.capture`) or a
            `HeadSummaries` (from `multihead.inspect.summaries`, any length): the scores
            are the same `rowstats` sums either way.
        prefix_matching: optional `(n_layers, n_heads)` scores from `induction_scores`
            (indexed by model layer and head), added as the "prefix_matching" role.
        min_score: below it a head has no dominant role ("broad" or "mixed").
        transformer_lens: also report TransformerLens' head-detector scores (as
            `tl_previous_token`, `tl_duplicate_token`, `tl_induction`; see
            `transformer_lens_scores`). They are not used for the role. A `HeadSummaries`
            has them when it was made with `transformer_lens=True`.
    """
    if isinstance(capture, AttentionCapture):
        stats = capture_statistics(capture, transformer_lens=transformer_lens)
        rows = _match_rows(capture)
    elif hasattr(capture, "scores") and hasattr(capture, "match_rows") and hasattr(capture, "layers"):
        stats, rows = capture.scores, capture.match_rows
        if transformer_lens and not all(name in stats for name in TL_SCORES.values()):
            raise ValueError("these summaries have no TransformerLens scores; make them with "
                             "summaries(..., transformer_lens=True)")
    else:
        raise TypeError(f"head_roles takes an AttentionCapture or HeadSummaries; received {type(capture).__name__}")
    scores = _role_view(stats)
    if prefix_matching is not None:
        pm = torch.as_tensor(prefix_matching)
        if tuple(pm.shape) != (capture.n_layers, capture.n_heads):
            raise ValueError(f"prefix_matching must be (n_layers, n_heads) = ({capture.n_layers}, "
                             f"{capture.n_heads}); received {tuple(pm.shape)}")
        scores["prefix_matching"] = pm[capture.layers][:, capture.heads].float()
    ranked_roles = list(ROLES)
    for role in ("duplicate_token", "induction"):
        if rows[role] < MIN_MATCH_ROWS:
            ranked_roles.remove(role)
    extra = {name: stats[name] for name in TL_SCORES.values()} if transformer_lens else {}
    table = []
    for li, layer in enumerate(capture.layers):
        for hi, head in enumerate(capture.heads):
            s = {name: round(float(v[li, hi]), 4) for name, v in scores.items()}
            eligible = [r for r in ranked_roles if r in s]
            if "induction" in eligible and s.get("prefix_matching", 1.0) < MIN_PREFIX:
                eligible.remove("induction")
            ranked = sorted(((s[r], -ROLES.index(r), r) for r in eligible), reverse=True)
            ranked = _induction_first(ranked, min_score)
            best, _, role = ranked[0] if ranked else (0.0, 0, "mixed")
            second = ranked[1] if len(ranked) > 1 else None
            if best < min_score:
                second = ranked[0] if ranked else None  # the best role, below the bar
                if s["entropy"] >= BROAD_ENTROPY:
                    role, best = "broad", s["entropy"]
                else:
                    role = "mixed"
            s.update({name: round(float(v[li, hi]), 4) for name, v in extra.items()})
            table.append(HeadRole(layer=layer, head=head, scores=s, role=role, score=float(best),
                                  runner_up=second[2] if second else "",
                                  runner_up_score=float(second[0]) if second else 0.0))
    table.sort(key=lambda r: (-r.score, r.layer, r.head))
    return table


def _induction_first(ranked: list[tuple], min_score: float) -> list[tuple]:
    """Prefix matching on random tokens and induction on the text measure one mechanism
    (Olsson et al., 2022). When prefix matching scores highest and induction passed its
    guards (2 rows with a match, prefix_matching >= MIN_PREFIX) and reaches min_score, the
    label is induction, whichever of the two is higher on this text: otherwise one head
    would be called induction on one text and prefix_matching on the next."""
    if not ranked or ranked[0][2] != "prefix_matching":
        return ranked
    ind = next((x for x in ranked if x[2] == "induction"), None)
    if ind is None or ind[0] < min_score:
        return ranked
    return [ind, *[x for x in ranked if x is not ind]]


# ------------------------------------------------------------ prefix matching


def induction_scores(model="minilm", seq_len: int | None = None, seed: int = 0, batch: int = 4) -> Tensor:
    """Olsson et al.'s prefix-matching score of every head, `(n_layers, n_heads)`.

    Runs `batch` sequences of `seq_len` uniformly random ordinary tokens (distinct within
    a sequence where the vocabulary allows, so "the previous occurrence" is unique), each
    repeated twice and wrapped in the model's special tokens, and averages, over the second copy,
    the attention from each token to the token that followed its first occurrence.
    Random tokens leave no grammar to lean on: only a head that looks up "what came after
    this token last time" scores high. `model` is anything `capture` takes. Same seed,
    same tokens. seq_len defaults to 50, or less where the model's positions need it.
    """
    from multihead.inspect.capture import model_for_run
    from multihead.interop.loaders import InspectError

    with model_for_run(model) as lm:
        if seq_len is None:
            extra = len(lm.wrap([0, 0])[0]) - 2  # special tokens around a text
            room = None if lm.max_positions is None else (lm.max_positions - extra) // 2
            seq_len = 50 if room is None else max(2, min(50, room))
        for name, v, lo in (("seq_len", seq_len, 2), ("batch", batch, 1)):
            check_int(name, v, minimum=lo)
        gen = torch.Generator().manual_seed(int(seed))
        rows, offset = [], 0
        for _ in range(batch):
            r = _distinct(lm.random_ids((4 * seq_len,), gen).tolist(), seq_len)
            ids, offset = lm.wrap(r + r)
            rows.append(ids)
        total = len(rows[0])
        if lm.max_positions is not None and total > lm.max_positions:
            raise InspectError(f"seq_len {seq_len} gives {total} tokens, more than the model's {lm.max_positions} "
                               f"positions; use seq_len <= {(lm.max_positions - (total - 2 * seq_len)) // 2}")
        ids = torch.tensor(rows, dtype=torch.long)  # (B, T)
        heads = tuple(range(lm.n_heads))
        weights = lm.attention(ids, {layer: heads for layer in range(lm.n_layers)})
    k = torch.arange(seq_len)
    q_pos, k_pos = offset + seq_len + k, offset + k + 1
    out = torch.empty(lm.n_layers, lm.n_heads)
    for layer in range(lm.n_layers):
        w = weights[layer].float().cpu()  # (B, H, T, T)
        out[layer] = w[:, :, q_pos, k_pos].mean(dim=(0, 2))
    return out


def _distinct(draws: list[int], n: int) -> list[int]:
    """The first n distinct values of draws in order; the first n draws if too few differ."""
    seen: dict[int, None] = {}
    for t in draws:
        seen.setdefault(t, None)
        if len(seen) == n:
            return list(seen)
    return draws[:n]

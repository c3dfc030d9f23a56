"""Head-role scores: exact values on synthetic heads, TransformerLens' patterns and "mul"
score, Olsson et al.'s prefix matching, and the real model's previous-token head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multihead.inspect import AttentionCapture, head_roles
from multihead.inspect.capture import LoadedModel
from multihead.inspect.roles import (
    attention_entropy,
    delimiter_positions,
    duplicate_token_pattern,
    induction_pattern,
    induction_scores,
    mul_score,
    role_scores,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(weights: torch.Tensor, tokens: list[str], ids: list[int] | None = None, causal: bool = True,
         special=("[SEP]", "[CLS]")) -> AttentionCapture:
    L, H, T, _ = weights.shape
    return AttentionCapture(tokens=tokens, token_ids=ids or list(range(T)), layers=list(range(L)),
                            heads=list(range(H)), weights=weights.float(), n_layers=L, n_heads=H,
                            meta={"causal": causal, "special_tokens": list(special)})


def causal_uniform(T: int) -> torch.Tensor:
    w = torch.ones(T, T).tril()
    return w / w.sum(-1, keepdim=True)


def one_hot_rows(targets: list[int], T: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(targets), T).float()


# -------------------------------------------------------- TransformerLens' patterns


def tl_duplicate(tokens: np.ndarray) -> np.ndarray:
    """transformer_lens.head_detector.get_duplicate_token_head_detection_pattern, in NumPy."""
    token_pattern = np.tile(tokens, (len(tokens), 1))
    eq = np.equal(token_pattern, token_pattern.T).astype(int)
    np.fill_diagonal(eq, 0)
    return np.tril(eq).astype(float)


def tl_induction(tokens: np.ndarray) -> np.ndarray:
    """get_induction_head_detection_pattern: the duplicate pattern rolled right, first column 0."""
    dup = tl_duplicate(tokens)
    shifted = np.roll(dup, 1, axis=1)
    shifted[:, 0] = 0
    return np.tril(shifted)


def test_patterns_equal_transformer_lens():
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, 5, size=12)
        assert np.array_equal(duplicate_token_pattern(torch.tensor(ids)).numpy(), tl_duplicate(ids))
        assert np.array_equal(induction_pattern(torch.tensor(ids)).numpy(), tl_induction(ids))
    ids = torch.tensor([3, 1, 3])
    both = duplicate_token_pattern(ids, causal=False)
    assert both[0, 2] == 1 and both[2, 0] == 1 and both.diagonal().sum() == 0


def test_mul_score_is_transformer_lens_mul_over_matched_rows():
    torch.manual_seed(0)
    ids = torch.tensor([0, 5, 6, 7, 5, 6, 7, 9])
    P = induction_pattern(ids)  # rows 4, 5, 6 have a match
    W = torch.softmax(torch.randn(2, 8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), -torch.inf), -1)
    got = mul_score(W, P)
    for h in range(2):
        a = W[h].clone()
        a[:, 0] = 0  # exclude_bos
        a.fill_diagonal_(0)  # exclude_current_token
        rows = [4, 5, 6]
        expected = (a[rows] * P[rows]).sum() / a[rows].sum()  # TransformerLens' mul, on those rows
        assert abs(got[h].item() - expected.item()) < 1e-6
    assert mul_score(W, torch.zeros(8, 8)) is None


# ------------------------------------------------------------ synthetic heads


def test_each_positional_role_scores_one_on_its_pure_head():
    tokens = ["<s>", "the", "cat", ",", "sat", "."]
    T = len(tokens)
    heads = torch.stack([
        one_hot_rows([0, 0, 1, 2, 3, 4], T),  # previous token (row 0 can only see itself)
        torch.eye(T),  # current token
        one_hot_rows([0] * T, T),  # first token
        torch.stack([one_hot_rows([0], T)[0]] + [torch.tensor([0, 0, 0, .5, 0, .5])] * (T - 1)),  # delimiters
        causal_uniform(T),  # broad
    ])[None]  # (1, 5, T, T)
    cap = make(heads, tokens, causal=True, special=("<s>",))
    s = role_scores(cap)
    assert s["previous_token"][0, 0] == 1 and s["current_token"][0, 1] == 1 and s["first_token"][0, 2] == 1
    assert s["delimiter"][0, 3] == 1
    assert delimiter_positions(tokens, ("<s>",)) == [3, 5]
    assert abs(s["entropy"][0, 4].item() - 1.0) < 1e-6 and s["entropy"][0, 0] < 1e-6
    roles = {(r.layer, r.head): r for r in head_roles(cap)}
    expect = {0: "previous_token", 1: "current_token", 2: "first_token", 3: "delimiter", 4: "broad"}
    for h, role in expect.items():
        assert roles[(0, h)].role == role and abs(roles[(0, h)].score - 1.0) < 1e-4, roles[(0, h)]
    table = head_roles(cap)
    assert [r.score for r in table] == sorted((r.score for r in table), reverse=True)


def test_duplicate_and_induction_heads_on_a_repeated_sequence():
    ids = [0, 11, 12, 13, 11, 12, 13]
    tokens = ["<s>", "a", "b", "c", "a", "b", "c"]
    T = len(ids)
    dup = one_hot_rows([0, 1, 2, 3, 1, 2, 3], T)  # second copy looks at the first copy's same token
    ind = one_hot_rows([0, 1, 2, 3, 2, 3, 4], T)  # ... at the token after it
    cap = make(torch.stack([dup, ind])[None], tokens, ids, special=("<s>",))
    s = role_scores(cap)
    assert s["duplicate_token"][0, 0] == 1 and s["induction"][0, 0] == 0
    assert s["induction"][0, 1] == 1 and s["duplicate_token"][0, 1] == 0
    roles = head_roles(cap)
    assert {(r.head, r.role) for r in roles} == {(0, "duplicate_token"), (1, "induction")}


def test_roles_absent_when_the_text_cannot_show_them():
    cap = make(causal_uniform(4)[None, None], ["a", "b", "c", "d"], [1, 2, 3, 4])
    s = role_scores(cap)
    assert "delimiter" not in s and "duplicate_token" not in s and "induction" not in s
    assert head_roles(cap)[0].role == "broad"


def test_entropy_bidirectional_and_causal():
    T = 5
    assert abs(attention_entropy(torch.full((T, T), 1 / T), causal=False).item() - 1) < 1e-6
    assert abs(attention_entropy(causal_uniform(T), causal=True).item() - 1) < 1e-6
    assert attention_entropy(torch.eye(T), causal=False).item() < 1e-6


def test_head_roles_bad_input():
    cap = make(causal_uniform(3)[None, None], ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"must be \(n_layers, n_heads\) = \(1, 1\); received \(2, 2\)"):
        head_roles(cap, prefix_matching=torch.zeros(2, 2))
    with pytest.raises(TypeError, match="takes an AttentionCapture; received dict"):
        head_roles({})


# ------------------------------------------------------------ prefix matching


class Lookup(LoadedModel):
    """Synthetic model, [CLS] x [SEP] like BERT: head 0 is an exact induction head (attends
    to the token after the previous occurrence of the current token), head 1 attends to
    itself."""

    name, n_layers, n_heads, max_positions, causal, special_tokens = "lookup", 1, 2, 512, False, ()
    meta = {}

    def wrap(self, ids):
        return [101, *ids, 102], 1

    def random_ids(self, shape, generator):
        return torch.randint(1000, 2000, shape, generator=generator)

    def attention(self, ids, heads):
        B, T = ids.shape
        w = torch.zeros(B, 2, T, T)
        for b in range(B):
            seq = ids[b].tolist()
            for i in range(T):
                earlier = [j for j in range(i) if seq[j] == seq[i]]
                w[b, 0, i, earlier[-1] + 1 if earlier else 0] = 1
                w[b, 1, i, i] = 1
        return {layer: w[:, list(h)] for layer, h in heads.items()}


def test_prefix_matching_on_a_known_induction_head():
    scores = induction_scores(Lookup(), seq_len=20, seed=3)
    assert scores.shape == (1, 2)
    assert scores[0, 0] == 1 and scores[0, 1] == 0


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("transformers")
    from multihead.inspect.capture import load_model

    return load_model("minilm")


def test_minilm_layer0_head2_is_a_previous_token_head(minilm):
    from multihead.inspect import capture

    for text in ["The cat sat on the mat.",
                 "When Mary and John went to the store, John gave a drink to Mary."]:
        roles = head_roles(capture(text, model=minilm))
        top = roles[0]
        assert (top.layer, top.head, top.role) == (0, 2, "previous_token"), roles[:3]
        assert top.score >= 0.99, top
        others = [r.scores["previous_token"] for r in roles if (r.layer, r.head) != (0, 2)]
        assert max(others) < 0.5
        print(text, [(r.layer, r.head, r.role, round(r.score, 3)) for r in roles[:5]])


def test_minilm_prefix_matching(minilm):
    a = induction_scores(minilm, seq_len=30, seed=0, batch=2)
    b = induction_scores(minilm, seq_len=30, seed=0, batch=2)
    assert a.shape == (6, 12) and torch.equal(a, b)
    assert ((a >= 0) & (a <= 1)).all()
    roles = head_roles(__import__("multihead.inspect", fromlist=["capture"]).capture("a b a b", model=minilm),
                       prefix_matching=a)
    assert all("prefix_matching" in r.scores for r in roles)

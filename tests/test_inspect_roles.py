"""Head-role scores: exact values on synthetic heads, TransformerLens' patterns and "mul"
score, Olsson et al.'s prefix matching, and the real model's previous-token head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multihead.inspect import AttentionCapture, head_roles
from multihead.inspect.roles import (
    attention_entropy,
    delimiter_positions,
    duplicate_token_pattern,
    induction_pattern,
    induction_scores,
    mul_score,
    previous_token_pattern,
    role_scores,
    transformer_lens_scores,
)
from multihead.interop.loaded import LoadedModel

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


def tl_similarity(attention: np.ndarray, detection: np.ndarray, exclude_bos=False, exclude_current_token=False):
    """transformer_lens.head_detector.compute_head_attention_similarity_score, error_measure
    "mul", in NumPy, line for line (TransformerLens @ 030a561): zero the BOS column and the
    diagonal when asked, then sum(A * P) / sum(A) over every row."""
    a = attention.astype(np.float64).copy()
    if exclude_bos:
        a[:, 0] = 0
    if exclude_current_token:
        np.fill_diagonal(a, 0)
    return (a * detection).sum() / a.sum()


def tl_previous(T: int) -> np.ndarray:
    """get_previous_token_head_detection_pattern: ones below the diagonal."""
    p = np.zeros((T, T))
    p[1:, :-1] = np.eye(T - 1)
    return np.tril(p)


def fixed_heads(T: int) -> torch.Tensor:
    """Fixed causal patterns on [BOS a b c a b c]: previous-token, induction, duplicate,
    BOS sink, uniform, and a random one. `(6, T, T)`."""
    g = torch.Generator().manual_seed(1)
    rnd = torch.softmax(torch.randn(T, T, generator=g).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(),
                                                                    -torch.inf), -1)
    return torch.stack([
        one_hot_rows([0, 0, 1, 2, 3, 4, 5], T),
        one_hot_rows([0, 1, 2, 3, 2, 3, 4], T),
        one_hot_rows([0, 1, 2, 3, 1, 2, 3], T),
        one_hot_rows([0] * T, T),
        causal_uniform(T),
        rnd,
    ])


def test_transformer_lens_scores_follow_its_formula_on_fixed_patterns():
    ids = [0, 11, 12, 13, 11, 12, 13]
    tokens = ["<s>", "a", "b", "c", "a", "b", "c"]
    T = len(ids)
    W = fixed_heads(T)
    cap = make(W[None], tokens, ids, special=("<s>",))
    ref_patterns = {"previous_token_head": tl_previous(T), "duplicate_token_head": tl_duplicate(np.array(ids)),
                    "induction_head": tl_induction(np.array(ids))}
    assert np.array_equal(previous_token_pattern(T).numpy(), ref_patterns["previous_token_head"])
    for flags in [{}, {"exclude_bos": True}, {"exclude_current_token": True},
                  {"exclude_bos": True, "exclude_current_token": True}]:
        got = transformer_lens_scores(cap, **flags)
        for name, pattern in ref_patterns.items():
            for h in range(W.shape[0]):
                with np.errstate(invalid="ignore"):
                    expected = tl_similarity(W[h].numpy(), pattern, **flags)
                if np.isnan(expected):  # 0/0: every weight excluded (the BOS sink head); 0, not NaN
                    expected = 0.0
                assert abs(got[name][0, h].item() - expected) < 1e-6, (name, h, flags)
    # Known answers, by hand: TransformerLens' default averages over all 7 rows, so a
    # perfect induction head scores 3/7 (rows 4, 5, 6 match) and a perfect previous-token
    # head 6/7 (row 0 has no previous token); multihead's own scores are 1 for both.
    got = transformer_lens_scores(cap)
    assert abs(got["induction_head"][0, 1].item() - 3 / 7) < 1e-6
    assert abs(got["previous_token_head"][0, 0].item() - 6 / 7) < 1e-6
    own = role_scores(cap)
    assert own["induction"][0, 1] == 1 and own["previous_token"][0, 0] == 1
    # ... and multihead's own induction / duplicate scores are TransformerLens' formula with
    # exclude_bos and exclude_current_token, on the rows that have a match.
    for role, name in (("induction", "induction_head"), ("duplicate_token", "duplicate_token_head")):
        pattern = ref_patterns[name]
        rows = pattern.any(-1)
        for h in range(W.shape[0]):
            a = W[h].numpy().copy()
            a[:, 0] = 0
            np.fill_diagonal(a, 0)
            den = a[rows].sum()
            expected = (a[rows] * pattern[rows]).sum() / den if den > 0 else 0.0
            assert abs(own[role][0, h].item() - expected) < 1e-6, (role, h)
    # Reported beside the roles, never ranked.
    table = {r.head: r for r in head_roles(cap, transformer_lens=True)}
    for name, key in (("previous_token_head", "tl_previous_token"), ("induction_head", "tl_induction"),
                      ("duplicate_token_head", "tl_duplicate_token")):
        for h, r in table.items():
            assert abs(r.scores[key] - got[name][0, h].item()) < 1e-4
    assert "tl_induction" not in head_roles(cap)[0].scores


def test_next_token_role_in_a_bidirectional_model():
    tokens = ["[CLS]", "the", "cat", "sat", "[SEP]"]
    T = len(tokens)
    nxt = one_hot_rows([1, 2, 3, 4, 4], T)  # each token looks at the next ([SEP] at itself)
    cap = make(torch.stack([nxt, torch.full((T, T), 1 / T)])[None], tokens, causal=False)
    s = role_scores(cap)
    assert s["next_token"][0, 0] == 1 and abs(s["next_token"][0, 1].item() - 1 / T) < 1e-6
    assert head_roles(cap)[0].role == "next_token"
    # A causal head cannot look ahead: no next_token score.
    assert "next_token" not in role_scores(make(causal_uniform(T)[None, None], tokens, causal=True))


def test_one_repeated_token_is_not_an_induction_head():
    # "the cat sat on the mat": one repeated word, one matched row. A head whose second
    # "the" happens to look at "cat" scores 1 on induction, but one row is no evidence.
    tokens = ["<s>", "the", "cat", "sat", "on", "the", "mat"]
    ids = [0, 1, 2, 3, 4, 1, 5]
    T = len(ids)
    w = causal_uniform(T)
    w[5] = one_hot_rows([2], T)[0]
    cap = make(w[None, None], tokens, ids, special=("<s>",))
    assert role_scores(cap)["induction"][0, 0] == 1
    (r,) = head_roles(cap)
    assert r.role != "induction" and r.scores["induction"] == 1
    # Two matched rows, but prefix matching ~0: still not an induction head.
    ids2 = [0, 11, 12, 13, 11, 12, 13]
    ind = one_hot_rows([0, 1, 2, 3, 2, 3, 4], T)
    cap2 = make(ind[None, None], tokens, ids2, special=("<s>",))
    assert head_roles(cap2)[0].role == "induction"
    assert head_roles(cap2, prefix_matching=torch.tensor([[0.01]]))[0].role != "induction"
    assert head_roles(cap2, prefix_matching=torch.tensor([[0.6]]))[0].role == "induction"


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
    with pytest.raises(TypeError, match="takes an AttentionCapture or HeadSummaries; received dict"):
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
    from multihead.interop.loaders import load_model

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


def test_minilm_next_token_head_and_no_false_induction(minilm):
    from multihead.inspect import capture

    cap = capture("The cat sat on the mat.", model=minilm)
    roles = {(r.layer, r.head): r for r in head_roles(cap, prefix_matching=induction_scores(minilm, batch=2))}
    # Layer 1 head 8 puts about half its weight on the next token: named so, not "mixed".
    l1h8 = roles[(1, 8)]
    assert l1h8.role == "next_token" and l1h8.score >= 0.4, l1h8
    # One repeated word ("the") and prefix matching ~0.01: no head is called induction.
    assert not [r for r in roles.values() if r.role == "induction"]


def test_minilm_prefix_matching(minilm):
    a = induction_scores(minilm, seq_len=30, seed=0, batch=2)
    b = induction_scores(minilm, seq_len=30, seed=0, batch=2)
    assert a.shape == (6, 12) and torch.equal(a, b)
    assert ((a >= 0) & (a <= 1)).all()
    roles = head_roles(__import__("multihead.inspect", fromlist=["capture"]).capture("a b a b", model=minilm),
                       prefix_matching=a)
    assert all("prefix_matching" in r.scores for r in roles)


# ------------------------------------------------------------ the command line


@pytest.mark.slow
def test_cli_tl_scores_beside_multiheads(capsys):
    pytest.importorskip("transformers")
    from multihead.cli import main
    from multihead.inspect import capture

    text = "The cat sat on the mat. The cat slept."
    assert main(["inspect", text, "--only-layers", "0", "--tl-scores"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("rank"))
    cols = header.split()
    assert {"tl_prev", "tl_dup", "tl_ind", "prev", "next"} <= set(cols)
    tl = transformer_lens_scores(capture(text, layers=[0]))
    rows = {(int(p[1]), int(p[2])): p for p in (line.split() for line in out.splitlines()) if p and p[0].isdigit()}
    for h in range(12):
        printed = float(rows[(0, h)][cols.index("tl_prev")])
        assert abs(printed - tl["previous_token_head"][0, h].item()) < 0.006


@pytest.mark.slow
def test_cli_says_what_it_is_loading_before_importing_transformers(tmp_path):
    """On a terminal, `multihead inspect` prints a status line before the seconds-long
    import of transformers. Not timed (the machines are shared): a `transformers` that
    never finishes importing stands in front of the real one, so the line can only be
    seen if it is printed before that import starts."""
    import os
    import pty
    import select
    import signal
    import sys
    import time

    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text("import time\ntime.sleep(600)\n")
    start = time.monotonic()
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command on a pseudo-terminal
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
        os.execv(sys.executable, [sys.executable, "-m", "multihead", "inspect", "The cat sat.",
                                  "--only-layers", "0", "--only-heads", "2"])
    seen = b""
    try:
        while b"loading minilm" not in seen and time.monotonic() - start < 120:
            ready, _, _ = select.select([fd], [], [], 1)
            if ready:
                try:
                    seen += os.read(fd, 4096)
                except OSError:  # the child ended: the pty is closed
                    break
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        os.close(fd)
    assert b"multihead inspect: loading minilm" in seen, seen


# ------------------------------------------------------------ the label and its runner-up


def _partial_induction(frac: float) -> tuple[AttentionCapture, list[int]]:
    """A head that puts `frac` of each matched row on the induction target, the rest on the
    token itself (excluded from the score) and BOS ... plus a little on a non-target, so its
    induction score on this text is exactly `frac_target / (frac_target + other)`."""
    ids = [0, 11, 12, 13, 11, 12, 13]
    tokens = ["<s>", "a", "b", "c", "a", "b", "c"]
    T = len(ids)
    w = one_hot_rows([0, 0, 1, 2, 3, 4, 5], T)  # previous-token elsewhere
    for i, target in ((4, 2), (5, 3), (6, 4)):
        w[i] = 0
        w[i, target] = frac
        w[i, 1 if target != 1 else 3] = 1 - frac  # a non-target key: lowers the induction score
    return make(w[None, None], tokens, ids, special=("<s>",)), ids


def test_induction_is_the_label_when_prefix_matching_scores_higher_and_the_guards_pass():
    cap, _ = _partial_induction(0.8)
    assert abs(role_scores(cap)["induction"][0, 0].item() - 0.8) < 1e-6
    # random repeated tokens: 0.95; this text: 0.8. One mechanism: the label is induction,
    # the runner-up shows the prefix-matching score.
    (r,) = head_roles(cap, prefix_matching=torch.tensor([[0.95]]))
    assert (r.role, round(r.score, 4)) == ("induction", 0.8)
    assert (r.runner_up, r.runner_up_score) == ("prefix_matching", 0.95)
    # the same head on a text where induction scores below the bar: prefix matching names it
    low, _ = _partial_induction(0.3)
    (r,) = head_roles(low, prefix_matching=torch.tensor([[0.95]]))
    # prefix 0.95, previous_token (rows 1-3 of 6) 0.5, induction 0.3
    assert (r.role, r.runner_up, r.runner_up_score) == ("prefix_matching", "previous_token", 0.5)
    # a text with one repeated token (one matched row): induction is not eligible
    tokens = ["<s>", "the", "cat", "sat", "on", "the", "mat"]
    ids = [0, 1, 2, 3, 4, 1, 5]
    w = causal_uniform(7)
    w[5] = one_hot_rows([2], 7)[0]
    (r,) = head_roles(make(w[None, None], tokens, ids, special=("<s>",)), prefix_matching=torch.tensor([[0.9]]))
    assert r.role == "prefix_matching" and r.runner_up != "induction"


def test_every_head_shows_its_runner_up():
    tokens = ["<s>", "the", "cat", ",", "sat", "."]
    T = len(tokens)
    mostly_prev = 0.7 * one_hot_rows([0, 0, 1, 2, 3, 4], T) + 0.3 * one_hot_rows([0] * T, T)
    cap = make(torch.stack([mostly_prev, causal_uniform(T)])[None], tokens, special=("<s>",))
    roles = {r.head: r for r in head_roles(cap)}
    assert roles[0].role == "previous_token" and roles[0].runner_up == "first_token"
    # first_token over rows 1..5: row 1's previous token is BOS (1.0), the others 0.3
    assert roles[0].runner_up_score == pytest.approx((1.0 + 4 * 0.3) / 5, abs=1e-4)
    # broad: the runner-up is the best role, below the bar
    assert roles[1].role == "broad" and roles[1].runner_up and roles[1].runner_up_score < 0.4
    assert "runner_up='first_token'" in repr(roles[0]) and "tensor" not in repr(roles[0])


def test_repr_quotes_the_score_as_stored():
    cap = make(one_hot_rows([0, 0, 1, 2], 4)[None, None], ["<s>", "a", "b", "c"], special=("<s>",))
    (r,) = head_roles(cap)
    assert f"score={r.score:.4g}" in repr(r) and r.score == 1.0

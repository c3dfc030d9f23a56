"""`multihead.heads.tasks` for decoders: IOI pairs (Wang et al., 2022) and repeated random
tokens (Olsson et al., 2022), and the `heads scan --task` / `heads induction` commands.

The fast tests run a tiny random Llama with SmolLM2's real tokenizer (so names are the
tokens a real model sees); the slow ones run SmolLM2 itself and check that it does the
tasks: IOI clean metric positive and corrupted negative, the repeated half far easier."""

from __future__ import annotations

import json

import pytest
import torch

from multihead.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer: from multihead's float32 cache when it is there, else from the .gguf."""
    pytest.importorskip("gguf")
    from multihead.interop.loaders import InspectError, gguf_cache_folder, quiet_hub, smollm2_path

    try:
        path = smollm2_path()
    except InspectError as err:
        pytest.skip(str(err))
    cached = gguf_cache_folder(path)
    with quiet_hub():
        if (cached / "tokenizer.json").is_file():
            return transformers.AutoTokenizer.from_pretrained(cached)
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A random 2-layer Llama over SmolLM2's vocabulary, on attn_implementation="multihead"."""
    import multihead.interop.hf  # noqa: F401

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("multihead")
    return model


@pytest.fixture(scope="module")
def tiny_folder(tiny, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_ioi_pairs_are_wang_et_al_prompts(tokenizer):
    from multihead.heads import tasks

    t = tasks.ioi(12, seed=3, tokenizer=tokenizer)
    assert len(t) == 12 and t.orders == ("ABBA", "BABA") * 6
    names = dict(tasks.single_token_names(tokenizer))
    assert {"Mary", "John"} <= set(names) and names["Mary"] == tokenizer(" Mary", add_special_tokens=False)[
        "input_ids"][0] != tokenizer("Mary", add_special_tokens=False)["input_ids"][0]
    for i in range(len(t)):
        n = int(t.position[i]) + 1
        clean, corr, ref = (x["input_ids"][i, :n].tolist() for x in (t.clean, t.corrupted, t.reference))
        assert clean == tokenizer(t.texts[i])["input_ids"]  # the ids are the tokenizer's own reading
        assert corr == tokenizer(t.corrupted_texts[i])["input_ids"]
        assert ref == tokenizer(t.reference_texts[i])["input_ids"]
        io, s = int(t.answer[i]), int(t.wrong[i])
        differ = [k for k in range(n) if clean[k] != corr[k]]
        assert len(differ) == 1 and clean[differ[0]] == s and corr[differ[0]] == io  # S2 -> IO, same length
        assert clean.count(s) == 2 and clean.count(io) == 1 and corr.count(io) == 2
        first_two = [tok for tok in clean if tok in (io, s)][:2]
        assert first_two == ([io, s] if t.orders[i] == "ABBA" else [s, io])
        assert len(set(ref) & {io, s}) == 2 and ref.count(s) == 1  # ABC: a third name where S repeated
        assert t.clean["attention_mask"][i].sum() == n and not t.clean["attention_mask"][i, n:].any()
    assert tasks.ioi(12, seed=3, tokenizer=tokenizer).texts == t.texts
    assert tasks.ioi(12, seed=4, tokenizer=tokenizer).texts != t.texts


def test_ioi_metric_is_the_mean_logit_difference_at_each_last_token(tokenizer, tiny):
    from multihead.heads import tasks

    t = tasks.ioi(4, tokenizer=tokenizer)
    with torch.no_grad():
        padded = tiny(**t.clean).logits
        want = []
        for i in range(len(t)):  # each prompt alone, unpadded: what the padded batch must equal
            ids = tokenizer(t.texts[i], return_tensors="pt")["input_ids"]
            last = tiny(ids).logits[0, -1]
            want.append((last[t.answer[i]] - last[t.wrong[i]]).item())
    torch.testing.assert_close(t.logit_diff(padded), torch.tensor(want), rtol=1e-4, atol=1e-4)
    assert abs(t.metric(padded).item() - sum(want) / len(want)) < 1e-4
    with pytest.raises(ValueError, match="IOI metric reads logits .B=4"):
        t.metric(padded[:2])
    with pytest.raises(ValueError, match="N=4"):
        t.logit_diff(padded[:2])


def test_ioi_refuses_bad_arguments(tokenizer):
    from multihead.heads import tasks

    with pytest.raises(ValueError, match="between 1 and 100,000"):
        tasks.ioi(0, tokenizer=tokenizer)
    with pytest.raises(TypeError, match="int"):
        tasks.ioi(2.5, tokenizer=tokenizer)
    with pytest.raises(TypeError, match="tokenizer"):
        tasks.ioi(2, tokenizer=object())
    with pytest.raises(ValueError, match="3 names"):
        tasks.ioi(2, tokenizer=tokenizer, names=("Mary", "John", "Xqzvbnmlkj"))


def test_induction_sequences_repeat_and_the_metric_is_the_repeated_halfs_loss():
    import torch.nn.functional as F

    from multihead.heads import tasks

    t = tasks.induction(3, 7, seed=1, vocab=50, bos=49)
    assert t.clean.shape == (3, 15) and (t.clean[:, 0] == 49).all()
    assert torch.equal(t.clean[:, 1:8], t.clean[:, 8:]) and torch.equal(t.corrupted[:, 8:], t.clean[:, 8:])
    assert not torch.equal(t.corrupted[:, 1:8], t.clean[:, 1:8]) and t.reference.shape == (3, 15)
    logits = torch.randn(3, 15, 50, dtype=torch.float64)
    # positions 8..13 (repeated tokens 1..6) predict tokens 9..14, by hand
    want = sum(F.cross_entropy(logits[b, p], t.clean[b, p + 1]) for b in range(3) for p in range(8, 14)) / 18
    assert abs(t.metric(logits).item() - want.item()) < 1e-6
    first = sum(F.cross_entropy(logits[b, p], t.clean[b, p + 1]) for b in range(3) for p in range(1, 7)) / 18
    assert abs(t.first_half_loss(logits).item() - first.item()) < 1e-6
    assert torch.equal(tasks.induction(3, 7, seed=1, vocab=50, bos=49).clean, t.clean)
    ids = tasks.induction(2, 5, vocab=[3, 5, 7]).clean
    assert set(ids.unique().tolist()) <= {3, 5, 7}
    with pytest.raises(ValueError, match="length"):
        tasks.induction(2, 1, vocab=50)


def test_induction_draws_ordinary_tokens_of_a_tokenizer(tokenizer):
    from multihead.heads import tasks

    t = tasks.induction(4, 20, vocab=tokenizer)
    special = set(tokenizer.all_special_ids)
    assert not set(t.clean.unique().tolist()) & special
    assert not any(p.startswith("<|") for p in tokenizer.convert_ids_to_tokens(t.clean.flatten().tolist()))


def test_patch_scan_is_one_line_and_equals_patching_by_hand(tokenizer, tiny):
    from multihead import heads
    from multihead.heads import tasks

    t = tasks.ioi(2, tokenizer=tokenizer)
    table = heads.patch_scan(tiny, t.clean, t.corrupted, t.metric)
    rec = heads.record(tiny, t.clean)
    with torch.no_grad(), heads.patch(tiny, rec, [(1, 2)]):
        by_hand = t.metric(tiny(**t.corrupted).logits).item()
    assert abs(table[1, 2].item() - by_hand) < 1e-4
    ind = tasks.induction(2, 6, vocab=tokenizer)
    table = heads.patch_scan(tiny, ind.clean, ind.corrupted, ind.metric)
    with torch.no_grad(), heads.patch(tiny, heads.record(tiny, ind.clean), [(0, 3)]):
        assert abs(table[0, 3].item() - ind.metric(tiny(ind.corrupted).logits).item()) < 1e-4


def _run(capsys, *argv):
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_scan_task_ioi_json_keeps_its_keys_and_checks_the_ranking(capsys, tiny_folder, tokenizer, tiny):
    from multihead import heads
    from multihead.heads import tasks

    code, out, err = _run(capsys, "scan", "--model", str(tiny_folder), "--task", "ioi", "--n", "2", "--json")
    assert code == 0, err
    r = json.loads(out)
    t = tasks.ioi(2, tokenizer=tokenizer)
    want = heads.patch_scan(tiny, t.clean, t.corrupted, t.metric)
    torch.testing.assert_close(torch.tensor(r["table"]), want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert abs(r["metric_clean"] - t.metric(tiny(**t.clean).logits).item()) < 1e-4
        assert abs(r["metric_corrupted"] - t.metric(tiny(**t.corrupted).logits).item()) < 1e-4
    c = r["causal_check"]
    assert [row["k"] for row in c["by_k"]] == [4]  # of 8 heads: k = 8 would leave none to draw at random
    row = c["by_k"][0]
    assert len(row["random"]) == 5 and row["random_median"] == sorted(row["random"])[2]
    with torch.no_grad(), heads.ablate(tiny, [tuple(h) for h in row["heads"]], how="mean",
                                       reference=heads.record(tiny, t.reference)):
        assert abs(row["ablated"] - t.metric(tiny(**t.clean).logits).item()) < 1e-4
    assert r["prompts"][0]["clean"] == t.texts[0] and r["task"] == "ioi"


def test_scan_task_induction_and_the_induction_study(capsys, tiny_folder, tmp_path, tokenizer):
    from multihead.heads import tasks

    code, out, err = _run(capsys, "scan", "--model", str(tiny_folder), "--task", "induction", "--n", "2",
                          "--length", "6")
    assert code == 0, err
    assert "causal check" in out and "repeated half" in out
    png = tmp_path / "ind.png"
    code, out, err = _run(capsys, "induction", "--model", str(tiny_folder), "--n", "2", "--length", "6", "--json",
                          "--png", str(png))
    assert code == 0, err
    r = json.loads(out)
    score = torch.tensor(r["induction_score"])
    assert score.shape == (2, 4) and (score >= 0).all() and (score <= 1).all()
    assert abs(r["top"][0]["induction_score"] - score.max().item()) < 1e-5
    # the scores against transformers' own eager attention weights
    eager = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="eager").eval()
    t = tasks.induction(2, 6, vocab=tokenizer)
    with torch.no_grad():
        att = eager(t.clean, output_attentions=True).attentions  # per layer (B, H, T, S)
    q = torch.arange(6) + 6
    want = torch.stack([a[:, :, q, q - 5].mean((0, 2)) for a in att])
    torch.testing.assert_close(score, want, rtol=1e-4, atol=1e-5)
    assert abs(r["loss_repeated_half"] - t.metric(eager(t.clean).logits).item()) < 1e-4
    feeders = r["feeders"]["heads"]  # layer-0 heads outside the top 4, each mean-ablated alone
    top4 = {(x["layer"], x["head"]) for x in r["top"][:4]}
    assert {(f["layer"], f["head"]) for f in feeders} == {(0, h) for h in range(4)} - top4
    from multihead import heads

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="multihead").eval()
    f = feeders[0]
    with torch.no_grad(), heads.ablate(model, [(f["layer"], f["head"])], how="mean",
                                       reference=heads.record(model, t.reference)):
        raised = t.metric(model(t.clean).logits).item() - r["loss_repeated_half"]
    assert abs(f["loss_raised_by"] - raised) < 1e-4
    assert set(r["ablation"]) == {"zero", "mean"} and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv,message", [
    (["scan", "--task", "ioi", "--n", "0"], "--n must be between 1 and 100,000"),
    (["scan", "--task", "induction", "--length", "200"], "at most 256 positions"),
    (["scan", "--task", "ioi", "--clean", "x"], "drop --clean"),
    (["scan", "--clean", "When Mary"], "missing: --corrupted, --answer, --wrong"),
    (["scan", "--n", "4", "--clean", "a", "--corrupted", "b", "--answer", "c", "--wrong", "d"], "add --task"),
    (["induction", "--length", "1"], "--length must be between 2 and 100,000"),
])
def test_task_mistakes_are_one_line_exit_2(capsys, tiny_folder, argv, message):
    code, out, err = _run(capsys, *argv[:1], "--model", str(tiny_folder), *argv[1:])
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ on SmolLM2 itself

@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 through the loader (kept for the session, so the CLI runs below reuse it)."""
    pytest.importorskip("gguf")
    from multihead.interop.loaders import InspectError, load_model

    try:
        return load_model("smollm2")
    except InspectError as err:
        pytest.skip(str(err))


@pytest.mark.slow
def test_smollm2_does_ioi_clean_positive_corrupted_negative(smollm2):
    from multihead.heads import tasks

    t = tasks.ioi(8, tokenizer=smollm2)
    with torch.no_grad():
        clean = t.logit_diff(smollm2.model(**t.clean).logits)
        corrupted = t.logit_diff(smollm2.model(**t.corrupted).logits)
        reference = t.metric(smollm2.model(**t.reference).logits).item()
    assert clean.mean() > 2 and corrupted.mean() < -2, (clean, corrupted)
    assert (clean > corrupted).float().mean() >= 0.75  # pair by pair, not only on average
    assert corrupted.mean() < reference < clean.mean()  # ABC: neither name is favoured by a repeat


@pytest.mark.slow
def test_smollm2_copies_repeated_random_tokens(smollm2):
    from multihead.heads import tasks

    t = tasks.induction(2, 40, vocab=smollm2)
    with torch.no_grad():
        logits = smollm2.model(t.clean).logits
        after_other = t.metric(smollm2.model(t.corrupted).logits).item()
    first, repeated = t.first_half_loss(logits).item(), t.metric(logits).item()
    assert repeated < 0.4 * first and repeated < 0.4 * after_other, (first, repeated, after_other)


@pytest.mark.slow
@pytest.mark.parametrize("argv,message", [
    (["--clean", "When Mary and John went to the store, John gave a drink to", "--corrupted",
      "When Mary and John went to the store, Mary gave a drink to", "--answer", "Mary Ann", "--wrong", "John"],
     "--answer 'Mary Ann' is 2 tokens"),
    (["--clean", "When Mary and John went out, John gave a drink to", "--corrupted",
      "When Mary and John went out, Mariangela gave a drink to", "--answer", "Mary", "--wrong", "John"],
     "patching needs the same number of tokens"),
    (["--clean", "word " * 8200, "--corrupted", "word " * 8200, "--answer", "Mary", "--wrong", "John"],
     "this model takes at most 8192 positions"),
    (["--clean", "", "--corrupted", "x", "--answer", "Mary", "--wrong", "John"], "--clean is empty"),
])
def test_smollm2_scan_mistakes_exit_2(capsys, smollm2, argv, message):
    code, out, err = _run(capsys, "scan", *argv)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_smollm2_answer_mary_is_the_space_led_token(capsys, smollm2):
    from multihead import heads

    clean = "When Mary and John went to the store, John gave a drink to"
    corrupted = "When Mary and John went to the store, Mary gave a drink to"
    code, out, err = _run(capsys, "scan", "--clean", clean, "--corrupted", corrupted, "--answer", "Mary",
                          "--wrong", "John", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert (r["answer_token"], r["wrong_token"]) == ("ĠMary", "ĠJohn")
    assert r["metric_clean"] > 3 and r["metric_corrupted"] < -3
    tok, model = smollm2.tokenizer, smollm2.model
    mary, john = (tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in ("Mary", "John"))

    def metric(logits):
        return (logits[:, -1, mary] - logits[:, -1, john]).mean()
    want = heads.patch_scan(model, tok(clean, return_tensors="pt"), tok(corrupted, return_tensors="pt"), metric)
    torch.testing.assert_close(torch.tensor(r["table"]), want, rtol=1e-4, atol=1e-4)


def test_embed_reads_the_hidden_states_of_a_model_with_an_lm_head():
    # A folder is loaded with the class that keeps its head: the retrieval embedding must still be
    # the last hidden state, never the logits the head returns first.
    import transformers

    from multihead.heads import tasks

    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64)
    torch.manual_seed(0)
    mlm = transformers.BertForMaskedLM(cfg).eval()

    def tok(texts, **kw):
        ids = torch.tensor([[1, 5, 7, 9], [1, 4, 4, 0]])
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}

    with torch.no_grad():
        with_head, base = tasks.embed(mlm, tok, ["a", "b"]), tasks.embed(mlm.bert, tok, ["a", "b"])
    assert with_head.shape == (2, 32)
    torch.testing.assert_close(with_head, base, rtol=0, atol=1e-6)

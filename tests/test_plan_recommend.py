"""The recommender: its rules of thumb, its ladder, every warning, and its determinism."""

import math

import pytest

from multihead import plan
from multihead.plan.devices import DEVICES
from multihead.plan.recommend import Request, recommend
from multihead.plan.report import recommendation_dict


def rec(params, **kw):
    if isinstance(kw.get("device"), str):
        kw["device"] = DEVICES[kw["device"]]
    return recommend(Request(params=plan.parse_count(params), **kw))


def heads(r):
    a = r.pick.model.attention
    return a.d_model, a.n_heads, a.n_kv_heads, a.head_dim


# --- rules of thumb --------------------------------------------------------------------


def test_125m_is_gpt2_shaped_mha():
    r = rec("125M", context=1024)
    assert heads(r) == (768, 12, 12, 64)
    assert r.pick.label == "MHA"
    assert r.pick.model.tied_embeddings
    assert abs(r.pick.params.total - 125e6) / 125e6 < 0.05


def test_1b_is_2048_wide_with_16_heads_of_128():
    r = rec("1B")
    assert heads(r) == (2048, 16, 8, 128)
    assert r.pick.label == "GQA-8"


def test_70b_is_8192_wide_with_64_heads_and_8_kv_heads():
    r = rec("70B", context=8192)
    assert heads(r) == (8192, 64, 8, 128)
    assert r.request.n_devices == 4  # 130 GiB of weights in half of 4 x 72 GiB usable
    assert r.pick.fit.fits
    assert any("4 x h100-80gb" in n for n in r.notes)


def test_layers_fill_the_budget():
    for size in ("350M", "7B", "13B"):
        r = rec(size)
        assert abs(r.pick.params.total - plan.parse_count(size)) / plan.parse_count(size) < 0.05


# --- the ladder ------------------------------------------------------------------------


def test_inference_steps_down_to_the_first_cache_that_fits():
    r = rec("7B", context=32 * 1024, batch=16, device="h100-80gb")
    by_label = {c.label: c for c in r.alternatives}
    assert not by_label["GQA-8"].fit.fits and not by_label["MHA"].fit.fits
    assert r.pick.label == "GQA-4" and r.pick.fit.fits
    assert r.reason.startswith("GQA-4: GQA-8 would need ")
    assert "h100-80gb" in r.reason


def test_mla_sits_between_4_and_2_kv_heads():
    r = rec("7B", context=64 * 1024, batch=16, device="h100-80gb")
    by_label = {c.label: c for c in r.alternatives}
    assert not by_label["GQA-4"].fit.fits
    assert r.pick.label == "MLA-512"  # rank 4 * head_dim, rope head_dim / 2
    a = r.pick.model.attention
    assert (a.kv_rank, a.rope_dim, a.head_dim, a.v_head_dim, a.q_rank) == (512, 64, 128, 128, 1536)
    assert r.check["command"].endswith("--d-model 4096 --n-heads 32 --kv-rank 512 --rope-dim 64")


def test_nothing_fits_gives_the_smallest_cache_flagged():
    r = rec("7B", context=1024 * 1024, batch=64, device="h100-80gb")
    assert r.pick.label == "MQA" and not r.pick.fit.fits
    assert any("does not fit" in w and "at most" in w for w in r.warnings)


def test_mla_is_never_picked_below_1b_unless_asked():
    r = rec("350M", context=128 * 1024, batch=64, device="l4")
    assert all(c.model.attention.kind != "MLA" for c in r.alternatives)
    assert r.pick.label in ("MQA", "GQA-2")


def test_training_keeps_the_production_default():
    r = rec("7B", context=128 * 1024, batch=8, priority="training")
    assert r.pick.label == "GQA-8"
    assert "training holds no KV cache" in r.reason
    state = 16 * r.pick.params.total
    assert any(f"at least {math.ceil(state / (0.9 * DEVICES['h100-80gb'].memory))} x" in n
               for n in r.notes)


def test_alternatives_are_ranked_and_priced_exactly():
    r = rec("7B", context=32 * 1024, batch=16)
    alts = r.alternatives
    assert alts[0] is r.pick
    labels = [c.label for c in alts]
    assert {"MHA", "GQA-16", "GQA-8", "GQA-4", "GQA-2", "MQA", "MLA-256", "MLA-512",
            "MLA-1024"} == set(labels)
    fits = [c.fit.fits for c in alts[1:]]
    assert fits == sorted(fits, reverse=True)  # fitting ones first
    for c in alts:
        assert c.params.total == plan.model_params(c.model)
        assert c.kv_bytes == plan.model_kv_cache_bytes(c.model, 32 * 1024, 16, "bf16")
        assert c.model.n_layers == r.pick.model.n_layers  # same depth: the trade-off is visible


def test_init_scales_and_bias():
    r = rec("1B")
    c, L = 2048, r.pick.model.n_layers
    assert r.init["q"]["std"] == pytest.approx(1 / math.sqrt(c))
    assert r.init["o"]["std"] == pytest.approx(1 / math.sqrt(c) / math.sqrt(2 * L))
    assert r.bias["use"] is False
    mla = rec("7B", variant="mla")
    assert set(mla.init) == {"q_a", "q_b", "kv_a", "kv_b", "o"}
    assert mla.init["kv_b"]["std"] == pytest.approx(1 / math.sqrt(512))


def test_check_points_at_the_induction_lab():
    # The flags of `multihead lab induction`: the variant, and the KV heads (GQA) or the
    # latent rank and RoPE dims (MLA) of the pick.
    r = rec("125M")
    assert r.check["command"] == ("multihead lab induction --variant mha --n-layers 2 --d-model 768 "
                                  "--n-heads 12")
    assert r.check["threshold"] == 0.95
    assert rec("7B", n_kv_heads=4).check["command"] == (
        "multihead lab induction --variant gqa --n-layers 2 --d-model 4096 --n-heads 32 --n-kv-heads 4")
    assert rec("7B", variant="mqa").check["command"].startswith("multihead lab induction --variant mqa ")
    mla = rec("7B", variant="mla")
    a = mla.pick.model.attention
    assert mla.check["command"] == (
        f"multihead lab induction --variant mla --n-layers 2 --d-model 4096 --n-heads 32 "
        f"--kv-rank {a.kv_rank} --rope-dim {a.rope_dim}") and (a.kv_rank, a.rope_dim) == (512, 64)


def test_tiny_budget_warns():
    r = rec("7")
    assert r.warnings[0] == ("the budget is tiny: 7 parameters; did you mean 7M or 7B? "
                             "(sizes take a suffix: 125M, 1.3B, 7B)")
    assert not any("tiny" in w for w in rec("125M").warnings)


def test_an_invalid_kv_head_count_is_named_in_the_pick():
    r = rec("7B", n_kv_heads=7)  # 32 query heads: divisors 1, 2, 4, 8, 16, 32
    assert r.pick.label == "GQA-4"
    assert r.pick_note == "4 KV heads, not 7: KV heads must divide the 32 query heads"
    assert "as asked" not in r.reason and "from the 7 KV heads asked" in r.reason
    assert rec("7B", n_kv_heads=64).pick_note == "32 KV heads, not 64: there are only 32 query heads"
    assert rec("7B", n_kv_heads=8).pick_note == ""


def test_deterministic():
    a = recommendation_dict(rec("13B", context=65536, batch=4))
    b = recommendation_dict(rec("13B", context=65536, batch=4))
    assert a == b


# --- what the user fixes ------------------------------------------------------------------


@pytest.mark.parametrize("kw, label", [
    ({"variant": "mha"}, "MHA"), ({"variant": "mqa"}, "MQA"),
    ({"variant": "gqa"}, "GQA-8"), ({"variant": "gqa", "n_kv_heads": 4}, "GQA-4"),
    ({"n_kv_heads": 2}, "GQA-2"), ({"variant": "mla"}, "MLA-512"),
    ({"kv_rank": 256}, "MLA-256"), ({"variant": "gqa", "n_kv_heads": 32}, "GQA-16"),
])  # fmt: skip
def test_forced_variants(kw, label):
    r = rec("7B", **kw)
    assert r.pick.label == label
    assert "as asked" in r.reason


def test_fixed_heads():
    assert heads(rec("7B", n_heads=32, head_dim=128)) == (4096, 32, 8, 128)
    assert heads(rec("7B", d_model=5120, n_heads=40)) == (5120, 40, 8, 128)
    assert heads(rec("7B", d_model=3072, head_dim=96)) == (3072, 32, 8, 96)


# --- warnings ------------------------------------------------------------------------------


def test_warning_head_dim_below_32():
    r = rec("1B", d_model=512, n_heads=32)
    assert any(w.startswith("head_dim 16 is below 32") for w in r.warnings)
    assert not any("below 32" in w for w in rec("1B").warnings)


def test_warning_mha_many_heads_beyond_32k_prices_gqa_and_mla():
    r = rec("7B", context=64 * 1024, batch=2, variant="mha")
    (w,) = [w for w in r.warnings if w.startswith("MHA with 32 heads")]
    # 2 (K,V) * 32 heads * 128 * 2 bytes = 16 KiB per token per layer.
    per_seq = 16 * 1024 * 64 * 1024 * r.pick.model.n_layers
    assert f"{plan.units.fmt_bytes(per_seq)} per sequence" in w
    assert "GQA-8 would need" in w and "MLA-512" in w
    # Not at 32K exactly, and not with 16 heads.
    assert not any("MHA with" in w for w in rec("7B", context=32 * 1024, variant="mha").warnings)
    assert not any("MHA with" in w for w in rec("1B", context=131072, variant="mha").warnings)


def test_warning_mla_below_1b_when_asked():
    r = rec("350M", variant="mla")
    assert r.pick.model.attention.kind == "MLA"
    assert any(w.startswith("MLA below 1B parameters (350M)") for w in r.warnings)
    assert not any("MLA below" in w for w in rec("7B", variant="mla").warnings)


def test_warning_gqa_groups_must_divide_heads():
    r = rec("125M", n_kv_heads=5)
    (w,) = [w for w in r.warnings if "must be divisible by" in w]
    assert w == ("n_heads (12) must be divisible by n_kv_heads (5); valid: 1, 2, 3, 4, 6, 12; using 4 "
                 "(every KV head serves the same number of query heads)")
    assert r.pick.label == "GQA-4"


def test_warning_weights_do_not_fit():
    r = rec("70B", n_devices=1)
    assert any(w.startswith("the weights (") and "--n-accelerators" in w for w in r.warnings)


# --- bad requests ----------------------------------------------------------------------------


@pytest.mark.parametrize("kw, error, match", [
    ({"params": 0}, ValueError, "params must be an int >= 1; received 0"),
    ({"params": 7e9}, TypeError, r"params must be an int >= 1; received 7000000000.0 \(float\)"),
    ({"params": 10**9, "priority": "speed"}, ValueError,
     "priority must be one of inference, training; received 'speed'"),
    ({"params": 10**9, "variant": "flash"}, ValueError,
     "variant must be one of mha, gqa, mqa, mla; received 'flash'"),
    ({"params": 10**9, "n_heads": 0}, ValueError, "n_heads must be an int >= 1 or None; received 0"),
    ({"params": 10**9, "dtype": "fp12"}, ValueError, "unknown dtype 'fp12'"),
])  # fmt: skip
def test_bad_requests(kw, error, match):
    with pytest.raises(error, match=match):
        Request(**kw)


@pytest.mark.parametrize("kw, match", [
    ({"d_model": 4096, "n_heads": 30}, r"d_model \(4096\) must be divisible by n_heads \(30\)"),
    ({"d_model": 4096, "n_heads": 30, "head_dim": 128},
     r"d_model must equal n_heads \* head_dim; received d_model 4096, n_heads 30"),
    ({"d_model": 1000}, r"d_model \(1000\) is not a multiple of any usual head_dim"),
    ({"d_model": 3000, "head_dim": 128}, r"must be divisible by head_dim \(128\)"),
])  # fmt: skip
def test_bad_geometry_requests(kw, match):
    with pytest.raises(ValueError, match=match):
        rec("7B", **kw)


# --- invariants over many requests ---------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(st.integers(7, 12).map(lambda e: 10**e).flatmap(lambda p: st.integers(p, 3 * p)),
       st.sampled_from([512, 4096, 32768, 131072]), st.sampled_from([1, 4, 32]),
       st.sampled_from(sorted(DEVICES)), st.sampled_from(["inference", "training"]))
def test_recommendation_invariants(params, context, batch, device, priority):
    r = recommend(Request(params=params, context=context, batch=batch, device=DEVICES[device],
                          priority=priority))
    a = r.pick.model.attention
    assert a.d_model == a.n_heads * a.head_dim and a.head_dim in (64, 128)
    assert a.kind != "MLA" or params >= 10**9
    assert r.alternatives[0] is r.pick
    assert len({c.label for c in r.alternatives}) == len(r.alternatives)
    if priority == "inference" and not r.pick.fit.fits and r.pick.fit.weights_fit:
        ladder = [c for c in r.alternatives if c.label in ("MQA", "MLA-" + str(4 * a.head_dim))]
        assert r.pick.kv_bytes <= min(c.kv_bytes for c in ladder)  # the smallest on offer
    assert recommendation_dict(r) == recommendation_dict(
        recommend(Request(params=params, context=context, batch=batch, device=DEVICES[device],
                          priority=priority)))


def test_warning_budget_too_small_for_two_layers():
    r = rec("30M", d_model=1024)  # the 32000 x 1024 embedding alone is 32.8M
    assert r.pick.model.n_layers == 1
    assert any("leave room for 1 layer" in w for w in r.warnings)
    assert not any("leave room" in w for w in rec("30M", d_model=1024, n_layers=1).warnings)

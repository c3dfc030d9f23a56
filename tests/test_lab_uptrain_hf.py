"""`multihead lab uptrain --model`: a transformers Llama-family model converted to MQA and MLA,
uptrained with a control; results.json's schema, its numbers against an independent
recomputation (held-out perplexity by hand from the logits, KV bytes from the cache's
shapes), the same seed giving the same numbers, and Ctrl-C + --resume equal to a run
that was never interrupted. Fast on a tiny random Llama folder; one slow run on SmolLM2."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import torch

from conftest import json_numbers, unquoted_numbers
from multihead.corpus import split_kjv
from multihead.errors import UsageError
from multihead.lab.uptrain_hf import STATE, HFUptrainConfig, run_uptrain_hf, work_plan

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TIMINGS = ("seconds", "cpu_seconds", "elapsed_s", "cpu_s", "date", "cpu_seconds_per_step", "decode", "control_decode")


def _tokenizer(text: str):
    """A word-level tokenizer over the commonest words of `text` (the rest map to [UNK])."""
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Counter(re.findall(r"\w+|[^\w\s]", text)).most_common(300)
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, (w, _) in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = _tokenizer(split_kjv(50_000)[0])
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=len(tok),
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=1,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _cfg(folder, **kw) -> HFUptrainConfig:
    base = replace(HFUptrainConfig.quick(str(folder)), steps=6, fractions=(0.0, 0.5, 1.0), rope_dim=4, ranks=(8,),
                   inits=("mean", "first", "random"), freeze_check=True, max_train_chars=50_000, lr=3e-3)
    return replace(base, **kw)


def _numbers(res: dict) -> dict:
    """results.json's object without what depends on the clock."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in TIMINGS and k != "seconds_per_step"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    r = strip(res["results"])
    for key in ("summary", "table"):  # they quote seconds per step
        r.pop(key, None)
    r["freeze"].pop("verdict", None)
    return r


@pytest.fixture(scope="module")
def quick(llama_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return run_uptrain_hf(_cfg(llama_folder), out, progress=False), out


def test_schema_and_every_target(quick, llama_folder):
    from multihead.lab.results import check_results

    res, out = quick
    check_results(json.loads((out / "results.json").read_text()), out, required=["base", "control", "variants"])
    r = res["results"]
    assert not res["interrupted"] and res["experiment"] == "uptrain"
    assert set(r["base"]) >= {"val_ppl", "kv_bytes_per_token"}
    cfg = _cfg(llama_folder)
    steps = [0, 3, 6]
    assert [c["steps"] for c in r["control"]] == steps and r["control"][0]["val_ppl"] == r["base"]["val_ppl"]
    got = [(v["target"], v["init"], v["objective"], v["steps"]) for v in r["variants"]]
    want = [(t, i, "next-token", s) for t, i in (("mqa", "mean"), ("mqa", "first"), ("mqa", "random"),
                                                  ("mla-8", "calibrated")) for s in steps]
    assert got == want + [("mqa", "mean", "distill", s) for s in steps]
    for v in r["variants"]:
        assert v["val_ppl"] > 1 and math.isfinite(v["val_ppl"])
        assert v["control_ppl"] == r["control"][steps.index(v["steps"])]["val_ppl"]
        if v["steps"]:
            conv = next(w["val_ppl"] for w in r["variants"] if (w["target"], w["init"], w["objective"], w["steps"])
                        == (v["target"], v["init"], v["objective"], 0))
            gap = math.log(conv) - math.log(v["control_ppl"])
            if gap <= 0:  # converted no worse than the control: no gap to close
                assert v["gap_closed"] is None
            else:
                assert v["gap_closed"] == pytest.approx((math.log(conv) - math.log(v["val_ppl"])) / gap)
    # the distilled target starts from the same conversion
    first = {(v["target"], v["init"], v["objective"]): v["val_ppl"] for v in r["variants"] if v["steps"] == 0}
    assert first[("mqa", "mean", "distill")] == first[("mqa", "mean", "next-token")]
    assert [c["steps"] for c in r["freeze"]["check"]] == steps
    assert set(r["freeze"]["trainable_params"]) == {"attention", "all"}
    assert r["freeze"]["trainable_params"]["attention"] < r["freeze"]["trainable_params"]["all"]
    assert r["done"] == [u.key for u in work_plan(cfg)]
    from multihead.lab.uptrain_lr import PROBE_FACTORS

    for key in r["done"]:  # every training's peak rate was chosen by the probe among lr x PROBE_FACTORS
        probe = r["lr"][key]
        assert any(probe["chosen"] == pytest.approx(cfg.lr * f) for f in PROBE_FACTORS), probe
        assert len(probe["candidates"]) == len(PROBE_FACTORS) and math.isfinite(probe["start"])
    assert r["worse_than_converted"] == [] and not res["diverged"]
    assert "uptrain.png" in res["plots"] and not (out / STATE).exists()
    assert "| control |" in r["table"] and r["summary"].startswith("Base model")
    assert not any(p.suffix in (".safetensors", ".pt", ".bin") for p in out.iterdir())  # no weights


def test_decode_time_is_each_generated_token_paired_with_the_base(quick, llama_folder):
    """decode_ms_per_token times the steps of a real greedy generate() (not its prefill) in
    rounds alternating with the base: a model made 20 ms slower per forward is 20 ms slower
    per token; and every trained target of a run carries its paired timing."""
    import copy
    import time

    import transformers

    from multihead.lab.decode_cost import _step_times, decode_ms_per_token

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_folder).eval()
    slow = copy.deepcopy(model)
    slow.model.register_forward_hook(lambda *args: time.sleep(0.02))
    prompt = torch.tensor([[1, 5, 9, 2]])
    assert len(_step_times(model, prompt, 5)) == 4  # one interval per token after the first
    d = decode_ms_per_token(slow, model, prompt, 5)
    assert d["ms_per_token"] - d["base_ms_per_token"] >= 18  # the sleep, at most a timer's rounding below
    assert d["ratio"] == pytest.approx(d["ms_per_token"] / d["base_ms_per_token"], rel=1e-2)
    assert decode_ms_per_token(model, model, prompt, 1) is None  # one new token: no decode step to time
    r = quick[0]["results"]
    assert set(r["control_decode"]) == {"ms_per_token", "base_ms_per_token", "ratio"}
    for v in r["variants"]:
        assert v["decode"]["ms_per_token"] > 0 and v["decode"]["base_ms_per_token"] > 0
    assert "decode ms/token (x base)" in r["table"]


def test_kv_bytes_are_the_cache_shapes(quick):
    """fp32: MHA 2 (K, V) x Hkv 2 x D 8 x 2 layers x 4 bytes; MQA one KV head; MLA-8 the latent
    of 8 + rope 4 per layer."""
    r = quick[0]["results"]
    assert r["base"]["kv_bytes_per_token"] == 2 * 2 * 8 * 2 * 4
    kv = {v["target"]: v["kv_bytes_per_token"] for v in r["variants"]}
    assert kv == {"mqa": 2 * 1 * 8 * 2 * 4, "mla-8": (8 + 4) * 2 * 4}


def test_held_out_ppl_is_the_models_own(quick, llama_folder):
    """The base's perplexity recomputed here: the model's logits on the same windows, NumPy float64."""
    import numpy as np

    from multihead.corpus import split_kjv as split

    cfg = _cfg(llama_folder)
    tok = transformers.AutoTokenizer.from_pretrained(llama_folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_folder, attn_implementation="eager").eval()
    ids = tok(split(cfg.max_train_chars)[1])["input_ids"]
    n = cfg.eval_context + 1
    nll = []
    for s in np.linspace(0, len(ids) - n, cfg.eval_windows).astype(np.int64):
        w = torch.tensor(ids[s:s + n])[None]
        with torch.no_grad():
            logits = model(w[:, :-1]).logits[0].double().numpy()
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        nll += list(-logp[np.arange(n - 1), w[0, 1:].numpy()])
    assert quick[0]["results"]["base"]["val_ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)


def test_same_seed_same_numbers_and_another_seed_others(quick, llama_folder, tmp_path):
    again = run_uptrain_hf(_cfg(llama_folder), tmp_path / "a", progress=False, plots=False)
    assert _numbers(again) == _numbers(quick[0])
    other = run_uptrain_hf(_cfg(llama_folder, inits=("mean",), ranks=(), distill=False, freeze_check=False),
                           tmp_path / "b", seed=1, progress=False, plots=False)
    assert other["results"]["control"][-1]["val_ppl"] != again["results"]["control"][-1]["val_ppl"]


@pytest.mark.parametrize("where", [("mqa/random", 4), ("mqa/mean/distill", 1)])
def test_ctrl_c_then_resume_equals_an_uninterrupted_run(quick, llama_folder, tmp_path, where):
    def stop(unit, step, loss):
        if (unit, step) == where:
            raise KeyboardInterrupt

    cfg = _cfg(llama_folder)
    part = run_uptrain_hf(cfg, tmp_path, callback=stop, progress=False, plots=False)
    assert part["interrupted"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["interrupted"] and where[0] not in saved["results"]["done"]
    assert (tmp_path / STATE).is_file()
    with pytest.raises(UsageError, match="--resume"):  # never overwritten by accident
        run_uptrain_hf(cfg, tmp_path, progress=False)
    with pytest.raises(UsageError, match="other settings"):
        run_uptrain_hf(replace(cfg, lr=1e-3), tmp_path, progress=False, resume=True)
    done = run_uptrain_hf(cfg, tmp_path, progress=False, resume=True, plots=False)
    assert not done["interrupted"] and not (tmp_path / STATE).exists()
    assert _numbers(done) == _numbers(quick[0])


def test_ctrl_c_inside_an_evaluation_then_resume(quick, llama_folder, tmp_path, monkeypatch):
    """Interrupted while evaluating after a step: the resumed run evaluates that step first."""
    from multihead.lab import uptrain_hf

    calls, real = [], uptrain_hf.held_out_ppl

    def flaky(*args):
        calls.append(1)
        if len(calls) == 6:  # the base, the control at 0, 3 and 6, MQA (mean) at 0, then MQA at 3
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(uptrain_hf, "held_out_ppl", flaky)  # a Ctrl-C injected at a step the test picks
    cfg = _cfg(llama_folder)
    assert run_uptrain_hf(cfg, tmp_path, progress=False, plots=False)["interrupted"]
    assert torch.load(tmp_path / STATE, weights_only=True)["step"] == 3
    monkeypatch.setattr(uptrain_hf, "held_out_ppl", real)  # the real evaluation again, for the resume
    done = run_uptrain_hf(cfg, tmp_path, progress=False, resume=True, plots=False)
    assert _numbers(done) == _numbers(quick[0])


def test_cli_runs_and_resumes(llama_folder, tmp_path, capsys):
    from multihead.cli import main

    out = tmp_path / "cli"
    argv = ["lab", "uptrain", "--model", str(llama_folder), "--quick", "--out", str(out), "--no-progress",
            "--rope-dim", "4", "--kv-ranks", "8", "--steps", "2", "--fractions", "0,1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| mla-8 | calibrated |" in printed and "results in" in printed
    assert main(argv) == 2  # the folder holds a run: refused without --resume
    assert "is not empty" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0  # a finished run resumed: nothing left to do, same numbers
    base = ["lab", "uptrain", "--model", str(llama_folder), "--quick", "--out", str(tmp_path / "x")]
    for bad, needle in ((["--rope-dim", "5"], "multiple of 4"), (["--rope-dim", "4", "--kv-ranks", "999"], "at most"),
                        (["--positions", "rope"], "--positions")):
        assert main([*base, *bad]) == 2
        assert needle in capsys.readouterr().err
    assert main(["lab", "uptrain", "--resume", "--out", str(tmp_path / "y")]) == 2
    assert "go with --model" in capsys.readouterr().err


def test_an_mla_target_with_its_own_rope_width(llama_folder, tmp_path, capsys):
    """--kv-ranks R+P converts that target at P RoPE dims (the others at --rope-dim): its name
    says so, its cache is measured at R + P values per token and layer, and its conversion is
    to_mla's at that width on the run's calibration tokens."""
    from multihead.cli import main

    out = tmp_path / "split"
    argv = ["lab", "uptrain", "--model", str(llama_folder), "--quick", "--out", str(out), "--no-progress",
            "--rope-dim", "4", "--kv-ranks", "8,6+8", "--steps", "1", "--fractions", "0,1", "--inits", "mean"]
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    first = {v["target"]: v for v in res["results"]["variants"] if v["steps"] == 0}
    assert {t for t in first if t.startswith("mla")} == {"mla-8", "mla-6+8"}
    layers = 2
    assert first["mla-8"]["kv_bytes_per_token"] == layers * (8 + 4) * 4
    assert first["mla-6+8"]["kv_bytes_per_token"] == layers * (6 + 8) * 4
    assert [v["tokens"] for v in res["results"]["variants"] if v["target"] == "mla-6+8"] == [0, 1 * 1 * 32]
    capsys.readouterr()
    base = ["lab", "uptrain", "--model", str(llama_folder), "--quick", "--out", str(tmp_path / "x")]
    for bad, needle in ((["--kv-ranks", "6+5"], "R+P"),
                        (["--kv-ranks", "6+6"], "--kv-ranks 6+6: the model has 2 KV heads"),
                        (["--kv-ranks", "30+8"], "--kv-ranks 30: at most"), (["--long"], "two presets")):
        assert main([*base, *bad]) == 2
        assert needle in capsys.readouterr().err
    assert main(["lab", "uptrain", "--quick", "--kv-ranks", "8+4", "--out", str(tmp_path / "y")]) == 2
    assert "goes with --model" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_long_preset_evaluates_at_the_tokens_it_names():
    """--long: 196 steps of 8 x 128 tokens, evaluated at 12,288, 50,176, 100,352 and 200,704
    tokens, the control, MQA (aligned) and MLA at 10,560 and 25,920 B/token on SmolLM2."""
    cfg = HFUptrainConfig.long()
    per_step = cfg.batch_size * cfg.context
    assert [s * per_step for s in cfg.eval_steps()] == [0, 12_288, 50_176, 100_352, 200_704]
    assert [u.key for u in work_plan(cfg)] == ["control", "mqa/aligned", "mla-64/calibrated", "mla-144+72/calibrated"]
    smollm2_layers, fp32 = 30, 4
    assert [smollm2_layers * (r + p) * fp32 for _, r, p in cfg.mla_targets()] == [10_560, 25_920]


def test_the_rate_probe_takes_the_best_rate_and_restores_the_weights():
    """On a quadratic whose steps overshoot at the largest rate, the probe picks a smaller one
    (the best check loss among the candidates, independently recomputed) and leaves the
    parameters as they were; when no rate helps it takes the smallest."""
    from multihead.lab.uptrain_lr import PROBE_FACTORS, choose_lr

    target = torch.tensor([3.0, -2.0])
    w = torch.nn.Parameter(torch.zeros(2))

    def loss_fn(batch):
        return ((w - target) ** 2).sum() * batch.float().mean()

    batches, check = [torch.ones(1)] * 3, torch.ones(1)
    chosen, probe = choose_lr([w], loss_fn, batches, check, 10.0)
    assert torch.equal(w.detach(), torch.zeros(2)) and w.grad is None
    losses = {}
    for f in PROBE_FACTORS:  # AdamW written out: after clipping, each step moves each weight by about the rate
        v = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.AdamW([v], lr=10.0 * f, betas=(0.9, 0.95), weight_decay=0.0)
        for _ in range(3):
            opt.zero_grad()
            ((v - target) ** 2).sum().backward()
            torch.nn.utils.clip_grad_norm_([v], 1.0)
            opt.step()
        losses[10.0 * f] = float(((v - target) ** 2).sum())
    assert chosen == min(losses, key=losses.get) and chosen < 10.0, (chosen, losses)
    assert probe["start"] == pytest.approx(13.0) and probe["chosen"] == chosen
    w2 = torch.nn.Parameter(target.clone())  # at the minimum already: nothing lowers the loss
    chosen, _ = choose_lr([w2], lambda b: ((w2 - target) ** 2).sum(), batches, check, 1.0)
    assert chosen == pytest.approx(min(PROBE_FACTORS))


def test_a_training_worse_than_its_conversion_is_marked():
    from multihead.lab.uptrain_hf import summarise_uptrain_hf

    cfg = HFUptrainConfig(model="x", steps=4, fractions=(0.0, 1.0), warmup=1)
    entry = {"init": "calibrated", "objective": "next-token", "kv_bytes_per_token": 8}
    res = {"results": {"model": "x", "base": {"val_ppl": 10.0, "kv_bytes_per_token": 16}, "dtype": "float32",
                       "control": [{"steps": 0, "val_ppl": 10.0}, {"steps": 4, "val_ppl": 9.0}],
                       "variants": [{**entry, "target": "mla-8", "steps": 0, "val_ppl": 50.0},
                                    {**entry, "target": "mla-8", "steps": 4, "val_ppl": 70.0},
                                    {**entry, "target": "mla-4", "steps": 0, "val_ppl": 50.0},
                                    {**entry, "target": "mla-4", "steps": 4, "val_ppl": 20.0}],
                       "seconds": {}, "freeze": {"frozen": "x", "check": [], "seconds_per_step": {}}}}
    summarise_uptrain_hf(cfg, res)
    r = res["results"]
    assert r["worse_than_converted"] == ["mla-8/calibrated"]
    assert [v.get("worse_than_converted", False) for v in r["variants"]] == [False, True, False, False]
    assert ("Worse than as converted at an evaluated step (marked worse_than_converted): mla-8/calibrated."
            in r["summary"])


def test_force_never_replaces_a_folder_that_holds_the_input(llama_folder, tmp_path, capsys):
    """--out RUN --force with the model in RUN/model (or RUN itself the model, or --out
    inside it) is refused before anything runs: replacing RUN would delete the model."""
    import shutil

    from multihead.cli import main

    run = tmp_path / "run"
    shutil.copytree(llama_folder, run / "model")
    (run / "results.json").write_text("{}", encoding="utf-8")  # an earlier run's folder, which --force replaces
    before = sorted(p.name for p in (run / "model").iterdir())
    flags = ["--quick", "--no-progress", "--rope-dim", "4", "--kv-ranks", "8", "--steps", "1", "--fractions", "0"]
    for model, out, needle in ((run / "model", run, "holds the model's own folder"),
                               (run, run, "holds the model's own folder"),  # a lab run's folder: its model/
                               (run / "model", run / "model", "is inside the model's own folder"),
                               (run / "model", run / "model" / "sub", "is inside the model's own folder")):
        assert main(["lab", "uptrain", "--model", str(model), "--out", str(out), "--force", *flags]) == 2
        assert needle in capsys.readouterr().err
        assert sorted(p.name for p in (run / "model").iterdir()) == before
    assert not (run / "model" / "sub").exists()
    # the lab model's uptrain reads --from RUN: the same rule
    assert main(["lab", "uptrain", "--from", str(run), "--out", str(run), "--force", "--quick"]) == 2
    assert "the --from run's own folder" in capsys.readouterr().err
    assert (run / "model" / "config.json").is_file()


def test_the_shared_check_protects_a_model_folder_and_a_text_file(tmp_path):
    """files.check_out_apart (heads prune and every lab run): a model's folder is protected
    whole, a text file (lab mla --corpus) only itself, so an --out beside it is fine."""
    from multihead.files import check_out_apart

    (tmp_path / "data").mkdir()
    text = tmp_path / "data" / "bible.txt"
    text.write_text("x", encoding="utf-8")
    out, folder = check_out_apart("--out", tmp_path / "data" / "run", text, tool="lab mla", what="the corpus",
                                  file_only=True)
    assert out == (tmp_path / "data" / "run").resolve() and folder == (tmp_path / "data").resolve()
    for bad in (tmp_path / "data", tmp_path):
        with pytest.raises(UsageError, match=r"holds the corpus .*bible.txt'; replacing it would delete"):
            check_out_apart("--out", bad, text, tool="lab mla", what="the corpus", file_only=True)
    with pytest.raises(UsageError, match=r"is inside the model's own folder .*; lab uptrain never writes there"):
        check_out_apart("--out", tmp_path / "data" / "run", text, tool="lab uptrain")


def test_a_failed_start_leaves_no_output_folder(llama_folder, tmp_path, capsys):
    """A model that is not there, or one that loads but cannot be converted as asked,
    stops the run before --out is made."""
    from multihead.cli import main

    cases = ((["--model", str(tmp_path / "nonexistent")], "not found"),
             (["--model", str(llama_folder), "--rope-dim", "4", "--kv-ranks", "999"], "at most"))
    for flags, needle in cases:
        out = tmp_path / "new"
        assert main(["lab", "uptrain", *flags, "--quick", "--out", str(out), "--no-progress"]) == 2
        assert needle in capsys.readouterr().err
        assert not out.exists()
    with pytest.raises(UsageError, match="at most"):
        run_uptrain_hf(_cfg(llama_folder, ranks=(999,)), tmp_path / "direct", progress=False)
    assert not (tmp_path / "direct").exists()


def test_a_gemma3_folder_is_refused_with_the_converters_reasons(llama_folder, tmp_path, capsys):
    """Gemma 3 loads as a causal LM, but neither conversion applies (QK-norm for MLA, one KV
    head already for MQA): the refusal gives those reasons, not "not a Llama-family model"."""
    from multihead.cli import main

    folder = tmp_path / "tiny-gemma3"
    cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                        max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(llama_folder).save_pretrained(folder)
    out = tmp_path / "new"
    assert main(["lab", "uptrain", "--model", str(folder), "--quick", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "lab uptrain converts the model to MQA and to MLA" in err
    assert "QK-norm" in err and "has one key/value head already" in err
    assert not out.exists()


@pytest.mark.slow
def test_quick_on_smollm2(tmp_path):
    """The documented `--quick` on the bundled SmolLM2: every target, fp32 KV bytes from a
    real cache (30 layers: MHA 3 KV heads of 64, MQA 1, MLA-64 with 24 RoPE dims)."""
    pytest.importorskip("gguf")
    from multihead.interop.loaders import InspectError, smollm2_path

    try:
        smollm2_path()
    except InspectError as err:
        pytest.skip(str(err))
    res = run_uptrain_hf(HFUptrainConfig.quick(), tmp_path, progress=False)
    r = res["results"]
    assert not res["interrupted"]
    assert r["base"]["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    kv = {v["target"]: v["kv_bytes_per_token"] for v in r["variants"]}
    assert kv == {"mqa": 30 * 2 * 64 * 4, "mla-64": 30 * (64 + 24) * 4}
    conv = {(v["target"], v["init"]): v["val_ppl"] for v in r["variants"] if v["steps"] == 0}
    # conversion without uptraining hurts a real model, random K/V most
    assert r["base"]["val_ppl"] < conv[("mqa", "mean")] < conv[("mqa", "random")]


def _committed_run(folder: str) -> dict:
    """docs/lab/<folder>/results.json, checked against the schema (skipped where not committed)."""
    from pathlib import Path

    from multihead.lab.results import check_results

    committed = Path(__file__).resolve().parent.parent / "docs" / "lab" / folder / "results.json"
    if not committed.is_file():
        pytest.skip(f"no committed run in docs/lab/{folder} yet")
    return check_results(json.loads(committed.read_text(encoding="utf-8")), committed.parent,
                         required=["base", "control", "variants", "summary", "table"])


def test_the_docs_quote_the_committed_run():
    """docs/lab.md's SmolLM2 section quotes the committed run's table and summary verbatim,
    and the summary is what the current code writes from the committed numbers."""
    from pathlib import Path

    from multihead.lab.uptrain_hf import summarise_uptrain_hf

    root = Path(__file__).resolve().parent.parent
    res = _committed_run("uptrain-smollm2")
    doc = (root / "docs" / "lab.md").read_text(encoding="utf-8")
    section = doc[doc.index("`multihead lab uptrain --model smollm2`"):]
    r = res["results"]
    assert r["table"] in section and r["summary"] in section
    cfg_fields = {k: tuple(v) if isinstance(v, list) else v for k, v in res["config"].items()}
    again = json.loads(json.dumps(res))
    summarise_uptrain_hf(HFUptrainConfig(**cfg_fields), again)
    assert (again["results"]["table"], again["results"]["summary"]) == (r["table"], r["summary"])
    assert not res["interrupted"] and res["results"]["model"] == "smollm2"


def test_every_number_the_docs_quote_of_the_committed_run_is_one_of_its_results():
    """docs/lab.md's SmolLM2 section, outside its code blocks and its table and summary
    (checked verbatim above): each decimal and each comma-grouped integer is a number of the
    committed results.json at the places quoted (a percentage: 100 times one; minutes: its
    seconds / 60), so a new run that changes them fails until the page says the new ones."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    committed = root / "docs" / "lab" / "uptrain-smollm2" / "results.json"
    if not committed.is_file():
        pytest.skip("no committed SmolLM2 run yet")
    res = json.loads(committed.read_text(encoding="utf-8"))
    r = res["results"]
    doc = (root / "docs" / "lab.md").read_text(encoding="utf-8")
    start = doc.index("### A real model: `multihead lab uptrain --model smollm2`")
    end = doc.find("\n### ", start + 1)
    section = re.sub(r"```.*?```", "", doc[start:end if end > 0 else len(doc)], flags=re.S)
    section = section.replace(r["table"], "").replace(r["summary"], "")

    pool = json_numbers(r) + [res["elapsed_s"] / 60, res["cpu_s"] / 60, res["config"]["lr"],
                         r["freeze"]["cpu_seconds_per_step"]["all"] / r["freeze"]["cpu_seconds_per_step"]["attention"],
                         math.sqrt(1 - 1 / 3), float(".".join(res["torch_version"].split(".")[:2]))]
    pool += [v["kv_bytes_per_token"] / r["base"]["kv_bytes_per_token"] for v in r["variants"]]
    cfg = res["config"]
    pool += [cfg["steps"] * cfg["batch_size"] * cfg["context"]]  # tokens per target
    missing = unquoted_numbers(section, pool)
    assert not missing, f"docs/lab.md quotes {missing}, which no number of the committed run rounds to"


# what docs/lab.md cites of MHA2MLA (Ji et al., 2025, arXiv 2502.14837v1: Table 1, SmolLM-135M, and
# Table 4, its fine-tuning): the anchor the longer curve is read against, not a result of this project
MHA2MLA_SMOLLM_135M = {
    "arxiv": 2502.14837, "tokens_billion": 2.25, "per_mille_of_pretraining": 3.8, "pretraining_billion": 600,
    "steps": 18_000, "sequence": 2_048,
    "average": {"original": 44.50, "full rope": 44.25, "d_kv 32": 43.06, "d_kv 16": 41.84, "d_kv 8": 40.97},
    "cache_reduction_pct": {"d_kv 32": 68.75, "d_kv 16": 81.25, "d_kv 8": 87.50},
    "points_below_full_rope": {"d_kv 32": 1.19, "d_kv 16": 2.41, "d_kv 8": 3.28},
}


def test_the_docs_quote_the_committed_longer_curve():
    """docs/lab.md's longer-curve section quotes the committed `--long` run's table and summary
    verbatim (the summary what the current code writes from its numbers); the run is the
    preset, uninterrupted, with nothing diverged; and each decimal and comma-grouped integer of
    the section is one of the run's numbers (a percentage: 100 times one; minutes: seconds / 60;
    tokens: steps x 8 x 128) or one of MHA2MLA's that the section cites."""
    from pathlib import Path

    from multihead.lab.uptrain_hf import summarise_uptrain_hf

    root = Path(__file__).resolve().parent.parent
    res = _committed_run("uptrain-smollm2-long")
    r, cfg = res["results"], res["config"]
    fields = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
              for k, v in cfg.items()}
    assert HFUptrainConfig(**fields) == HFUptrainConfig.long()
    assert not res["interrupted"] and not res["diverged"] and r["worse_than_converted"] == []
    assert r["done"] == [u.key for u in work_plan(HFUptrainConfig.long())]
    again = json.loads(json.dumps(res))
    summarise_uptrain_hf(HFUptrainConfig.long(), again)
    assert (again["results"]["table"], again["results"]["summary"]) == (r["table"], r["summary"])
    doc = (root / "docs" / "lab.md").read_text(encoding="utf-8")
    start = doc.index("### A longer curve: `multihead lab uptrain --model smollm2 --long`")
    end = doc.find("\n### ", start + 1)
    section = doc[start:end if end > 0 else len(doc)]
    assert r["table"] in section and r["summary"] in section
    section = re.sub(r"```.*?```", "", section, flags=re.S).replace(r["table"], "").replace(r["summary"], "")

    per_step = cfg["batch_size"] * cfg["context"]
    pool = json_numbers(r) + json_numbers(MHA2MLA_SMOLLM_135M) + [res["elapsed_s"] / 60, res["cpu_s"] / 60]
    pool += [s * per_step for s in HFUptrainConfig.long().eval_steps()]
    pool += [v["kv_bytes_per_token"] / r["base"]["kv_bytes_per_token"] for v in r["variants"]]
    pool += [1 - v["kv_bytes_per_token"] / r["base"]["kv_bytes_per_token"] for v in r["variants"]]
    pool += [v["val_ppl"] / r["base"]["val_ppl"] for v in r["variants"]]
    pool += [v["val_ppl"] / v["control_ppl"] for v in r["variants"] if v["control_ppl"]]
    pool += [MHA2MLA_SMOLLM_135M["tokens_billion"] * 1e9 / (cfg["steps"] * per_step)]
    missing = unquoted_numbers(section, pool)
    assert not missing, f"docs/lab.md quotes {missing}, which no number of the longer curve rounds to"

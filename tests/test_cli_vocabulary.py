"""One CLI vocabulary: flags spelled in full in every subcommand (an abbreviation is refused
with the flag it abbreviates), the shared flags defined once (multihead.cli_args), and an old
spelling refused with the new one named."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from conftest import parser_actions, subcommands
from multihead import cli_args
from multihead.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) for the parser and every subparser below it."""
    yield path, parser
    for name, sub in subcommands(parser).items():
        yield from _parsers(sub, path + (name,))


PARSERS = dict(_parsers(build_parser()))
LEAVES = {path: p for path, p in PARSERS.items() if not subcommands(p)}


def run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def test_the_tree_is_every_subcommand():
    # the walk is not vacuous: every tool and every experiment and heads subcommand is reached
    assert {("plan",), ("inspect",), ("tour",), ("heads", "scan"), ("heads", "path"), ("heads", "circuit"),
            ("heads", "induction"), ("heads", "importance"), ("heads", "prune"), ("lab", "heads"), ("lab", "kv"),
            ("lab", "mla"), ("lab", "induction"), ("lab", "uptrain")} <= set(LEAVES)


@pytest.mark.parametrize("path", sorted(PARSERS), ids=lambda p: " ".join(p) or "multihead")
def test_no_parser_matches_prefixes(path):
    assert PARSERS[path].allow_abbrev is False


def _abbreviation(parser) -> tuple[str, str]:
    """A long flag of the parser and a prefix of it that is no flag of its own."""
    flags = {flag for action in parser_actions(parser) for flag in action.option_strings}
    for action in parser_actions(parser):
        for flag in action.option_strings:
            if flag.startswith("--") and len(flag) > 5 and flag != "--help" and action.help != argparse.SUPPRESS:
                prefix = flag[:-2]
                if prefix not in flags:
                    return flag, prefix
    raise AssertionError(f"no long flag in {parser.prog}")


def _required(parser) -> list[str]:
    return [x for a in parser_actions(parser) if a.required and a.option_strings for x in (a.option_strings[0], "x")]


@pytest.mark.parametrize("path", sorted(LEAVES), ids=" ".join)
def test_an_abbreviation_is_refused_with_the_full_flag(path):
    parser = LEAVES[path]
    flag, prefix = _abbreviation(parser)
    code, err = run([*path, *_required(parser), prefix, "1"])
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"multihead {' '.join(path)}: error: {prefix} is not a flag"), line
    assert flag in line, line


def test_the_abbreviations_the_issue_measured():
    code, err = run(["plan", "--mod", "llama-3-8b", "--cont", "8k"])
    assert code == 2 and "--mod is not a flag" in err and "did you mean --model?" in err
    code, err = run(["plan", "--model", "llama-3-8b", "--cont", "8k"])
    assert code == 2 and "did you mean --context?" in err
    # an ambiguous one names every flag it could abbreviate
    code, err = run(["lab", "heads", "--see", "1"])
    assert code == 2 and "did you mean --seed or --seeds?" in err
    # a refused old spelling is never offered: --conf (once --config) abbreviates no flag of plan's now
    code, err = run(["plan", "--conf", "llama-3-8b"])
    assert code == 2 and "--config" not in err and "did you mean" not in err, err
    # the full spelling, with = too, still works
    assert build_parser().parse_args(["plan", "--model=llama-3-8b", "--context", "8k"]).context == "8k"


# (subcommand, old spelling, new spelling): each old one is refused with the new one named
RENAMED = [(("lab", experiment), "--seq-len", "--context") for experiment in ("heads", "induction")] + [
    (("lab", experiment), "--n-kv-heads", "--kv-head-counts") for experiment in ("kv", "mla", "uptrain")] + [
    (("plan",), "--device", "--accelerator"), (("plan",), "--devices", "--n-accelerators"),
    (("plan",), "--list-devices", "--list-accelerators"), (("plan",), "--config", "--model"),
    (("plan",), "--list-configs", "--list-models")]


@pytest.mark.parametrize("path, old, new", RENAMED, ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_an_old_spelling_is_refused_with_the_new_one(path, old, new):
    parser = LEAVES[path]
    code, err = run([*path, *_required(parser), old, "8"])
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"multihead {' '.join(path)}: error: {old} is now {new}"), line
    assert new in _visible(parser) and old not in _visible(parser)
    assert old not in parser.format_help().replace(new, "")


def test_the_refusal_says_why_where_the_old_spelling_means_something_else():
    for experiment in ("heads", "induction"):
        code, err = run(["lab", experiment, "--quick", "--seq-len", "8"])
        assert err.strip().splitlines()[-1] == f"multihead lab {experiment}: error: --seq-len is now --context"
        assert build_parser().parse_args(["lab", experiment, "--context", "8"]).seq_len == 8
    code, err = run(["plan", "--params", "7B", "--device", "h100-80gb"])
    assert err.strip().endswith("--device is now --accelerator (--device is where torch runs, in lab; plan "
                                "names an accelerator preset)"), err
    code, err = run(["lab", "kv", "--n-kv-heads", "4,2"])
    assert err.strip().endswith("--n-kv-heads is now --kv-head-counts (a list of n_kv_heads to compare; "
                                "--n-kv-heads is one count)"), err


def _visible(parser) -> dict[str, argparse.Action]:
    """flag -> action of the flags --help shows (an old spelling refused is hidden)."""
    return {flag: a for a in parser_actions(parser) if a.help != argparse.SUPPRESS for flag in a.option_strings}


def test_every_parser_is_the_shared_parser():
    for path, parser in PARSERS.items():
        assert isinstance(parser, cli_args.Parser), path


def test_one_spelling_per_concept():
    """Across every subcommand: a concept has one flag, and a flag one meaning."""
    for path, parser in LEAVES.items():
        flags = _visible(parser)
        # the model is --model; --from stays only where it names a run folder to start from (lab uptrain)
        assert "--config" not in flags, path
        assert "--from" not in flags or path == ("lab", "uptrain"), path
        # a sequence length is --context TOKENS (heads' --length counts random tokens per half)
        assert not {"--seq-len", "--seq-length", "--sequence-length", "--max-len"} & set(flags), path
        if "--context" in flags:
            assert flags["--context"].metavar == "TOKENS", path
        # --device is where torch runs; an accelerator preset to plan for is plan's --accelerator
        if "--device" in flags:
            device = flags["--device"]
            assert tuple(device.choices) == cli_args.TORCH_DEVICES and device.default == "auto", path
        assert "--accelerator" not in flags or path == ("plan",), path
        # --n-kv-heads is one count; a list of counts to compare is --kv-head-counts
        if "--n-kv-heads" in flags:
            assert flags["--n-kv-heads"].metavar == "N" and flags["--n-kv-heads"].nargs is None, path
        if "--kv-head-counts" in flags:
            assert flags["--kv-head-counts"].metavar == "LIST", path
        assert not {"--kv-heads", "--devices", "--list-configs", "--list-devices"} & set(flags), path
        # every subcommand prints JSON on request
        assert isinstance(flags.get("--json"), argparse._StoreTrueAction), path
    contexts = {p for p, parser in LEAVES.items() if "--context" in _visible(parser)}
    assert {("plan",), ("tour",), ("lab", "heads"), ("lab", "kv"), ("lab", "mla"), ("lab", "induction")} <= contexts
    devices = {p for p, parser in LEAVES.items() if "--device" in _visible(parser)}
    assert devices == {("lab", name) for name in ("heads", "kv", "mla", "induction", "uptrain")}, devices
    parse = build_parser().parse_args
    assert parse(["lab", "induction", "--n-kv-heads", "4"]).n_kv_heads == 4
    assert parse(["lab", "kv", "--kv-head-counts", "4,2"]).kv_heads == (4, 2)
    assert parse(["plan", "--params", "7B", "--n-kv-heads", "4"]).n_kv_heads == "4"  # a size plan reads itself
    assert parse(["plan", "--params", "7B", "--accelerator", "a100-80gb"]).accelerator == "a100-80gb"
    assert parse(["tour", "--context", "64"]).context == 64


def _model_actions():
    for path, parser in LEAVES.items():
        for action in parser_actions(parser):
            if "--model" in action.option_strings:
                yield path, action


def test_one_model_help():
    texts = {}
    for path, action in _model_actions():
        texts.setdefault(action.help, []).append(" ".join(path))
    # lab uptrain (a model to convert) loads fewer kinds; plan reads a model's config, or a preset's
    own = {("lab", "uptrain"), ("plan",)}
    shared = {p for p, a in _model_actions() if p not in own}
    assert len(shared) >= 6, shared  # inspect and the five heads commands that load any model
    assert dict(_model_actions())[("plan",)].metavar == "NAME|PATH"
    for path, action in _model_actions():
        if path in own:
            continue
        shared_texts = {cli_args.model_help(action.default, decoder, lab) for decoder in (False, True)
                        for lab in (False, True)}
        assert action.help in shared_texts, path
        assert action.default in action.help
    for word in ("minilm", "smollm2", "gemma3", ".gguf", "folder", "`multihead lab` checkpoint"):
        assert word in cli_args.model_help("minilm"), word
    assert "minilm" not in cli_args.model_help("smollm2", decoder=True)
    # a command that needs a transformers model does not offer a lab checkpoint
    assert "lab" not in cli_args.model_help("smollm2", decoder=True, lab=False)
    assert cli_args.model_help("smollm2", decoder=True, lab=False).startswith("a transformers decoder")


def test_shared_flags_mean_the_same_everywhere():
    seen = {"--seed": 0, "--json": 0, "--out": 0, "--threads": 0}
    for path, parser in LEAVES.items():
        for action in parser_actions(parser):
            if "--seed" in action.option_strings:
                seen["--seed"] += 1
                assert action.type is cli_args.seed and action.default == 0, path
            if "--json" in action.option_strings:
                seen["--json"] += 1
                assert isinstance(action, argparse._StoreTrueAction), path
            if "--threads" in action.option_strings:
                seen["--threads"] += 1
                assert action.type is cli_args.add_threads(argparse.ArgumentParser(), "").type, path
                assert action.default is None and action.metavar == "N", path
            if "--out" in action.option_strings:
                seen["--out"] += 1
                assert action.metavar == "DIR", path
    assert seen["--seed"] >= 8 and seen["--json"] >= 7 and seen["--out"] >= 7, seen
    # every command that runs a model: all but plan (arithmetic) and tour (a few float64 layers)
    threads = {p for p, parser in LEAVES.items() if "--threads" in _visible(parser)}
    assert threads == set(LEAVES) - {("plan",), ("tour",)}, threads
    assert seen["--threads"] == len(threads) >= 12, seen
    code, err = run(["heads", "scan", "--seed", "-1"])
    assert code == 2 and "expected a seed in 0 .. 2**63 - 1" in err


def test_the_parser_class_refuses_prefixes_by_itself():
    p = cli_args.Parser(prog="x", allow_abbrev=True)  # the class wins over a caller's allow_abbrev
    p.add_argument("--context")
    assert p.parse_args(["--context", "1"]).context == "1"
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        p.parse_args(["--cont", "1"])
    assert "did you mean --context?" in err.getvalue()


def test_heads_prune_prints_json(tmp_path):
    transformers = pytest.importorskip("transformers")
    import json

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[PAD]", "the", "cat", "sat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=len(words),
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=16, bos_token_id=None, eos_token_id=None, pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "llama")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(
        tmp_path / "llama")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["heads", "prune", "--model", str(tmp_path / "llama"), "--remove", "0.2,0.3,1.0,1.1", "--out",
                     str(tmp_path / "pruned"), "--json"])
    assert code == 0
    r = json.loads(out.getvalue())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    assert r["removed"] == [[0, 2], [0, 3], [1, 0], [1, 1]] and r["out"] == str(tmp_path / "pruned")
    assert (r["num_attention_heads"], r["num_key_value_heads"]) == (2, 1)
    assert r["params_before"] == sum(p.numel() for p in model.parameters())
    assert r["params"] == sum(p.numel() for p in back.parameters())
    # 2 of 4 query heads (8 dims each) go from q and o, 1 of 2 key/value heads from k and v, in 2 layers
    assert r["params_before"] - r["params"] == 2 * (2 * 2 * 8 * 32 + 2 * 1 * 8 * 32)


def test_threads_set_torch_for_the_run_and_restore_it():
    import torch

    from multihead.cli_args import torch_threads

    before = torch.get_num_threads()
    with torch_threads(None):
        assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"), torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    assert build_parser().parse_args(["heads", "scan", "--threads", "3"]).threads == 3
    code, err = run(["heads", "path", "--receivers", "logits", "--threads", "0"])
    assert code == 2 and "--threads: expected a positive integer" in err, err

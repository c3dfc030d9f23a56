"""Tokenization as each real model expects, on both bundled decoders: Gemma 3's tokenizer puts
`<bos>` before every text and the model needs it (without it IOI reads upside down);
SmolLM2's puts nothing, and then nothing is added.

Each tool is run as a user runs it (the CLI, or the library call) on the session's loaded
model, whose first forward records the ids it was fed and stops the run: every sequence
must start with the tokenizer's BOS where it adds one, and with no special token where it
adds none. Slow: each model loads once per module (Gemma 3: ~35 s from the float32 cache)."""

from __future__ import annotations

import pytest
import torch

from multihead.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def loaded(request):
    from multihead.interop.loaders import InspectError, load_model

    try:
        return load_model(request.param)
    except InspectError as err:  # the package is not installed (Gemma 3's is optional)
        pytest.skip(str(err))


class _Seen(BaseException):
    """Raised by the hook at the first forward: not an Exception, so no CLI boundary catches it."""


@pytest.fixture()
def first_forward(loaded):
    """Runs a callable until the model's first forward; returns the input_ids `(B, T)` fed to it."""
    def run(call):
        seen = {}

        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            seen["ids"] = ids.detach().clone()
            raise _Seen
        handle = loaded.model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with pytest.raises(_Seen):
                call()
        finally:
            handle.remove()
        return seen["ids"]
    return run


def _starts_as_the_tokenizer_starts(loaded, ids: torch.Tensor) -> None:
    from multihead.tokens import prefix

    tok = loaded.tokenizer
    start = prefix(tok)
    if start:  # Gemma: <bos> first, in every row
        assert start == [tok.bos_token_id]
        assert (ids[:, 0] == tok.bos_token_id).all(), ids[:, :3]
        assert not (ids[:, 1:2] == tok.bos_token_id).any()  # and only once
    else:  # SmolLM2: no special token put in front
        special = set(tok.all_special_ids)
        assert not set(ids[:, 0].tolist()) & special, ids[:, :3]


CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


@pytest.mark.parametrize("argv", [
    ["heads", "scan", "--task", "ioi", "--n", "2"],
    ["heads", "scan", "--task", "induction", "--n", "2", "--length", "8"],
    ["heads", "scan", "--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", "Mary", "--wrong", "John"],
    ["heads", "path", "--task", "ioi", "--n", "2", "--receivers", "logits"],
    ["heads", "path", "--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", "Mary", "--wrong", "John",
     "--receivers", "logits"],
    ["heads", "induction", "--n", "2", "--length", "8"],
    ["heads", "importance", "--text", "In the beginning God created the heaven and the earth."],
    ["inspect", "In the beginning God created the heaven and the earth."],
    ["inspect", "In the beginning God created the heaven and the earth.", "--roles"],
], ids=["scan-ioi", "scan-induction", "scan-pair", "path-ioi", "path-pair", "induction", "importance", "inspect",
        "inspect-roles"])
def test_every_cli_tool_feeds_the_model_its_own_bos(loaded, first_forward, argv, capsys):
    model = "smollm2" if "SmolLM2" in loaded.name or "smollm2" in loaded.name else "gemma3"
    ids = first_forward(lambda: main([*argv[:2], "--model", model, *argv[2:]]) if argv[0] == "heads"
                        else main([argv[0], "--model", model, *argv[1:]]))
    capsys.readouterr()
    _starts_as_the_tokenizer_starts(loaded, ids)


def test_the_library_tools_and_windows_start_as_the_tokenizer_starts(loaded, first_forward):
    from multihead.heads import prune_curve, tasks
    from multihead.inspect import summaries
    from multihead.lab import uptrain_hf

    tok = loaded.tokenizer
    _starts_as_the_tokenizer_starts(loaded, tasks.ioi(4, tokenizer=tok).clean["input_ids"])
    _starts_as_the_tokenizer_starts(loaded, tasks.induction(3, 6, vocab=tok).clean)
    _starts_as_the_tokenizer_starts(loaded, first_forward(lambda: summaries(loaded, "And God said, Let there be "
                                                                                     "light: and there was light.")))
    _starts_as_the_tokenizer_starts(loaded, prune_curve.kjv_windows(tok, 3, 32, held_out=True))
    cfg = uptrain_hf.HFUptrainConfig.quick()
    data = uptrain_hf._Data(tok, cfg, seed=0)  # what `lab uptrain --model` trains and evaluates on
    _starts_as_the_tokenizer_starts(loaded, data.windows)
    _starts_as_the_tokenizer_starts(loaded, data.batch(1))
    assert data.windows.shape == (cfg.eval_windows, cfg.eval_context + 1)
    assert data.batch(1).shape == (cfg.batch_size, cfg.context + 1)


def test_ioi_clean_is_positive_and_corrupted_negative(loaded):
    """Wang et al.'s task read as the model reads text: on Gemma 3 without <bos> the signs flip."""
    from multihead.heads import tasks

    t = tasks.ioi(8, tokenizer=loaded)
    with torch.no_grad():
        clean = t.logit_diff(loaded.model(**t.clean).logits)
        corrupted = t.logit_diff(loaded.model(**t.corrupted).logits)
    assert clean.mean() > 1 and corrupted.mean() < -1, (clean, corrupted)
    assert (clean > corrupted).float().mean() >= 0.75, (clean, corrupted)  # pair by pair, not only on average


def test_induction_length_counts_the_bos_within_the_positions(loaded, capsys):
    from multihead.tokens import prefix

    model = "smollm2" if "smollm2" in loaded.name.lower() else "gemma3"
    start, limit = len(prefix(loaded.tokenizer)), loaded.max_positions
    length = (limit - start) // 2 + 1  # one past what fits: 2 * 16384 + <bos> is 32,769 on Gemma's 32,768
    code = main(["heads", "induction", "--model", model, "--length", str(length)])
    err = capsys.readouterr().err
    assert code == 2 and f"makes sequences of {2 * length + start} tokens" in err, err
    assert f"give --length <= {(limit - start) // 2}" in err, err

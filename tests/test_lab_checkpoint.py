"""lab.checkpoint: save, load and capture a lab model, and open it through multihead.inspect."""

from __future__ import annotations

import pytest
import torch


def test_checkpoint_round_trip_and_inspect(tmp_path, one_torch_thread):
    from multihead.lab.checkpoint import Vocab, capture_lab, load_lab_checkpoint, save_lab_checkpoint
    from multihead.lab.models import LabConfig, LabTransformer

    for arch in ({}, {"attention": "mla", "kv_rank": 4}, {"n_kv_heads": 1, "mlp": False}):
        cfg = LabConfig(vocab_size=5, max_len=12, d_model=16, n_layers=2, n_heads=2, **arch)
        model = LabTransformer(cfg).eval()
        vocab = Vocab("symbols", ("a", "b", "c", "d", "SEP"))
        save_lab_checkpoint(tmp_path / "m", model, vocab, experiment="heads")
        loaded, v2, meta = load_lab_checkpoint(tmp_path / "m")
        assert loaded.cfg == cfg and v2 == vocab and meta["experiment"] == "heads"
        x = torch.tensor([vocab.encode("a b c SEP a b")])
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
        cap = capture_lab(tmp_path / "m", "a b c SEP a b", layers=[1], heads=[0])
        assert cap.weights.shape == (1, 1, 6, 6) and cap.tokens[3] == "SEP"
        torch.testing.assert_close(cap.weights.sum(-1), torch.ones(1, 1, 6))
    with pytest.raises(ValueError, match="does not know"):
        capture_lab(tmp_path / "m", "a z")
    with pytest.raises(ValueError, match="out of range"):
        capture_lab(tmp_path / "m", "a b", layers=[2])
    with pytest.raises(ValueError, match="not a multihead lab checkpoint"):
        load_lab_checkpoint(tmp_path)
    # multihead.inspect opens it through its own loader (the same weights)
    from multihead.inspect.capture import capture

    got = capture("a b c SEP a b", model=str(tmp_path / "m"))
    torch.testing.assert_close(got.weights, capture_lab(tmp_path / "m", "a b c SEP a b").weights)

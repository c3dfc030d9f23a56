"""The lab checkpoint format (multihead.checkpoint):
save and load a lab model, and open it through multihead.inspect."""

from __future__ import annotations

import pytest
import torch


def test_checkpoint_round_trip_and_inspect(tmp_path, one_torch_thread):
    from multihead.checkpoint import Vocab, load_lab_checkpoint, save_lab_checkpoint
    from multihead.decoder import LabConfig, LabTransformer
    from multihead.inspect.capture import capture
    from multihead.interop.loaders import InspectError

    vocab = Vocab("symbols", ("a", "b", "c", "d", "SEP"))
    x = torch.tensor([vocab.encode("a b c SEP a b")])
    for i, arch in enumerate(({}, {"attention": "mla", "kv_rank": 4}, {"n_kv_heads": 1, "mlp": False})):
        cfg = LabConfig(vocab_size=5, max_len=12, d_model=16, n_layers=2, n_heads=2, **arch)
        model = LabTransformer(cfg).eval()
        folder = tmp_path / f"m{i}"
        save_lab_checkpoint(folder, model, vocab, experiment="heads")
        loaded, v2, meta = load_lab_checkpoint(folder)
        assert loaded.cfg == cfg and v2 == vocab and meta["experiment"] == "heads"
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
        # multihead.inspect opens it through its own loader: the weights of the saved model
        cap = capture("a b c SEP a b", model=str(folder), layers=[1], heads=[0])
        assert cap.tokens[3] == "SEP"
        with torch.no_grad():
            _, want = model(x, return_weights=True, layers=[1], heads=[0])
        torch.testing.assert_close(cap.weights, want[1].float(), rtol=0, atol=0)
    with pytest.raises(InspectError, match="does not know"):
        capture("a z", model=str(tmp_path / "m0"))
    with pytest.raises(InspectError, match="out of range"):
        capture("a b", model=str(tmp_path / "m0"), layers=[2])
    with pytest.raises(ValueError, match="not a multihead lab checkpoint"):
        load_lab_checkpoint(tmp_path)


def test_each_name_has_one_home():
    import importlib

    import multihead.lab

    for gone in ("multihead.lab.models", "multihead.lab.checkpoint"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)
    assert "load_lab_checkpoint" not in dir(multihead.lab)

"""lab.training: the training loop stops cleanly on Ctrl-C."""

from __future__ import annotations

import torch

from multihead.lab.training import train


def test_train_stops_cleanly_on_ctrl_c(one_torch_thread):
    from multihead.decoder import LabConfig, LabTransformer

    model = LabTransformer(LabConfig(vocab_size=8, max_len=8, d_model=16, n_heads=2))
    x = torch.randint(0, 8, (4, 8))

    def callback(name, step, loss):
        if step == 3:
            raise KeyboardInterrupt

    hist = train(model, lambda s: (x, x, None), 10, lr=1e-3, callback=callback, progress=False)
    assert hist["interrupted"] and hist["steps_done"] == 3 and len(hist["loss"]) == 3
    assert not model.training

"""Process state: a library call changes no global state it does not restore
(the environment, transformers' and huggingface_hub's progress bars and verbosity)."""

from __future__ import annotations

import copy
import os

import pytest

transformers = pytest.importorskip("transformers")
hub_tqdm = pytest.importorskip("huggingface_hub.utils.tqdm")

from transformers.utils import logging as hf_logging  # noqa: E402

from multihead.interop import loaders  # noqa: E402


def _state() -> dict:
    return {"env": dict(os.environ), "transformers bars": hf_logging.is_progress_bar_enabled(),
            "hub bars": copy.deepcopy(hub_tqdm.progress_bar_states), "verbosity": hf_logging.get_verbosity()}


@pytest.fixture
def restore_hf_state(monkeypatch):
    """Whatever the test does, the next test sees the state this one found."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # torch sets this one itself, once per process, the first time something asks where its
    # compile cache is (transformers' loading does): set beforehand, so only the library's
    # own changes show
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR",
                       os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.abspath(default_cache_dir()))
    before = _state()
    yield
    hf_logging._tqdm_active = before["transformers bars"]
    hub_tqdm.progress_bar_states.clear()
    hub_tqdm.progress_bar_states.update(before["hub bars"])
    hf_logging.set_verbosity(before["verbosity"])


@pytest.mark.parametrize("bars", ["transformers off, hub on", "both on", "hub off for one group"])
def test_loading_a_model_restores_the_process_state(bars, monkeypatch, restore_hf_state):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the loader used to set it for the process
    monkeypatch.setattr(loaders, "_LOADED", {})  # load for real, not from the session's cache
    hf_logging.enable_progress_bar()
    if bars == "transformers off, hub on":
        hf_logging._tqdm_active = False
    elif bars == "hub off for one group":
        hub_tqdm.disable_progress_bars("huggingface_hub.http_get")
    before = _state()
    model = loaders.load_model(str(loaders.minilm_path()))
    assert model.n_layers == 6
    after = _state()
    changed = {k: (before[k], after[k]) for k in before if k != "env" and before[k] != after[k]}
    env = {k: (before["env"].get(k), after["env"].get(k)) for k in set(before["env"]) | set(after["env"])
           if before["env"].get(k) != after["env"].get(k)}
    assert not changed and not env, f"changed by load_model: {changed} {env}"


def test_a_failed_load_restores_the_process_state(tmp_path, monkeypatch, restore_hf_state):
    from multihead.interop.loaders import InspectError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(loaders, "_LOADED", {})  # loads afresh: no public call forgets a loaded model
    folder = tmp_path / "broken"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        (folder / name).write_bytes((loaders.minilm_path() / name).read_bytes())
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    hf_logging.enable_progress_bar()
    before = _state()
    with pytest.raises(InspectError, match="cannot load the model"):
        loaders.load_model(str(folder))
    assert _state() == before


@pytest.mark.parametrize("bars", ["transformers off, hub on", "hub off for one group"])
def test_the_inspect_command_restores_the_process_state(bars, capsys, monkeypatch, restore_hf_state):
    # the command quiets transformers for its length (quiet_hub(logs=True)); it used to put the
    # bars back with enable_progress_bar(), which switched every hub group on
    from multihead.cli import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    if bars == "transformers off, hub on":
        hf_logging._tqdm_active = False
    else:
        hub_tqdm.disable_progress_bars("huggingface_hub.http_get")
    before = _state()
    assert main(["inspect", "The cat sat on the mat.", "--only-layers", "0", "--only-heads", "0"]) == 0
    capsys.readouterr()
    after = _state()
    changed = {k: (before[k], after[k]) for k in before if k != "env" and before[k] != after[k]}
    env = {k: (before["env"].get(k), after["env"].get(k)) for k in set(before["env"]) | set(after["env"])
           if before["env"].get(k) != after["env"].get(k)}
    assert not changed and not env, f"changed by multihead inspect: {changed} {env}"

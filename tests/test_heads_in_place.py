"""The head tools' forwards run GPT-2's tanh GELU (transformers' NewGELUActivation) in
place: it must be bitwise the module's own output (every dtype, odd shapes, strided
inputs, non-finite values, one and two threads, whole and in chunks that stay in L2), run
only without autograd and only in the thread inside the block, leave every module as it
was (also on errors, nested and from two threads), and leave the scans' tables bitwise
unchanged."""

from __future__ import annotations

import threading

import pytest
import torch

from multihead import heads

transformers = pytest.importorskip("transformers")

from transformers.activations import NewGELUActivation  # noqa: E402

import multihead.interop.hf  # noqa: E402, F401  (registers "multihead")
from conftest import AtenOps  # noqa: E402
from multihead.heads import _in_place  # noqa: E402  (the module under test: the head tools' private helper)
from test_heads import _mh, _one_token_changed  # noqa: E402

# the forward the block installs on each activation, recognised by its class: nothing public names it
IN_PLACE_FORWARD = _in_place._InPlaceForward


def _nothing_held() -> bool:
    """No thread inside a block and no module's forward held: the bookkeeping every exit must empty."""
    return not _in_place._THREADS and not _in_place._USERS  # the invariant under test lives in these two stores


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_in_place_form_is_bitwise_the_module(dtype, threads):
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        act = NewGELUActivation()
        for shape in [(3, 17, 131), (2, 256, 2048), (1, 3, 2), (5, 7)]:
            x = (torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype)
            x.view(-1)[:3] = torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=dtype)
            x.view(-1)[3:5] = torch.tensor([1e4, -1e4], dtype=dtype)
            keep = x.clone()
            _same(_in_place.new_gelu_in_place(x), act(x))
            _same(x, keep)  # the input is only read
            strided = x.transpose(-1, -2)  # a non-contiguous input
            _same(_in_place.new_gelu_in_place(strided), act(strided))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_that_stay_in_l2_are_bitwise_the_module(threads, monkeypatch):
    """A GELU input larger than half the L2 runs chunk by chunk (the chunk from the machine
    plan's L2, here a small one so that many chunks and a partial last one are run): the
    output is bitwise the module's, at one and two threads; a smaller or strided input runs
    whole."""
    from multihead.kernels.machine import MachinePlan, set_machine_plan

    before_plan, before = set_machine_plan(MachinePlan(64 * 1024, 1 << 25, "test")), torch.get_num_threads()
    torch.set_num_threads(threads)
    passes: list[int] = []
    real = _in_place._new_gelu_into
    monkeypatch.setattr(_in_place, "_new_gelu_into", lambda x, a: passes.append(x.numel()) or real(x, a))
    try:
        act = NewGELUActivation()
        g = torch.Generator().manual_seed(1)
        for dtype, k in [(torch.float32, 4096), (torch.float64, 2048), (torch.bfloat16, 8192)]:
            x = (torch.randn(5, 33, 257, generator=g, dtype=torch.float64) * 4).to(dtype)  # 42,405: not a multiple
            x.view(-1)[-3:] = torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=dtype)
            passes.clear()
            _same(_in_place.new_gelu_in_place(x), act(x))
            assert passes == [k] * (x.numel() // k) + [x.numel() % k], (dtype, passes[:3], len(passes))
            for whole in (x[:, :3].contiguous(), x.transpose(-1, -2)):  # under 2 chunks; not contiguous
                passes.clear()
                _same(_in_place.new_gelu_in_place(whole), act(whole))
                assert passes == [whole.numel()]
    finally:
        torch.set_num_threads(before)
        set_machine_plan(before_plan)


def _gpt2():
    model = _mh("gpt2")
    acts = [m for m in model.modules() if type(m) is NewGELUActivation]
    assert acts, "the test model must have GPT-2's GELU"
    return model, acts


def _ops(fn) -> list[str]:
    with AtenOps() as rec:
        fn()
    return rec.names


def test_only_inside_the_block_without_grad_and_in_this_thread():
    _, acts = _gpt2()
    act = acts[0]
    x = torch.randn(2, 5, 64, requires_grad=True)
    want = NewGELUActivation.forward(act, x.detach())
    assert "forward" not in vars(act)
    with _in_place.in_place_activations(act):
        with torch.no_grad():
            assert "tanh_" in _ops(lambda: _same(act(x), want))  # in place here
        y = act(x)  # autograd on: the module's own code, differentiable
        assert y.requires_grad and "tanh_" not in _ops(lambda: act(x.detach()))
        grad, = torch.autograd.grad(y.sum(), x)
        ref = x.detach().clone().requires_grad_()
        want_grad, = torch.autograd.grad(NewGELUActivation.forward(act, ref).sum(), ref)
        _same(grad, want_grad)
        seen = []

        def other():
            with torch.no_grad():
                seen.append(_ops(lambda: act(x)))
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert "tanh_" not in seen[0] and "tanh" in seen[0]  # another thread: the model's own code
    assert "forward" not in vars(act)
    with torch.no_grad():
        assert "tanh_" not in _ops(lambda: act(x))


def test_nested_errors_and_foreign_forwards_leave_modules_as_they_were():
    model, acts = _gpt2()
    theirs = lambda x: x + 1  # noqa: E731  (a user's instance forward)
    acts[1].forward = theirs
    with pytest.raises(RuntimeError, match="inside"):
        with _in_place.in_place_activations(model):
            assert isinstance(vars(acts[0])["forward"], IN_PLACE_FORWARD)
            with _in_place.in_place_activations(model):
                pass
            assert isinstance(vars(acts[0])["forward"], IN_PLACE_FORWARD)  # the outer block still holds it
            with torch.no_grad():
                _same(acts[1](torch.zeros(2)), torch.ones(2))  # theirs still runs
            raise RuntimeError("inside")
    assert "forward" not in vars(acts[0]) and vars(acts[1])["forward"] is theirs
    assert _nothing_held()


def test_two_threads_in_blocks_over_one_model():
    model, acts = _gpt2()
    inside, release = threading.Barrier(2), threading.Event()

    def scan_like():
        with _in_place.in_place_activations(model):
            inside.wait()
            release.wait(10)
    t = threading.Thread(target=scan_like)
    t.start()
    with _in_place.in_place_activations(model):
        inside.wait()
    assert isinstance(vars(acts[0])["forward"], IN_PLACE_FORWARD)  # the other thread's block still holds it
    release.set()
    t.join()
    assert all("forward" not in vars(m) for m in acts) and _nothing_held()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("what", ["z", "v"])
def test_tables_bitwise_unchanged(monkeypatch, what):
    model, acts = _gpt2()
    clean, corrupted = _one_token_changed("gpt2")
    metric = lambda lg: (lg[:, -1, 3] - lg[:, -1, 4]).mean()  # noqa: E731
    monkeypatch.setattr(_in_place, "IN_PLACE", False)  # the switch: the tables without the in-place GELU
    want = heads.patch_scan(model, clean, corrupted, metric, what=what)
    want_path = heads.path_patch_scan(model, clean, corrupted, metric, receivers=[(1, 0)])
    monkeypatch.setattr(_in_place, "IN_PLACE", True)  # and with it, whatever the default
    calls = []
    real = _in_place.new_gelu_in_place
    monkeypatch.setattr(_in_place, "new_gelu_in_place", lambda x: calls.append(1) or real(x))  # counts its calls
    assert torch.equal(heads.patch_scan(model, clean, corrupted, metric, what=what), want)
    assert calls, "the scan's forwards ran the in-place GELU"
    n = len(calls)
    assert torch.equal(heads.path_patch_scan(model, clean, corrupted, metric, receivers=[(1, 0)]), want_path)
    assert len(calls) > n
    assert all("forward" not in vars(m) for m in acts)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_raising_metric_leaves_the_model_as_it_was():
    model, acts = _gpt2()
    clean, corrupted = _one_token_changed("gpt2")
    n = [0]

    def metric(lg):
        n[0] += 1
        if n[0] > 3:  # past the setup: inside the variants' forwards' results
            raise ValueError("metric failed")
        return lg[:, -1, 3].mean()
    with pytest.raises(ValueError, match="metric failed"):
        heads.patch_scan(model, clean, corrupted, metric)
    assert all("forward" not in vars(m) for m in acts) and _nothing_held()

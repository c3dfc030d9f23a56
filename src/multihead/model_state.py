"""What a tool changes on a model it was handed, put back when it is done.

A tool that runs a model it did not make sets what the run needs (eval mode, multihead's
attention implementation) and must leave the model as it came, when it raises too:
`kept_state(model)` records the train/eval flag of every submodule, each parameter's
requires_grad and the attention implementation of every transformers config in the model,
and restores them on the way out. Hooks are not recorded: the tools add none that outlive
a call (their observers travel as forward keywords), which the tests check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["compiled", "kept_state"]


@contextmanager
def kept_state(model) -> Iterator[None]:
    """Restore `model`'s train/eval flags, requires_grad and attention implementation on exit.
    Anything that is not a torch module (None, a name) is left alone."""
    if not (hasattr(model, "modules") and hasattr(model, "parameters")):
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    configs = _attention_configs(model)
    try:
        yield
    finally:
        _restore_attention(model, configs)
        for m, was in modes:
            m.training = was  # each module's own flag: train(was) would recurse over the others
        for p, was in grads:
            if p.requires_grad != was:
                p.requires_grad_(was)


def _attention_configs(model) -> list[tuple[object, object]]:
    """(config, its attention implementation) for the model's config and every submodule's,
    each config once (a composite model's sub-models have configs of their own)."""
    seen: dict[int, tuple[object, object]] = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen[id(config)] = (config, config._attn_implementation)
    return list(seen.values())


def _restore_attention(model, configs: list[tuple[object, object]]) -> None:
    """Through transformers' own switch first (it also re-dispatches sub-models), then each
    config that still differs set directly."""
    if not configs:
        return
    top = getattr(model, "config", None)
    was = next((value for config, value in configs if config is top), None)
    if top is not None and was is not None and top._attn_implementation != was \
            and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(was)
        except (ValueError, KeyError, ImportError):  # the setters below still restore the record
            pass
    for config, value in configs:
        if config._attn_implementation != value:
            config._attn_implementation = value


def compiled(model) -> bool:
    """Whether `model` runs through torch.compile: an OptimizedModule (`torch.compile(model)`),
    `model.compile()`, or a compiled function put on `model.forward`."""
    forward = getattr(model, "__dict__", {}).get("forward")
    return (hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None
            or (forward is not None and hasattr(forward, "_torchdynamo_orig_callable")))

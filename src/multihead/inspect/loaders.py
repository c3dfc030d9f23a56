"""Where `multihead inspect` finds its models: re-exported from `multihead.interop.loaders`,
one floor below the tools, so that inspect, heads and lab share one loader without importing
each other."""

from multihead.interop.loaders import (  # noqa: F401  (the public names, kept where they were)
    HFModel,
    InspectError,
    LabModel,
    LoadedModel,
    TruncationWarning,
    load_model,
    minilm_path,
    register_loader,
    resolve_model,
)

__all__ = ["InspectError", "LoadedModel", "HFModel", "LabModel", "TruncationWarning", "load_model",
           "minilm_path", "register_loader", "resolve_model"]

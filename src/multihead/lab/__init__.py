"""The classic multi-head experiments, reproducible, with plots (`multihead lab`).

Each experiment is a function and a subcommand; each writes to an output folder a
`results.json` (config, seed, library version, every number), PNG plots and a
safetensors checkpoint that `multihead inspect --model FOLDER` opens:

- `run_heads`: does the number of heads matter? (copy task)
- `run_kv`: what do GQA, MQA and MLA cost and save? (parameters, cache, decode time)
- `run_mla`: how small can MLA's latent be? (character LM on the King James Bible)
- `run_induction`: when do induction heads appear? (2-layer attention-only model)
- `run_uptrain`: what does converting a trained MHA model to GQA/MQA/MLA cost, and how
  much does a little uptraining win back? (Ainslie et al., 2023)

torch and matplotlib (optional) are imported inside the experiments. `scale_induction`
turns a real model's head geometry into a CPU-sized `InductionConfig`.
"""

from __future__ import annotations

from multihead._lazy import lazy_exports

_MODULES = {
    "multihead.lab.heads": ("run_heads", "HeadsConfig"), "multihead.lab.kv": ("run_kv", "KVConfig"),
    "multihead.lab.mla": ("run_mla", "MLAConfig"), "multihead.lab.induction": ("run_induction", "InductionConfig"),
    "multihead.lab.uptrain": ("run_uptrain", "UptrainConfig"), "multihead.lab.results": ("check_results",),
    "multihead.lab.configs": ("scale_induction",),
}
__getattr__, __dir__, _EXPORTS = lazy_exports(__name__, _MODULES, globals())
__all__ = _EXPORTS

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

_LAZY = {
    "run_heads": "multihead.lab.heads", "HeadsConfig": "multihead.lab.heads",
    "run_kv": "multihead.lab.kv", "KVConfig": "multihead.lab.kv",
    "run_mla": "multihead.lab.mla", "MLAConfig": "multihead.lab.mla",
    "run_induction": "multihead.lab.induction", "InductionConfig": "multihead.lab.induction",
    "run_uptrain": "multihead.lab.uptrain", "UptrainConfig": "multihead.lab.uptrain",
    "check_results": "multihead.lab.results",
    "scale_induction": "multihead.lab.configs",
}
__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

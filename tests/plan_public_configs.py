"""Public config.json contents of real models (from their Hugging Face repos), shared by
the plan tests: the presets the package ships (multihead.plan.presets), copied so that a
test may edit its copy. The known answers the tests hold for them are derived
independently (tests/test_plan_configs.py)."""

import copy

from multihead.plan.presets import PRESETS

CONFIGS = {name: copy.deepcopy(p.config) for name, p in PRESETS.items()}

# name -> (total params, attention params per layer, KV bytes per token in bf16)

"""The attention kernels, one file per backend and one home per formula.
`multihead.functional` stays the public face: `scaled_dot_product_attention`,
`attend`, `attention_weights` and the backend registry are imported from there.

- `registry` (backends, "auto", capabilities), `backends` (the built-in ones, in order);
- `sdpa` (torch's fused kernel), `planner` (the tiles a mask keeps), `fused_tiles` (the
  block-sparse engine on the fused kernel), `explicit_tiles` (the online-softmax tile
  engine with its FlashAttention-2 backward), `flex` (opt-in, compiled flex_attention),
  `math` (the explicit paths and the weights pass), `decode` (the split decode step);
- `validation`: the checks of q, k, v, masks, scale, score mods and weight heads;
- `common`: the formula's one home, what every engine calls: `eager` (the formula written
  out), the masked scores and softmax (with sinks), the online softmax, a block's attention
  with its log-sum-exp, the one log-sum-exp merge, and the CPU flash kernel with its lse;
- `machine`: what the CPU kernels choose from the machine (its cache sizes, read once per
  process, and the decode step's engine, timed once per process where the plan leaves it
  open): `machine_plan()` shows it, `measured_choices()` what was timed, `set_machine_plan`
  replaces it.
"""

from multihead.kernels.machine import MachinePlan, machine_plan, measured_choices, set_machine_plan

__all__ = ["MachinePlan", "machine_plan", "measured_choices", "set_machine_plan"]

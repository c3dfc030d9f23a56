"""multihead across processes, on torch.distributed (gloo on CPU, NCCL on GPUs).

Two ways to split attention when one process is not enough:

- heads (tensor parallelism, `shard_heads`): each rank computes H/P heads. The q/k/v
  projections are split by output columns and o by input rows (torch's
  `torch.distributed.tensor.parallel`), so a layer costs one all-reduce forward and one
  backward. For when the weights or the per-head work outgrow a device.
- the sequence (context parallelism, `ring_attention`, `context_parallel`): each rank
  holds N/P tokens and K/V blocks travel around a ring. For when activations of a long
  sequence outgrow a device; memory per rank is O(N/P).

`shard_sequence` / `gather_sequence` cut a sequence into the shards these expect and
put it back together; `shard_positions` gives a shard's global token positions.
"""

from multihead.distributed._group import ProcessGroupError
from multihead.distributed.context import context_parallel, shard_positions
from multihead.distributed.heads import shard_heads
from multihead.distributed.ring import ring_attention
from multihead.distributed.sequence import gather_sequence, shard_sequence

__all__ = [
    "ProcessGroupError",
    "context_parallel",
    "gather_sequence",
    "ring_attention",
    "shard_heads",
    "shard_positions",
    "shard_sequence",
]

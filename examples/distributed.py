"""Train a small causal language model across processes, two ways, and check both
against one process.

    torchrun --nproc-per-node 2 examples/distributed.py                  # CPU, gloo
    torchrun --nproc-per-node 4 examples/distributed.py --backend nccl   # GPUs
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 examples/distributed.py --backend nccl  # machines

1. heads sharded (`shard_heads`): every rank sees the whole sequence and computes
   H/P heads; the loss is the same on every rank.
2. sequence ring-sharded (`context_parallel`, zigzag): every rank holds N/P tokens,
   K/V travel around the ring; each rank's loss is its tokens' share, summed with one
   all_reduce, and so are the parameter gradients (as in data parallelism).

Rank 0 also trains an unsharded copy in its own process; the three losses are printed
side by side and must agree (float32: to about 1e-5).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from multihead import Attention
from multihead.distributed import context_parallel, shard_heads, shard_sequence


class TinyLM(nn.Module):
    """Embedding, one pre-norm causal attention block with RoPE and GQA, an MLP, a head."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.norm1 = nn.RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads, n_kv_heads, causal=True, rope=True)
        self.norm2 = nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, C)
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)  # (B, T, vocab)


def batch(step: int, args, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random batch on every rank: a sequence that repeats a random prefix, so
    the model can learn to copy from far back (the point of attending a long context)."""
    g = torch.Generator().manual_seed(1000 + step)
    half = torch.randint(0, args.vocab, (args.batch, args.seq_len // 2 + 1), generator=g)
    seq = torch.cat([half, half], dim=1)[:, : args.seq_len + 1].to(device)
    return seq[:, :-1], seq[:, 1:]  # inputs, next-token targets (B, N)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="gloo on CPU, nccl on GPUs")
    p.add_argument("--steps", type=int, default=5, help="training steps")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence N (divisible by 2 x ranks)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=8, help="query heads (divisible by ranks)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    args = p.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    torch.manual_seed(0)
    base = TinyLM(args.vocab, args.d_model, args.heads, args.kv_heads).to(device)
    single = copy.deepcopy(base)  # one process (trained on rank 0 only)
    heads = copy.deepcopy(base)
    shard_heads(heads.attn, init_device_mesh(device.type, (world,)))
    ring = copy.deepcopy(base)
    context_parallel(ring.attn, layout="zigzag")
    opts = {name: torch.optim.SGD(m.parameters(), lr=args.lr) for name, m in
            (("single", single), ("heads", heads), ("ring", ring))}
    n_tokens = args.batch * args.seq_len

    if rank == 0:
        print(f"{world} ranks ({args.backend}), N = {args.seq_len}, H = {args.heads}, Hkv = {args.kv_heads}")
        print(f"{'step':>4}  {'heads sharded':>14}  {'sequence ring':>14}  {'one process':>14}")
    for step in range(args.steps):
        ids, targets = batch(step, args, device)
        losses = {}

        # 1. heads sharded: whole sequence on every rank
        loss = F.cross_entropy(heads(ids).flatten(0, 1), targets.flatten())
        opts["heads"].zero_grad()
        loss.backward()
        opts["heads"].step()
        losses["heads"] = loss.item()

        # 2. sequence ring-sharded: this rank's tokens; loss and gradients summed over ranks
        logits = ring(shard_sequence(ids, 1, "zigzag"))  # (B, N/P, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), shard_sequence(targets, 1, "zigzag").flatten(),
                               reduction="sum") / n_tokens
        opts["ring"].zero_grad()
        loss.backward()
        for param in ring.parameters():
            dist.all_reduce(param.grad)
        opts["ring"].step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses["ring"] = total.item()

        if rank == 0:
            loss = F.cross_entropy(single(ids).flatten(0, 1), targets.flatten())
            opts["single"].zero_grad()
            loss.backward()
            opts["single"].step()
            losses["single"] = loss.item()
            print(f"{step:>4}  {losses['heads']:>14.6f}  {losses['ring']:>14.6f}  {losses['single']:>14.6f}")
            for name in ("heads", "ring"):
                if abs(losses[name] - losses["single"]) > 1e-4:
                    raise SystemExit(f"{name}: loss {losses[name]} differs from one process's {losses['single']}")
    if rank == 0:
        print("losses equal to one process's")
    shutdown()


def shutdown() -> None:
    """Leave the process group cleanly, then the process.

    Every rank finishes its collectives (the barrier) before any tears the group down.
    torch's functional collectives (DTensor's, under `shard_heads`) keep references to the
    group, so `destroy_process_group()` cannot free it and gloo's worker threads live on
    until the interpreter finalizes; one still releasing its last work then dies with
    SIGABRT ("terminate called without an active exception": 2 of 19 runs). With the
    group destroyed and the output flushed, nothing is left to finalize: exit at once.
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

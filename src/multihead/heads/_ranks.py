"""Scans across processes: every rank of a torch.distributed group holds the model, runs a
share of a scan's independent units (a patch scan's chunks of variants, importance's
batches) and ends with the whole table.

The units are shared out by a fixed rule (`split`), and each runs exactly the forward it
runs in one process, so the table is the single-process one bit for bit; a rank never
raises alone: what it raised is held until the next `settle`, a collective every rank
enters, which then raises on every rank. What one rank made for all moves as `pack` /
`unpack` through `share` (the model's modules and the call's own objects travel as names).
In full: docs/heads.md, "Scans across processes".
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


def check_group(group) -> None:
    """None (one process) or a torch.distributed ProcessGroup this process belongs to."""
    if group is None:
        return
    import torch.distributed as dist

    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None (one process) or a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD after init_process_group); received {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("group does not include this process (torch.distributed.get_rank(group) is -1); valid: "
                         "a group this rank is a member of")


def split(costs: Sequence[float], size: int) -> list[int]:
    """The rank that runs each unit: the costliest first, each to the least loaded rank so
    far (ties to the lower rank). The same on every rank: it reads only `costs`."""
    load = [0.0] * size
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def fingerprint(model: nn.Module, *inputs) -> str:
    """A cheap digest of the inputs and of the model's parameter shapes and end values: ranks
    that hold different weights (a random init with another seed) or inputs are told so."""
    h = hashlib.blake2b(digest_size=8)

    def feed(x):
        if isinstance(x, Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif hasattr(x, "keys") and hasattr(x, "__getitem__"):
            for k in sorted(x.keys()):
                h.update(str(k).encode())
                feed(x[k])
        elif isinstance(x, (tuple, list)):
            for t in x:
                feed(t)
        else:
            h.update(repr(x).encode())

    for x in inputs:
        feed(x)
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        feed(name)
        feed(torch.cat([flat[:16], flat[-16:]]))
    return h.hexdigest()


_ALIGN = 64  # bytes: every storage starts at a multiple of it in the body (any dtype may view it)


class _Packer(pickle.Pickler):
    """Pickles against a model: its modules and parameters as names, `refs` (the call's own
    objects, by identity) as their keys, dicts keyed by a module's id() (a scan's per-block
    caches) keyed by its name, and every other tensor as (its storage's place in one byte
    tensor, its view of it): tensors that share a storage share it on arrival."""

    def __init__(self, file, model: nn.Module, refs: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.names = {}
        for name, m in model.named_modules(remove_duplicate=False):
            self.names.setdefault(id(m), name)
        self.weights = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if t.numel():
                self.weights.setdefault((t.device, t.untyped_storage().data_ptr()), name)
        self.refs = {id(v): k for k, v in refs.items() if not isinstance(v, (type(None), bool, int, float, str))}
        self.storages: dict[tuple, int] = {}  # (device, data_ptr) -> index in `parts`
        self.parts: list = []  # (untyped storage, device)

    def persistent_id(self, obj):
        if id(obj) in self.refs:
            return ("ref", self.refs[id(obj)])
        if isinstance(obj, nn.Module) and id(obj) in self.names:
            return ("module", self.names[id(obj)])
        if isinstance(obj, dict) and any(type(k) is int and k in self.names for k in obj):
            return ("by-id", [(("module-id", self.names[k]) if type(k) is int and k in self.names else k, v)
                              for k, v in obj.items()])
        if isinstance(obj, Tensor):
            if obj.device.type == "meta" or type(obj) not in (Tensor, nn.Parameter):
                raise TypeError(f"cannot send a {type(obj).__name__} on {obj.device} to another rank")
            view = (tuple(obj.shape), obj.stride(), obj.storage_offset(), obj.dtype, obj.requires_grad)
            storage = obj.untyped_storage()
            key = (obj.device, storage.data_ptr())
            if obj.numel() and key in self.weights:  # a view of a parameter or buffer (a weight detached)
                return ("weight", self.weights[key], *view)
            if key not in self.storages:
                self.storages[key] = len(self.parts)
                self.parts.append((storage, obj.device))
            return ("tensor", self.storages[key], *view)
        return None


class _Unpacker(pickle.Unpickler):
    def __init__(self, file, model: nn.Module, refs: dict, storages: list):
        super().__init__(file)
        self.model, self.refs, self.storages = model, refs, storages
        self.weights = {**dict(model.named_parameters(remove_duplicate=False)),
                        **dict(model.named_buffers(remove_duplicate=False))}

    def persistent_load(self, pid):
        kind = pid[0]
        if kind == "ref":
            return self.refs[pid[1]]
        if kind == "module":
            return self.model.get_submodule(pid[1])
        if kind == "by-id":
            return {(id(self.model.get_submodule(k[1])) if isinstance(k, tuple) and k[:1] == ("module-id",) else k): v
                    for k, v in pid[1]}
        if kind in ("weight", "tensor"):
            _, which, shape, stride, offset, dtype, grad = pid
            if kind == "weight":
                w = self.weights[which].detach()
                t = torch.empty(0, dtype=dtype, device=w.device).set_(w.untyped_storage(), offset, shape, stride)
            else:
                storage, start = self.storages[which]  # start: in bytes, a multiple of _ALIGN
                size = torch.empty(0, dtype=dtype).element_size()
                t = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, start // size + offset, shape,
                                                                             stride)
            return t.requires_grad_() if grad else t
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def pack(obj, model: nn.Module, refs: dict | None = None) -> tuple[bytes, Tensor]:
    """`obj` as (a pickle, one byte tensor of every storage it holds), which `unpack` rebuilds
    on another rank against its own `model` and `refs` (key -> object: what the receiver holds
    in its own right, e.g. the call's inputs; sent by key)."""
    head = io.BytesIO()
    packer = _Packer(head, model, refs or {})
    packer.dump(obj)
    devices = {device for _, device in packer.parts}
    home = devices.pop() if len(devices) == 1 else torch.device("cpu")  # the body stays where the tensors are
    pieces, table, at = [], [], 0
    for storage, device in packer.parts:
        n = storage.nbytes()
        pieces.append(torch.empty(0, dtype=torch.uint8, device=device).set_(storage).to(home))
        pad = -n % _ALIGN
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=home))
        table.append((at, n, str(device)))
        at += n + pad
    body = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)
    return pickle.dumps((head.getvalue(), table), protocol=pickle.HIGHEST_PROTOCOL), body


def unpack(packed: tuple[bytes, Tensor], model: nn.Module, refs: dict | None = None):
    """What `pack` packed, with the model's modules and parameters and `refs` this rank's own;
    its tensors are views of the byte tensor (copies on their own device where it is elsewhere)."""
    head, body = packed
    obj, table = pickle.loads(head)
    storages = []
    for at, n, device in table:
        if torch.device(device) == body.device:
            storages.append((body.untyped_storage(), body.storage_offset() + at))
        else:
            storages.append((body[at:at + n].to(device).untyped_storage(), 0))
    return _Unpacker(io.BytesIO(obj), model, refs or {}, storages).load()


class Ranks:
    """One call's view of `group` (None: one process, nothing shared, errors raised where they
    happen)."""

    def __init__(self, group, name: str):
        self.group, self.name = group, name
        if group is None:
            self.rank, self.size = 0, 1
        else:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def settle(self, error: BaseException | None, payload=None, signature=()) -> list:
        """Every rank's payload, by rank; raises on every rank if any rank has an `error` or
        the signatures (any picklable value that every rank must agree on) differ."""
        if self.group is None:
            if error is not None:
                raise error
            return [payload]
        import torch.distributed as dist

        mine = (None if error is None else f"{type(error).__name__}: {error}", signature, payload)
        every: list = [None] * self.size
        dist.all_gather_object(every, mine, group=self.group)
        failed = [(r, msg) for r, (msg, _, _) in enumerate(every) if msg is not None]
        if error is not None:
            error.add_note(f"{self.name}: raised on rank {self.rank} of {self.size}; every rank stops")
            raise error
        if failed:
            told = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
            raise RuntimeError(f"{self.name}: rank(s) {', '.join(str(r) for r, _ in failed)} of {self.size} raised "
                               f"({told}); every rank stops")
        sigs = [s for _, s, _ in every]
        if any(s != sigs[0] for s in sigs):
            table = "; ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
            raise ValueError(f"{self.name}: the ranks disagree on {table}; valid: every rank passes the same model "
                             f"(weights), inputs and options")
        return [p for _, _, p in every]

    def share(self, packed: tuple[bytes, Tensor] | None) -> list:
        """Every rank's `pack`ed payload (or None), by rank: the bytes move as tensors (a
        broadcast from each rank that has one), not through pickle, so tens of MiB take
        milliseconds. Nothing is raised: a rank without one sends None."""
        if self.group is None:
            return [packed]
        import torch.distributed as dist

        device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":  # NCCL moves CUDA tensors only (not tested here)
            device = torch.device("cuda", torch.cuda.current_device())
        mine = [-1, -1] if packed is None else [len(packed[0]), packed[1].numel()]
        sizes = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor(mine, dtype=torch.int64, device=device), group=self.group)
        out: list = []
        for r, (n_head, n_body) in enumerate(t.tolist() for t in sizes):
            if n_head < 0:
                out.append(None)
                continue
            if r == self.rank:
                head = torch.frombuffer(bytearray(packed[0]), dtype=torch.uint8).to(device)
                body = packed[1].to(device)
            else:
                head = torch.empty(n_head, dtype=torch.uint8, device=device)
                body = torch.empty(n_body, dtype=torch.uint8, device=device)
            src = dist.get_global_rank(self.group, r)
            dist.broadcast(head, src=src, group=self.group)
            if n_body:
                dist.broadcast(body, src=src, group=self.group)
            out.append(packed if r == self.rank else (head.cpu().numpy().tobytes(), body))
        return out

    def run(self, fn: Callable[[], object], signature: Callable[[object], object] = lambda result: ()):
        """fn() on this rank, then `settle` on `signature(result)`: its result, or the raise on every rank."""
        if self.group is None:
            return fn()
        result, error = None, None
        try:
            result = fn()
        except Exception as e:  # held for settle: every rank raises together
            error = e
        self.settle(error, None, () if error is not None else signature(result))
        return result

    def map(self, fn: Callable, units: Sequence, costs: Sequence[float] | None = None) -> list:
        """[fn(unit) for unit in units] with each unit run on one rank (`split` by `costs`), every
        result on every rank."""
        if self.group is None:
            return [fn(u) for u in units]
        owner = split([1.0] * len(units) if costs is None else costs, self.size)
        done: dict[int, object] = {}
        error = None
        try:
            for i, u in enumerate(units):
                if owner[i] == self.rank:
                    done[i] = fn(u)
        except Exception as e:  # held for settle: every rank raises together
            error = e
        merged: dict[int, object] = {}
        for part in self.settle(error, done, len(units)):
            merged.update(part)
        return [merged[i] for i in range(len(units))]

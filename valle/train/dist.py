"""Process group set-up with timeouts, and the few collectives the trainer uses.

`python bin/trainer.py` is one process (no process group at all);
`torchrun ...` sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR and we join with
env:// rendezvous: NCCL on GPU, gloo on CPU. Every collective has a timeout
(`--collective-timeout`), so a dead or diverged peer becomes an error instead
of an indefinite wait.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: object | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(requested)


def init_distributed(device: str = "auto", collective_timeout_s: float = 300.0) -> DistContext:
    """Join the torchrun process group if there is one; otherwise a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world_size == 1:
        return DistContext(0, 1, 0, dev, None)
    # Turn NCCL failures and timeouts into errors raised in the trainer rather
    # than a silent wait (the default in recent torch, set for older ones).
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            timeout=datetime.timedelta(seconds=collective_timeout_s),
            **({"device_id": dev} if backend == "nccl" else {}),
        )
    logger.info("rank %d/%d on %s (%s, collective timeout %.0f s)", rank, world_size, dev,
                backend, collective_timeout_s)
    return DistContext(rank, world_size, local_rank, dev, dist.group.WORLD)


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.distributed:
        dist.all_reduce(tensor, group=ctx.group)
    return tensor


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, ctx: DistContext) -> None:
    """Overwrite `tensors` in place with rank `src`'s values."""
    if not ctx.distributed:
        return
    for t in tensors:
        dist.broadcast(t.data, src=src, group=ctx.group)


def broadcast_object(obj, src: int, ctx: DistContext):
    """Pickle-and-broadcast a state dict (rare, repair path only)."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=ctx.group,
                               device=ctx.device if ctx.device.type == "cuda" else None)
    return box[0]


def tensor_fingerprint(tensors: Sequence[torch.Tensor]) -> int:
    """Exact fingerprint of tensor contents, computed on their device.

    Bit patterns (not values) are hashed so that any difference, even in the
    last ulp or a NaN payload, changes the fingerprint.
    """
    acc = 0
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        flat = t.detach().contiguous().view(-1)
        if flat.element_size() == 8:
            ints = flat.view(torch.int64)
        elif flat.element_size() == 4:
            ints = flat.view(torch.int32).to(torch.int64)
        elif flat.element_size() == 2:
            ints = flat.view(torch.int16).to(torch.int64)
        else:
            ints = flat.view(torch.uint8).to(torch.int64)
        weights = torch.arange(1, ints.numel() + 1, device=ints.device, dtype=torch.int64) % 1000003
        value = int(((ints * weights).sum() + ints.sum() * 31).item())
        acc = (acc * 1000000007 + value + i) % (1 << 61)
    return acc


def object_fingerprint(obj) -> int:
    """Fingerprint of a nested state dict: tensors by content, the rest by pickle."""
    tensors: list[torch.Tensor] = []

    def strip(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return ("tensor", tuple(x.shape), str(x.dtype))
        if isinstance(x, dict):
            return {k: strip(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
        if isinstance(x, (list, tuple)):
            return [strip(v) for v in x]
        return x

    skeleton = pickle.dumps(strip(obj))
    import hashlib

    head = int.from_bytes(hashlib.sha1(skeleton).digest()[:7], "little")
    return (head * 1000003 + tensor_fingerprint(tensors)) % (1 << 61)


def gather_ints(values: Sequence[int], ctx: DistContext) -> list[list[int]]:
    """All ranks' integer vectors (one collective)."""
    local = torch.tensor(list(values), dtype=torch.int64, device=ctx.device)
    if not ctx.distributed:
        return [local.tolist()]
    out = [torch.zeros_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(out, local, group=ctx.group)
    return [t.tolist() for t in out]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier(group=ctx.group)


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()

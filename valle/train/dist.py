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
    # The resilience core's ControlChannel (set by the trainer): object gathers that
    # allocate no device memory.
    channel: object | None = None

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
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        store = launch_store(rank, world_size, timeout)  # None: not torchrun's shared store
        dist.init_process_group(
            backend=backend,
            **({"init_method": "env://"} if store is None else
               {"store": store, "rank": rank, "world_size": world_size}),
            timeout=timeout,
            **({"device_id": dev} if backend == "nccl" else {}),
        )
    logger.info("rank %d/%d on %s (%s, collective timeout %.0f s)", rank, world_size, dev,
                backend, collective_timeout_s)
    return DistContext(rank, world_size, local_rank, dev, dist.group.WORLD)


def launch_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """A key space of this launch's own in torchrun's shared TCPStore, or None.

    torchrun (c10d rendezvous, torch >= 2.4) gives every launch of the workers
    the TCPStore its agent hosts, and that store keeps its keys across
    `--max-restarts`. The process group's bootstrap keys are the same in every
    launch, so after a restart a rank may read a dead peer's address from the
    previous launch and fail to connect (seen here with gloo: "connectFullMesh
    failed ... Connection refused"; pytorch/pytorch#135712 for NCCL).
    TORCHELASTIC_RESTART_COUNT cannot tell launches apart across nodes (each
    agent counts its own restarts), so the ranks agree on a generation in the
    store: each announces a fresh nonce; rank 0 waits until every rank's
    announcement is one it has not consumed before, takes the next generation
    and answers each nonce with it. Every wait is bounded by `timeout`.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import time
    import uuid

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    deadline = time.monotonic() + timeout.total_seconds()

    def read(key: str) -> str | None:
        return store.get(key).decode() if store.check([key]) else None

    def wait_a_little(what: str) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: {what} within {timeout.total_seconds():.0f} s "
                               "(--collective-timeout) while joining the process group")
        time.sleep(0.02)

    nonce = uuid.uuid4().hex
    consumed_before = read(f"valle/used/{rank}")
    store.set(f"valle/hello/{rank}", nonce)
    if rank == 0:
        fresh = []
        for r in range(world_size):
            while (hello := read(f"valle/hello/{r}")) is None or hello == read(f"valle/used/{r}"):
                wait_a_little(f"rank {r} did not announce itself")
            fresh.append(hello)
        generation = store.add("valle/generation", 1)
        for r, hello in enumerate(fresh):
            store.set(f"valle/gen/{hello}", str(generation))
            store.set(f"valle/used/{r}", hello)
    while True:
        answer = read(f"valle/gen/{nonce}")
        taken = read(f"valle/used/{rank}")
        if answer is None and taken not in (None, consumed_before, nonce):
            # Rank 0 took a stale announcement for this rank (one left by a launch
            # that died while joining): this launch's generation is the one it got.
            answer = read(f"valle/gen/{taken}")
        if answer is not None:
            return dist.PrefixStore(f"valle/launch-{answer}/", store)
        wait_a_little("rank 0 did not answer")


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


_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_FINGERPRINT_CHUNK = 1 << 24  # elements hashed per kernel: bounds the int64 copy's memory


def tensor_fingerprint(tensors: Sequence[torch.Tensor]) -> int:
    """Exact fingerprint of tensor contents (and order), computed on their device.

    Bit patterns (not values) are hashed so that any difference, even in the
    last ulp or a NaN payload, changes the fingerprint. Tensors are hashed in
    concatenated chunks (a few kernels per chunk, not per tensor): a position
    weight makes the order count.
    """
    acc, position = 0, 0
    chunk: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal acc, position, chunk, size
        if not chunk:
            return
        ints = torch.cat(chunk).to(torch.int64)
        weights = torch.arange(position + 1, position + 1 + ints.numel(), device=ints.device,
                               dtype=torch.int64) % 1000003
        value = int(((ints * weights).sum() + ints.sum() * 31).item())
        acc = (acc * 1000000007 + value + position) % (1 << 61)
        position += ints.numel()
        chunk, size = [], 0

    for t in tensors:
        if t.numel() == 0:
            continue
        flat = t.detach().reshape(-1).view(_INT_OF_SIZE[t.element_size()])
        if chunk and (flat.dtype != chunk[0].dtype or flat.device != chunk[0].device
                      or size + flat.numel() > _FINGERPRINT_CHUNK):
            flush()
        chunk.append(flat)
        size += flat.numel()
    flush()
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


def shutdown() -> None:
    """Leave the process group (torch warns at exit if a run does not)."""
    if dist.is_initialized():
        dist.destroy_process_group()

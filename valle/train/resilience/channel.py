"""The control channel: every collective of the recovery path, over buffers
allocated once at start.

After an out-of-memory error the device may have nothing left to give, not
even the few bytes of a flag tensor. So the vote, the damaged-state flags,
fingerprint exchange, quarantine sharing, sampler states for checkpoints and
the repair broadcast never allocate device memory: they write into buffers
made here when the run starts and all-reduce those in place. A rank that
just failed can therefore always finish the protocol the others are in.

Three buffers, each all-reduced (summed) in place:

* `f64`: the vote vector. The step writes host-known values (flags, counts)
  through a host staging copy, and device-side sums (loss, metrics, gradient
  norms) straight into their slots with in-place ops.
* `ints`: a (world, K) int64 table; each rank fills its row, the others are
  zero, so the sum is an all-gather (fingerprints, counters).
* `bytes`: a (world, capacity) uint8 table for pickled objects, exchanged in
  as many rounds as the longest object needs (sizes travel first in `ints`).

On CPU the host staging copies are the buffers themselves (numpy views, no
torch op at all); on CUDA they are pinned host tensors copied in place.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from valle.train.dist import DistContext

VOTE_SLOTS = 256
INT_SLOTS = 16
OBJECT_BYTES = 1 << 16


class ControlChannel:
    def __init__(self, ctx: DistContext, *, vote_slots: int = VOTE_SLOTS,
                 int_slots: int = INT_SLOTS, object_bytes: int = OBJECT_BYTES):
        self.ctx = ctx
        world, device = ctx.world_size, ctx.device
        self.f64 = torch.zeros(vote_slots, dtype=torch.float64, device=device)
        self.int_slots = int_slots
        self.ints = torch.zeros(world * int_slots, dtype=torch.int64, device=device)
        self.bytes = torch.zeros(world, object_bytes, dtype=torch.uint8, device=device)
        self._host = {name: self._staging(t) for name, t in
                      (("f64", self.f64), ("ints", self.ints), ("bytes", self.bytes))}

    def _staging(self, device_tensor: torch.Tensor) -> torch.Tensor:
        if device_tensor.device.type == "cpu":
            return device_tensor
        return torch.zeros(device_tensor.shape, dtype=device_tensor.dtype, pin_memory=True)

    def _np(self, name: str) -> np.ndarray:
        return self._host[name].numpy()

    def _upload(self, name: str, device_view: torch.Tensor, host_view: torch.Tensor) -> None:
        if device_view.data_ptr() != host_view.data_ptr():
            device_view.copy_(host_view, non_blocking=True)

    def _download(self, name: str, device_view: torch.Tensor, host_view: torch.Tensor) -> None:
        if device_view.data_ptr() != host_view.data_ptr():
            host_view.copy_(device_view)  # synchronous: the host reads it next

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if self.ctx.distributed:
            dist.all_reduce(tensor, group=self.ctx.group)

    # -- the vote -----------------------------------------------------------------

    def device_slots(self, start: int, count: int) -> torch.Tensor:
        """A view of the vote vector that the caller fills on the device, in place."""
        return self.f64.narrow(0, start, count)

    def reduce(self, host_values: Sequence[float], used: int | None = None) -> list[float]:
        """Sum over ranks of the vote vector's first `used` slots, after writing
        `host_values` into its first slots (the rest were filled on the device)."""
        n = len(host_values)
        used = n if used is None else used
        self._np("f64")[:n] = host_values
        self._upload("f64", self.f64.narrow(0, 0, n), self._host["f64"].narrow(0, 0, n))
        view = self.f64.narrow(0, 0, used)
        self._all_reduce(view)
        host = self._host["f64"].narrow(0, 0, used)
        self._download("f64", view, host)
        return host.numpy().tolist()

    # -- all-gathers ------------------------------------------------------------------

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's integer vector (same length on every rank)."""
        k, world = len(values), self.ctx.world_size
        if k > self.int_slots:
            raise ValueError(f"gather_ints: {k} values, the channel holds {self.int_slots}")
        # A contiguous (world, k) prefix of the flat buffer (collectives need contiguity).
        table = self._np("ints")[:world * k].reshape(world, k)
        table[:] = 0
        table[self.ctx.rank] = values
        device_view = self.ints.narrow(0, 0, world * k)
        host_view = self._host["ints"].narrow(0, 0, world * k)
        self._upload("ints", device_view, host_view)
        self._all_reduce(device_view)
        self._download("ints", device_view, host_view)
        return host_view.numpy().reshape(world, k).tolist()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [row[0] for row in self.gather_ints([len(payload)])]
        capacity = self.bytes.shape[1]
        rounds = max(1, -(-max(sizes) // capacity))
        received = [bytearray() for _ in sizes]
        table = self._np("bytes")
        for r in range(rounds):
            lo = r * capacity
            chunk = payload[lo:lo + capacity]
            table[:] = 0
            table[self.ctx.rank, :len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            self._upload("bytes", self.bytes, self._host["bytes"])
            self._all_reduce(self.bytes)
            self._download("bytes", self.bytes, self._host["bytes"])
            for rank, size in enumerate(sizes):
                take = min(capacity, max(0, size - lo))
                received[rank] += table[rank, :take].tobytes()
        return [pickle.loads(bytes(b)) for b in received]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """`src`'s object on every rank (the others pass anything, e.g. None)."""
        if not self.ctx.distributed:
            return obj
        return self.gather_objects(obj if self.ctx.rank == src else None)[src]

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Overwrite device tensors in place with rank `src`'s values (no allocation)."""
        if not self.ctx.distributed:
            return
        for t in tensors:
            dist.broadcast(t, src=src, group=self.ctx.group)

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

The host staging copies are Python arrays seen as tensors (`torch.frombuffer`):
the host writes and reads them with no torch op at all (and no numpy: torch
alone suffices). On CPU they are the buffers themselves; on CUDA they are
copied to and from the device buffers in place.
"""

from __future__ import annotations

import pickle
from array import array
from collections.abc import Sequence
from typing import Any

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
        self.int_slots, self.object_bytes = int_slots, object_bytes
        # Host side: Python arrays, written and read without any torch op.
        self._f64_host = array("d", bytes(8 * vote_slots))
        self._int_host = array("q", bytes(8 * world * int_slots))
        self._byte_host = bytearray(world * object_bytes)
        host = {"f64": torch.frombuffer(self._f64_host, dtype=torch.float64),
                "ints": torch.frombuffer(self._int_host, dtype=torch.int64),
                "bytes": torch.frombuffer(self._byte_host, dtype=torch.uint8)}
        self._host = host
        if device.type == "cpu":
            self.f64, self.ints, self.bytes = host["f64"], host["ints"], host["bytes"]
        else:
            self.f64 = torch.zeros(vote_slots, dtype=torch.float64, device=device)
            self.ints = torch.zeros(world * int_slots, dtype=torch.int64, device=device)
            self.bytes = torch.zeros(world * object_bytes, dtype=torch.uint8, device=device)

    def _exchange(self, name: str, count: int) -> None:
        """All-reduce the first `count` elements of a buffer, host copy in and out."""
        device_view = getattr(self, name).narrow(0, 0, count)
        host_view = self._host[name].narrow(0, 0, count)
        if device_view.data_ptr() != host_view.data_ptr():
            device_view.copy_(host_view)
        if self.ctx.distributed:
            dist.all_reduce(device_view, group=self.ctx.group)
        if device_view.data_ptr() != host_view.data_ptr():
            host_view.copy_(device_view)

    def _upload_f64(self, count: int) -> None:
        """Host-written vote slots to the device (the rest were filled there)."""
        if self.f64.data_ptr() != self._host["f64"].data_ptr():
            self.f64.narrow(0, 0, count).copy_(self._host["f64"].narrow(0, 0, count))

    # -- the vote -----------------------------------------------------------------

    def device_slots(self, start: int, count: int) -> torch.Tensor:
        """A view of the vote vector that the caller fills on the device, in place."""
        return self.f64.narrow(0, start, count)

    def reduce(self, host_values: Sequence[float], used: int | None = None) -> list[float]:
        """Sum over ranks of the vote vector's first `used` slots, after writing
        `host_values` into its first slots (the rest were filled on the device)."""
        n = len(host_values)
        used = n if used is None else used
        self._f64_host[:n] = array("d", host_values)
        self._upload_f64(n)
        view = self.f64.narrow(0, 0, used)
        if self.ctx.distributed:
            dist.all_reduce(view, group=self.ctx.group)
        if view.data_ptr() != self._host["f64"].data_ptr():
            self._host["f64"].narrow(0, 0, used).copy_(view)
        return self._f64_host[:used].tolist()

    # -- all-gathers ------------------------------------------------------------------

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's integer vector (same length on every rank)."""
        k, world = len(values), self.ctx.world_size
        if k > self.int_slots:
            raise ValueError(f"gather_ints: {k} values, the channel holds {self.int_slots}")
        # A contiguous (world, k) prefix of the flat buffer (collectives need contiguity).
        table = array("q", bytes(8 * world * k))
        table[self.ctx.rank * k:(self.ctx.rank + 1) * k] = array("q", values)
        self._int_host[:world * k] = table
        self._exchange("ints", world * k)
        flat = self._int_host[:world * k].tolist()
        return [flat[r * k:(r + 1) * k] for r in range(world)]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [row[0] for row in self.gather_ints([len(payload)])]
        capacity, world = self.object_bytes, self.ctx.world_size
        rounds = max(1, -(-max(sizes) // capacity))
        received = [bytearray() for _ in sizes]
        mine = self.ctx.rank * capacity
        for r in range(rounds):
            lo = r * capacity
            chunk = payload[lo:lo + capacity]
            self._byte_host[:] = bytes(world * capacity)
            self._byte_host[mine:mine + len(chunk)] = chunk
            self._exchange("bytes", world * capacity)
            for rank, size in enumerate(sizes):
                take = min(capacity, max(0, size - lo))
                received[rank] += self._byte_host[rank * capacity:rank * capacity + take]
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

"""Gradient synchronisation that a failed rank can complete.

torch DDP launches its all-reduces from inside `backward()`; a rank whose
backward raises stops issuing them and every other rank waits forever. Here the
trainer owns the all-reduce:

* every trained parameter's `.grad` is a view into a flat bucket buffer, so
  gradients accumulate in place and a bucket is reduced without copies;
* in `overlap` mode a bucket's all-reduce is launched asynchronously as soon as
  all its parameters' gradients are accumulated during the *last* micro-batch's
  backward (post-accumulate-grad hooks), overlapping communication with the
  rest of backward like DDP does;
* `launch_remaining()` launches every bucket not yet launched, in bucket order.
  The step calls it after backward whether backward succeeded or raised, so a
  rank that failed half-way still issues exactly the same collectives, in the
  same order, as the others. Buckets whose parameters received no gradient
  this step (a stage not trained, an unused head) are launched there too.

`after-backward` mode launches all buckets only after backward (no overlap).
`ddp` mode wraps the model in torch DDP, for comparison.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

SYNC_MODES = ("overlap", "after-backward", "ddp")


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    ready: int = 0
    handle: object | None = None
    launched: bool = False


class GradSyncProtocol:
    """What the resilient step asks of every grad sync beyond the gradients: the
    attempt's differences between modes live here, not in the step."""

    # torch DDP all-reduces inside backward: the vote runs after the forwards, and the
    # last micro-batch's backward only when the vote is clean.
    votes_before_backward = False

    def forward_context(self, last_micro_batch: bool):
        """Entered around a micro-batch's forward (and its backward)."""
        return nullcontext()

    def epoch_over(self, dry_ranks: int, world_size: int) -> bool:
        """A dry rank contributes zero gradient until every rank is dry, so nothing
        drawn is dropped."""
        return dry_ranks == world_size


class BucketedGradSync(GradSyncProtocol):
    """Flat-buffer gradients with ordered, completable, optionally overlapped all-reduce."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        world_size: int,
        group=None,
        mode: str = "overlap",
        bucket_cap_mb: float = 25.0,
        on_launch: Callable[[int], None] | None = None,
    ):
        if mode not in ("overlap", "after-backward"):
            raise ValueError(f"--grad-sync {mode!r} is not a bucketed mode")
        self.mode = mode
        self.world_size = world_size
        self.group = group
        self.on_launch = on_launch  # fault-injection point ("grad_sync")
        self.armed = False
        # Check this rank's gradient for inf/NaN at launch (off under GradScaler, whose
        # job overflow is: it must see the infs to lower the scale).
        self.check_finite = False
        self.buckets = self._build_buckets(list(params), int(bucket_cap_mb * (1 << 20)))
        # Each bucket's local gradient norm, written in place at launch (read before the
        # all-reduce overwrites the bucket): allocated once, so launching allocates nothing.
        self._norms = torch.zeros(len(self.buckets), dtype=torch.float32,
                                  device=self.buckets[0].buffer.device)
        self._bucket_of: dict[int, Bucket] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
        self._next_to_launch = 0
        self._hooks = []
        if mode == "overlap" and world_size > 1:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                           for b in self.buckets for p in b.params]

    # -- construction -------------------------------------------------------

    @staticmethod
    def _build_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[Bucket]:
        """Buckets in reverse registration order: backward produces the last layers'
        gradients first, so bucket 0 fills first and launches early."""
        groups: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            same_kind = not current or (p.dtype == current[0].dtype and p.device == current[0].device)
            if current and (size + nbytes > cap_bytes or not same_kind):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            groups.append(current)
        buckets = []
        for index, group_params in enumerate(groups):
            total = sum(p.numel() for p in group_params)
            buffer = torch.zeros(total, dtype=group_params[0].dtype, device=group_params[0].device)
            offset = 0
            for p in group_params:
                n = p.numel()
                # The gradient *is* a slice of the bucket: autograd accumulates into it
                # in place, and the all-reduce reads it without a copy.
                p.grad = buffer[offset:offset + n].view_as(p)
                offset += n
            buckets.append(Bucket(index, group_params, buffer))
        return buckets

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    # -- per attempt -------------------------------------------------------------

    def zero_grad(self) -> None:
        """Zero every bucket; gradients stay views (never set to None)."""
        self._check_views()
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready = 0
            bucket.handle = None
            bucket.launched = False
        self._next_to_launch = 0
        self.armed = False
        self._norms.zero_()

    def write_grad_norm(self, slot: torch.Tensor) -> None:
        """Sum of this rank's bucket norms into `slot` (in place): inf/NaN exactly when
        the local gradient holds an inf/NaN. Zero when not checked."""
        if self.check_finite:
            slot.copy_(self._norms.sum())

    @contextmanager
    def backward_context(self, last_micro_batch: bool) -> Iterator[None]:
        """Arm the hooks for the last micro-batch's backward only."""
        self.armed = last_micro_batch and self.mode == "overlap"
        try:
            yield
        finally:
            self.armed = False

    def forward_module(self, model: nn.Module) -> nn.Module:
        return model

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        # Launch strictly in bucket order so every rank issues the same sequence.
        while (self._next_to_launch < len(self.buckets)
               and self.buckets[self._next_to_launch].ready == len(self.buckets[self._next_to_launch].params)):
            self._launch(self.buckets[self._next_to_launch])

    def _launch(self, bucket: Bucket, failed: bool = False) -> None:
        """All-reduce one bucket. The bucket counts as launched only once its collective
        is issued: an error in the local work before it (the fault hook, the norm)
        leaves it to `launch_remaining(failed=True)`, so no rank is ever one short."""
        if not failed:
            if self.on_launch is not None:
                self.on_launch(bucket.index)
            if self.check_finite:
                # This rank's own gradient, read before the all-reduce overwrites it (the
                # norm is queued on the stream ahead of the collective).
                torch.linalg.vector_norm(bucket.buffer, out=self._norms[bucket.index])
        if self.world_size > 1:
            bucket.handle = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        bucket.launched = True
        self._next_to_launch = bucket.index + 1

    def launch_remaining(self, failed: bool = False) -> None:
        """Launch every bucket not yet launched, in order.

        `failed=True` is the recovery path after a local error: it issues only the
        collectives (no fault hook, no norm: this rank's gradient is discarded anyway),
        which allocate no device memory, so it cannot fail the way the error did."""
        self.armed = False
        for bucket in self.buckets[self._next_to_launch:]:
            if not bucket.launched:
                self._launch(bucket, failed)

    def wait(self) -> None:
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None

    def grad_factor(self, factor: float) -> float:
        """What scale_(factor) multiplies the gradients by (the buckets hold sums)."""
        return factor

    def scale_(self, factor: float) -> None:
        torch._foreach_mul_(self.grad_tensors(), factor)

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient, as few tensors as possible (the buckets) for norms and scaling."""
        return [bucket.buffer for bucket in self.buckets]

    def grad_norms(self) -> None:
        """The norms of grad_tensors() if known without a pass (never here: the
        all-reduce changed the buckets after their launch-time norms)."""
        return None

    def _check_views(self) -> None:
        for bucket in self.buckets:
            for p in bucket.params:
                if p.grad is None or p.grad._base is not bucket.buffer:
                    raise RuntimeError(
                        "a parameter's .grad is no longer a view of its all-reduce bucket "
                        "(something called zero_grad(set_to_none=True) or assigned .grad)"
                    )

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class LocalGradSync(GradSyncProtocol):
    """One rank: nothing to all-reduce, so gradients stay ordinary tensors.

    Zeroing sets them to None and the first backward hands its result over
    without an accumulate pass, exactly like an unprotected loop; the only
    remaining protocol step is the fault-injection point of `grad_sync`.
    """

    mode = "local"

    def __init__(self, params: Sequence[nn.Parameter], on_launch: Callable[[int], None] | None = None):
        self._params = list(params)
        self.on_launch = on_launch
        self._launched = False
        self.check_finite = False
        # The per-gradient norms the finiteness check took after backward; nothing
        # changes the gradients before clipping on one rank, which reuses them.
        self._norms: list[torch.Tensor] | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return self._params

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None
        self._launched = False
        self._norms = None

    def backward_context(self, last_micro_batch: bool):
        return nullcontext()

    def forward_module(self, model: nn.Module) -> nn.Module:
        return model

    def launch_remaining(self, failed: bool = False) -> None:
        if not failed and not self._launched and self.on_launch is not None:
            self.on_launch(0)
        self._launched = True

    def write_grad_norm(self, slot: torch.Tensor) -> None:
        grads = self.grad_tensors()
        if self.check_finite and grads:
            self._norms = torch._foreach_norm(grads)
            slot.copy_(torch.stack(self._norms).sum())

    def wait(self) -> None:
        pass

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params if p.grad is not None]

    def grad_norms(self) -> list[torch.Tensor] | None:
        """The norms of grad_tensors() taken by write_grad_norm (None if not taken);
        valid until something scales the gradients (under GradScaler none are taken)."""
        return self._norms

    def grad_factor(self, factor: float) -> float:
        return factor

    def scale_(self, factor: float) -> None:
        grads = self.grad_tensors()
        if grads:
            torch._foreach_mul_(grads, factor)
        self._norms = None

    def close(self) -> None:
        pass


class DdpGradSync(GradSyncProtocol):
    """torch DDP, for comparison: forward OOMs are voted before backward;
    a backward OOM cannot be completed and ends the run with a clear error."""

    mode = "ddp"
    votes_before_backward = True

    def forward_context(self, last_micro_batch: bool):
        """DDP decides at forward time whether backward will all-reduce: earlier
        micro-batches run forward *and* backward under no_sync."""
        return self.backward_context(last_micro_batch)

    def epoch_over(self, dry_ranks: int, world_size: int) -> bool:
        """DDP cannot run a backward without a batch: the epoch ends when the first
        rank runs dry."""
        return dry_ranks > 0

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter], *, world_size: int,
                 device: torch.device, group=None, bucket_cap_mb: float = 25.0):
        self.world_size = world_size
        self._params = list(params)
        trained = {id(p) for p in self._params}
        for p in model.parameters():
            if id(p) not in trained:
                p.requires_grad_(False)
        self.ddp = None
        if world_size > 1:
            self.ddp = nn.parallel.DistributedDataParallel(
                model,
                device_ids=[device.index] if device.type == "cuda" else None,
                process_group=group,
                bucket_cap_mb=bucket_cap_mb,
                # Stage-0 batches may not reach every NAR head; DDP must not wait for them.
                find_unused_parameters=True,
                broadcast_buffers=False,
            )
        self.armed = False

    @property
    def params(self) -> list[nn.Parameter]:
        return self._params

    def forward_module(self, model: nn.Module) -> nn.Module:
        return self.ddp if self.ddp is not None else model

    def zero_grad(self) -> None:
        grads = self.grad_tensors()
        if grads:
            torch._foreach_zero_(grads)

    def backward_context(self, last_micro_batch: bool):
        """no_sync for all but the last micro-batch (wrap their forward too)."""
        if self.ddp is not None and not last_micro_batch:
            return self.ddp.no_sync()
        return nullcontext()

    def launch_remaining(self, failed: bool = False) -> None:  # DDP reduced inside backward
        pass

    def write_grad_norm(self, slot: torch.Tensor) -> None:  # voted before backward
        pass

    def wait(self) -> None:
        pass

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params if p.grad is not None]

    def grad_norms(self) -> None:
        return None

    def grad_factor(self, factor: float) -> float:
        """DDP averaged over ranks; the trainer's factor assumes a sum."""
        return factor * self.world_size

    def scale_(self, factor: float) -> None:
        grads = self.grad_tensors()
        if grads:
            torch._foreach_mul_(grads, self.grad_factor(factor))

    def close(self) -> None:
        pass


def build_grad_sync(mode: str, model: nn.Module, params: Sequence[nn.Parameter], *, world_size: int,
                    device: torch.device, group=None, bucket_cap_mb: float = 25.0,
                    on_launch: Callable[[int], None] | None = None):
    if mode not in SYNC_MODES:
        raise ValueError(f"--grad-sync must be one of {', '.join(SYNC_MODES)}, got {mode!r}")
    if mode == "ddp":
        return DdpGradSync(model, params, world_size=world_size, device=device, group=group,
                           bucket_cap_mb=bucket_cap_mb)
    if world_size == 1:
        return LocalGradSync(params, on_launch=on_launch)
    return BucketedGradSync(params, world_size=world_size, group=group, mode=mode,
                            bucket_cap_mb=bucket_cap_mb, on_launch=on_launch)

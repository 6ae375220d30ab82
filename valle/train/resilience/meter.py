"""The memory meter: peak and live bytes of the training device, and the budget they must fit.

On CUDA it reads the caching allocator (`max_memory_allocated`). On CPU nothing counts
tensor memory, so `CensusMeter` does: an `AllocationMode` (the allocation-counting
dispatch mode of valle.train.resilience.faults) sees every new tensor, the meter adds
its storage's bytes (rounded up to 512 as the CUDA allocator rounds blocks) and a
weakref finalizer on the storage takes them off when it dies. Views and in-place ops
create no storage and count nothing, so the figure is what `max_memory_allocated` would
say for the same work on a GPU, less the kernels' workspaces.

With `enforce`, the census is a simulated device of `budget_bytes`: a tensor that would
take live bytes over the budget raises `torch.OutOfMemoryError` (after the op ran; the
result is dropped), so "the largest batch that fits" and "no OOM in an epoch" are real
checks on CPU. The dispatch mode costs every op a Python call: it is active only in the
windows that ask for it (`active()`: the scan, the batch-size search), or for the whole
run when --memory-budget-gb is given on CPU.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_leaves

from valle.train.resilience.faults import AllocationMode

logger = logging.getLogger(__name__)

GiB = 1 << 30
BLOCK = 512  # the CUDA caching allocator's rounding of small blocks


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


class CensusMeter:
    """Live and peak bytes of CPU tensors, counted per storage (see the module docstring)."""

    kind = "census"

    def __init__(self, budget_bytes: int = 0, enforce: bool = False):
        self.budget_bytes = budget_bytes
        self.enforce = enforce and budget_bytes > 0
        self.live = 0
        self.peak = 0
        self._storages: dict[int, int] = {}  # storage address (_cdata) -> bytes counted
        self._mode: AllocationMode | None = None
        self._depth = 0

    # -- what the trainer calls ------------------------------------------------

    def live_bytes(self) -> int:
        return self.live

    def peak_bytes(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.live

    @property
    def running(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        if self._mode is None:
            self._mode = AllocationMode(after=self._on_outputs)
            self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Count inside this window (nested windows and a running meter are fine)."""
        started = not self.running
        self.start()
        try:
            yield
        finally:
            if started:
                self.stop()

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors made before the meter started (parameters, optimizer state):
        they are on the device as much as any activation."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t, check=False)

    # -- the census --------------------------------------------------------------

    def _on_outputs(self, out) -> torch.OutOfMemoryError | None:
        """Count the op's new tensors; the error to raise when they exceed the budget
        (returned, not raised: AllocationMode raises it without pinning the tensors)."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                error = self._count(t, check=self.enforce)
                if error is not None:
                    return error
        return None

    def _count(self, tensor: torch.Tensor, check: bool) -> torch.OutOfMemoryError | None:
        if tensor.device.type != "cpu" or tensor.is_sparse:
            return None
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._storages:
            return None
        nbytes = rounded(storage.nbytes())
        if nbytes == 0:
            return None
        if check and self.live + nbytes > self.budget_bytes:
            return torch.OutOfMemoryError(
                f"CPU memory meter: out of memory: tried to allocate {nbytes} bytes with "
                f"{self.live} of {self.budget_bytes} bytes live (--memory-budget-gb: a "
                "simulated device of that size)")
        self._storages[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)
        return None

    def _free(self, key: int, nbytes: int) -> None:
        if self._storages.get(key) == nbytes:
            del self._storages[key]
            self.live -= nbytes


class CudaMeter:
    """The caching allocator's own figures; a budget below the device's memory is enforced
    with `torch.cuda.set_per_process_memory_fraction`."""

    kind = "cuda"

    def __init__(self, device: torch.device, budget_bytes: int, enforce: bool = False):
        self.device = device
        self.budget_bytes = budget_bytes
        self.enforce = enforce
        if enforce:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)

    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    running = True

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    @contextmanager
    def active(self) -> Iterator[None]:
        yield

    def track(self, tensors) -> None:
        pass  # the allocator counts everything already


MemoryMeter = CensusMeter | CudaMeter


def build_meter(device: torch.device, budget_gb: float) -> MemoryMeter:
    """The meter of `device`. `budget_gb` > 0: the memory this run may use (enforced);
    0: on CUDA the device's free memory now plus what this process already holds; on
    CPU no budget (the meter still measures peaks where asked)."""
    budget = int(budget_gb * GiB) if budget_gb > 0 else 0
    if device.type == "cuda":
        if budget == 0:
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free) + torch.cuda.memory_reserved(device)
        return CudaMeter(device, budget, enforce=budget_gb > 0)
    return CensusMeter(budget, enforce=budget > 0)


def training_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           extra: Iterable[torch.Tensor] = ()) -> Iterator[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state: the memory every step holds."""
    yield from model.parameters()
    yield from model.buffers()
    for p in model.parameters():
        if p.grad is not None:
            yield p.grad
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    yield from extra


def describe_bytes(nbytes: float) -> str:
    if abs(nbytes) >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"

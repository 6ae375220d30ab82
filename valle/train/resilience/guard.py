"""Rank-local work that may run out of memory: an OOM becomes a `Failure`.

The guard leaves the except block before anything else (a live exception pins the
frames' tensors: activations, the autograd graph), releases the backward reserve,
frees cached blocks and writes the OOM report; other errors propagate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from valle.train.batching import Batch
from valle.train.resilience.faults import InjectedOutOfMemoryError
from valle.train.resilience.memory import (
    BackwardReserve,
    OomEvent,
    OomReporter,
    describe_batch,
    free_memory,
    is_oom_error,
    memory_figures,
)
from valle.train.resilience.phases import PhaseTracker


@dataclass
class Failure:
    phase: str
    cut_ids: list[str]
    message: str
    injected: bool
    memory: dict[str, int] = field(default_factory=dict)  # at the failure, before freeing


class OomGuard:
    """Runs local work; knows the micro-batch in flight and the split, for reports."""

    def __init__(self, device: torch.device, rank: int, phases: PhaseTracker,
                 reserve: BackwardReserve, reporter: OomReporter):
        self.device = device
        self.rank = rank
        self.phases = phases
        self.reserve = reserve
        self.reporter = reporter
        self.micro: Batch | None = None  # the micro-batch in flight (for reports)
        self.split = 1  # the attempt's number of micro-batches (for reports)

    def run(self, step: int, work: Callable[[], Any]) -> Failure | None:
        """Run `work`; an OOM anywhere in it becomes a Failure (reported, memory freed)
        instead of an exception. `step` -1: outside a training step (the tracker's)."""
        try:
            work()
            return None
        except Exception as exc:  # noqa: BLE001 - non-OOM errors are re-raised
            if not is_oom_error(exc):
                raise
            failure = self._failure(exc)
        # Outside the except block: the exception and the frames it pinned are
        # released before cached blocks are returned to the device.
        micro, self.micro = self.micro, None
        self.reserve.release()
        free_memory(self.device)
        self._report(step, failure, micro)
        return failure

    def _failure(self, exc: BaseException) -> Failure:
        """Facts about an OOM, taken inside the except block: the memory figures describe
        the pool at the failure, not after it was freed."""
        return Failure(
            phase=self.phases.take_error_phase(),
            cut_ids=list(self.micro["cut_ids"]) if self.micro is not None else [],
            message=str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
            injected=isinstance(exc, InjectedOutOfMemoryError),
            memory=memory_figures(self.device),
        )

    def _report(self, step: int, failure: Failure, micro: Batch | None) -> None:
        with self.phases.host_work():
            event = OomEvent(
                phase=failure.phase, rank=self.rank,
                step=step if step >= 0 else self.phases.step, attempt=self.phases.attempt,
                split=self.split, injected=failure.injected, message=failure.message,
                memory=failure.memory, **describe_batch(micro),
            )
            self.reporter.report(event, micro)

"""The update as a transaction: unscale, clip, optimizer step, scaler update, averaging.

Each sub-phase allocates before it mutates (the optimizers per chunk of parameters,
valle.train.optim.ResumableUpdate), so after an OOM running the update again
finishes it exactly, with the result of a clean update. Only when local retries
keep failing is the rank's state "damaged" (repaired from a healthy rank).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from valle.train.optim import ResumableUpdate, scale_and_clip_
from valle.train.resilience.faults import FaultInjector
from valle.train.resilience.guard import OomGuard
from valle.train.resilience.phases import PhaseTracker
from valle.train.resilience.repair import reset_scaler_stage

logger = logging.getLogger(__name__)


@dataclass
class UpdateOutcome:
    ooms: int  # out-of-memory errors met (retried locally)
    damaged: bool  # still failing after the retries: this rank needs a repair


class TransactionalUpdate:
    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                 averager, sync, grad_clip: float, retries: int, guard: OomGuard,
                 phases: PhaseTracker, faults: FaultInjector):
        self.optimizer = optimizer
        self.scaler = scaler
        self.averager = averager
        self.sync = sync
        self.grad_clip = grad_clip
        self.retries = retries
        self.guard = guard
        self.phases = phases
        self.faults = faults

    def apply(self, step: int, global_frames: int) -> UpdateOutcome:
        """Normalise by the global frame count, then the update; retried locally up to
        `retries` times, resuming where it stopped."""
        factor = 1.0 / max(global_frames, 1)
        if self.grad_clip <= 0:
            self.sync.scale_(factor)  # in place, allocates nothing
            factor = 1.0
        done: set[str] = set()
        resumable = isinstance(self.optimizer, ResumableUpdate)
        for tries in range(self.retries + 1):
            if self.guard.run(step, lambda: self._update(step, done, factor)) is None:
                return UpdateOutcome(ooms=tries, damaged=False)
            if "step started" in done and "step" not in done and not resumable:
                break  # an optimizer without resumable steps cannot finish a half-done one
        reset_scaler_stage(self.scaler)
        if resumable:
            self.optimizer.reset_update()
        logger.warning("rank %d: the update of step %d still ran out of memory after %d "
                       "retries; its state will be repaired from a healthy rank",
                       self.guard.rank, step, self.retries)
        return UpdateOutcome(ooms=self.retries + 1, damaged=True)

    def _update(self, step: int, done: set[str], factor: float = 1.0) -> None:
        """Each sub-phase at most once. With clipping, the division by the global frame
        count (`factor`) happens in the clip's multiply."""
        with self.phases.phase_scope("optimizer"):
            self.faults.maybe_fail("optimizer", None, self.guard.device)
            if self.scaler is not None and "unscale" not in done:
                self.scaler.unscale_(self.optimizer)
                done.add("unscale")
            if self.grad_clip > 0 and "clip" not in done:
                # On device, no sync; one norm pass (none on one rank: the finiteness
                # check's norms are reused) and one multiply.
                scale_and_clip_(self.sync.grad_tensors(), self.sync.grad_factor(factor),
                                self.grad_clip, norms=self.sync.grad_norms())
                done.add("clip")
            if "step" not in done:
                done.add("step started")
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)
                else:
                    self.optimizer.step()
                done.add("step")
            if self.scaler is not None and "update" not in done:
                self.scaler.update()
                done.add("update")
        with self.phases.phase_scope("average"):
            self.faults.maybe_fail("average", None, self.guard.device)
            if self.averager is not None and "average" not in done:
                self.averager.update(step + 1)  # in place: allocates nothing
                done.add("average")

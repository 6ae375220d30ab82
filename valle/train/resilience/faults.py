"""Fault injection: make a chosen phase of a chosen step fail, on chosen ranks.

`--inject-fault PHASE@STEP[:RANKS]` raises `torch.OutOfMemoryError` at PHASE on
the first attempt of optimizer step STEP only (a one-off, like a fragmentation
spike). `--inject-fault PHASE@cut=ID` raises whenever cut ID is in the
micro-batch (a batch that can never fit), so the retry splits until the cut is
alone and ends in quarantine. `stall@STEP[:RANKS]` sleeps inside the step so the
watchdog can be tested. With `--inject-fault-real` on CUDA, memory is really
exhausted instead of raising, so the allocator fails by itself.

Inert unless given: `FaultInjector([])` costs one attribute check per phase.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

OOM_PHASES = ("to_device", "forward", "backward", "grad_sync", "optimizer", "average")
# Phases in which a cut-targeted fault makes sense: the cut's data is in play.
CUT_PHASES = ("to_device", "forward", "backward")
# stall: sleep inside the step (watchdog tests); nonfinite: make this rank's loss NaN,
# nonfinite_grad: keep the loss finite but make its gradient NaN (vote tests); kill: SIGKILL this process, first launch only (elastic-restart tests).
ALL_PHASES = (*OOM_PHASES, "stall", "nonfinite", "nonfinite_grad", "kill")


class InjectedOutOfMemoryError(torch.OutOfMemoryError):
    """An injected OOM; a subclass so reports can tell it from a real one."""


@dataclass(frozen=True)
class FaultSpec:
    phase: str
    step: int | None = None
    cut_id: str | None = None
    ranks: frozenset[int] | None = None  # None: every rank

    def applies_to_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def parse_fault(text: str) -> FaultSpec:
    """Parse `PHASE@STEP[:RANKS]` or `PHASE@cut=ID[:RANKS]`; errors name the flag."""
    def fail(why: str) -> ValueError:
        return ValueError(
            f"--inject-fault {text!r}: {why}. Expected PHASE@STEP[:RANKS] or PHASE@cut=ID, "
            f"PHASE one of {', '.join(ALL_PHASES)}"
        )

    if "@" not in text:
        raise fail("missing '@'")
    phase, _, where = text.partition("@")
    if phase not in ALL_PHASES:
        raise fail(f"unknown phase {phase!r}")
    ranks: frozenset[int] | None = None
    if where.startswith("cut="):
        cut_id = where[len("cut="):]
        # A cut id may itself contain ':'; ranks are only split off a step target.
        if not cut_id:
            raise fail("empty cut id")
        if phase not in CUT_PHASES:
            raise fail(f"a cut target only works for {', '.join(CUT_PHASES)}")
        return FaultSpec(phase=phase, cut_id=cut_id)
    step_text, _, ranks_text = where.partition(":")
    try:
        step = int(step_text)
        if ranks_text:
            ranks = frozenset(int(r) for r in ranks_text.split(","))
    except ValueError:
        raise fail("STEP and RANKS must be integers") from None
    if step < 0:
        raise fail("STEP must be >= 0")
    return FaultSpec(phase=phase, step=step, ranks=ranks)


class FaultInjector:
    """Raises (or really allocates) at the phases named by the fault specs."""

    def __init__(
        self,
        specs: Sequence[FaultSpec] = (),
        rank: int = 0,
        real: bool = False,
        stall_seconds: float = 3600.0,
    ):
        self.specs = [s for s in specs if s.applies_to_rank(rank)]
        self.rank = rank
        self.real = real
        self.stall_seconds = stall_seconds
        self.step = -1
        self.attempt = 0
        self.fired: list[tuple[str, int, int]] = []  # (phase, step, attempt), for tests and logs

    @property
    def active(self) -> bool:
        return bool(self.specs)

    def begin_attempt(self, step: int, attempt: int) -> None:
        self.step, self.attempt = step, attempt

    def _should_fire(self, phase: str, cut_ids: Sequence[str] | None) -> bool:
        for spec in self.specs:
            if spec.phase != phase:
                continue
            if spec.cut_id is not None:
                if cut_ids is not None and spec.cut_id in cut_ids:
                    return True
            elif (spec.step == self.step and self.attempt == 0
                  and (phase, self.step, self.attempt) not in self.fired):
                # Once per step: the recovery path must be able to pass the same point.
                return True
        return False

    def maybe_fail(self, phase: str, cut_ids: Sequence[str] | None = None, device=None) -> None:
        """Raise an OOM here if a spec targets this phase now."""
        if not self.specs or not self._should_fire(phase, cut_ids):
            return
        self.fired.append((phase, self.step, self.attempt))
        if self.real and device is not None and torch.device(device).type == "cuda":
            exhaust_cuda_memory(device)  # raises the allocator's own OutOfMemoryError
        raise InjectedOutOfMemoryError(
            f"injected OOM: phase={phase} step={self.step} attempt={self.attempt} rank={self.rank}"
        )

    def maybe_stall(self) -> None:
        if self.specs and self._should_fire("stall", None):
            self.fired.append(("stall", self.step, self.attempt))
            logger.warning("injected stall: sleeping %.0f s at step %d", self.stall_seconds, self.step)
            time.sleep(self.stall_seconds)

    def poison_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.specs and self._should_fire("nonfinite", None):
            self.fired.append(("nonfinite", self.step, self.attempt))
            return loss * float("nan")
        return loss

    def poison_grad(self, loss: torch.Tensor) -> torch.Tensor:
        if self.specs and self._should_fire("nonfinite_grad", None):
            self.fired.append(("nonfinite_grad", self.step, self.attempt))
            return _NanGradient.apply(loss)
        return loss

    def maybe_kill(self) -> None:
        # Only in the first launch: after torchrun restarts the workers the run
        # must be able to pass this step.
        if (self.specs and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                and self._should_fire("kill", None)):
            logger.warning("injected kill: SIGKILL to myself at step %d", self.step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    @contextmanager
    def memory_pressure(self, phase: str, cut_ids: Sequence[str] | None, device) -> Iterator[None]:
        """Real-mode backward fault: fill the GPU so that backward itself runs out.

        Raising before `backward()` would only test our own raise; holding
        almost all free memory during backward makes autograd's allocations
        fail where a real fragmentation OOM would.
        """
        if not (self.real and self.specs and torch.device(device).type == "cuda"
                and self._should_fire(phase, cut_ids)):
            yield
            return
        self.fired.append((phase, self.step, self.attempt))
        hog = fill_cuda_memory(device, leave_bytes=16 << 20)
        try:
            yield
        finally:
            del hog


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN gradient backward: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


def fill_cuda_memory(device, leave_bytes: int) -> list[torch.Tensor]:
    """Allocate blocks until less than `leave_bytes` can be had; return them."""
    hog: list[torch.Tensor] = []
    block = 1 << 30
    while block >= max(leave_bytes, 1 << 20):
        try:
            hog.append(torch.empty(block, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            block //= 2
    return hog


def exhaust_cuda_memory(device) -> None:
    """Allocate until the caching allocator raises its own OutOfMemoryError."""
    hog: list[torch.Tensor] = []
    try:
        while True:
            hog.append(torch.empty(1 << 28, dtype=torch.uint8, device=device))
    finally:
        hog.clear()

"""Fault injection: make a chosen phase of a chosen step fail, on chosen ranks.

`--inject-fault PHASE@STEP[xK][:RANKS]` raises `torch.OutOfMemoryError` the first time
optimizer step STEP passes PHASE (a one-off, like a fragmentation spike; with xK, on
the first K passes, e.g. every local retry of an update). "First time" counts passes,
not attempts: when an earlier failure in the same step keeps attempt 0 from reaching
PHASE, the fault fires in the retry that does, so no fault is shadowed by another.
A fault that never fired by the end of the run (its step never ran on that rank, its
cut was never drawn) is logged as a warning naming it.

`--inject-fault PHASE@cut=ID` raises whenever cut ID is in the
micro-batch (a batch that can never fit), so the retry splits until the cut is
alone and ends in quarantine. `stall@STEP[:RANKS]` sleeps inside the step so the
watchdog can be tested. With `--inject-fault-real` on CUDA, memory is really
exhausted instead of raising, so the allocator fails by itself.

`alloc@STEP:N[:RANKS]` (STEP may be `startup`: the set-up) fails the Nth tensor-allocating aten op of step STEP on
RANKS, wherever it is: forward, backward, a bucket launch, the scaler, the
middle of the optimizer step, validation, a consistency check, a checkpoint
save (a `TorchDispatchMode` sees them all). "Step S" is everything the loop
does from the start of step S until step S+1 starts, retries included; host
work (data loading, writing reports) is not counted. `make oom-sweep` fails
every such op in turn, as SQLite fails every malloc.

Inert unless given: `FaultInjector([])` costs one attribute check per phase.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from valle.train.resilience.phases import PhaseTracker
from valle.train.storage import WRITES

logger = logging.getLogger(__name__)

OOM_PHASES = ("to_device", "forward", "backward", "grad_sync", "optimizer", "average")
# Phases in which a cut-targeted fault makes sense: the cut's data is in play.
CUT_PHASES = ("to_device", "forward", "backward")
# stall: sleep inside the step (watchdog tests); nonfinite: make this rank's loss NaN,
# nonfinite_grad: keep the loss finite but make its gradient NaN (vote tests); kill: SIGKILL this process, first launch only (elastic-restart tests).
# disk@KIND:N[xK][:RANKS]: the Nth write of KIND (valle.train.storage.WRITES: save, best,
# summary, quarantine, oom, report, tensorboard, samples) in this process fails as a full
# disk does (ENOSPC); with xK the K writes of that kind from the Nth on. Rank 0 by default.
ALL_PHASES = (*OOM_PHASES, "stall", "nonfinite", "nonfinite_grad", "kill", "alloc", "disk")


class InjectedOutOfMemoryError(torch.OutOfMemoryError):
    """An injected OOM; a subclass so reports can tell it from a real one."""


@dataclass(frozen=True)
class FaultSpec:
    phase: str
    step: int | None = None
    cut_id: str | None = None
    ranks: frozenset[int] | None = None  # None: every rank
    nth: int = 0  # alloc: the Nth allocating op of the step (1-based)
    write: str | None = None  # disk: which writes (valle.train.storage.WRITES); N is `step`
    times: int = 1  # PHASE@STEPxK: fire on K passes through the phase (e.g. every update retry)
    text: str = field(default="", compare=False)  # the flag as given, for messages

    def applies_to_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def __str__(self) -> str:
        return self.text or repr(self)


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
        if phase == "alloc":
            raise fail("alloc takes STEP:N, not a cut")
        if phase not in CUT_PHASES:
            raise fail(f"a cut target only works for {', '.join(CUT_PHASES)}")
        return FaultSpec(phase=phase, cut_id=cut_id, text=text)
    if phase == "disk":
        return parse_disk_fault(where, fail, text)
    nth = 0
    if phase == "alloc":
        step_text, _, rest = where.partition(":")
        nth_text, _, ranks_text = rest.partition(":")
        if not nth_text:
            raise fail("alloc needs STEP:N (fail the Nth allocating op of step STEP)")
    else:
        step_text, _, ranks_text = where.partition(":")
        nth_text = "0"
    step_text, _, times_text = step_text.partition("x")
    if phase == "alloc" and step_text == "startup":
        step_text = "-1"  # set-up, before the first step: model, optimizer state, data
    try:
        step, nth, times = int(step_text), int(nth_text), int(times_text or 1)
        if ranks_text:
            ranks = frozenset(int(r) for r in ranks_text.split(","))
    except ValueError:
        raise fail("STEP, N and RANKS must be integers") from None
    if step < 0 and not (phase == "alloc" and step == -1 and where.startswith("startup")):
        raise fail("STEP must be >= 0")
    if phase == "alloc" and nth < 1:
        raise fail("N must be >= 1")
    if times < 1:
        raise fail("xK needs K >= 1")
    return FaultSpec(phase=phase, step=step, ranks=ranks, nth=nth, times=times, text=text)


def parse_disk_fault(where: str, fail: Callable[[str], ValueError], text: str) -> FaultSpec:
    """`disk@KIND:N[xK][:RANKS]` (module doc); rank 0 unless RANKS says otherwise."""
    kind, _, rest = where.partition(":")
    nth_text, _, ranks_text = rest.partition(":")
    nth_text, _, times_text = nth_text.partition("x")
    if kind not in WRITES:
        raise fail(f"disk takes KIND:N with KIND one of {', '.join(WRITES)}, not {kind!r}")
    try:
        nth, times = int(nth_text), int(times_text or 1)
        ranks = frozenset(int(r) for r in ranks_text.split(",")) if ranks_text else frozenset({0})
    except ValueError:
        raise fail("disk takes KIND:N[xK][:RANKS] with integers N, K and RANKS") from None
    if nth < 1 or times < 1:
        raise fail("disk takes KIND:N[xK] with N >= 1 (the Nth write of KIND) and K >= 1")
    return FaultSpec(phase="disk", step=nth, times=times, ranks=ranks, write=kind, text=text)


class FaultInjector:
    """Raises (or really allocates) at the phases named by the fault specs."""

    def __init__(
        self,
        specs: Sequence[FaultSpec] = (),
        rank: int = 0,
        real: bool = False,
        stall_seconds: float = 3600.0,
        phases: PhaseTracker | None = None,
    ):
        self.specs = [s for s in specs if s.applies_to_rank(rank)
                      and not (s.phase == "kill" and _relaunched())]
        self.rank = rank
        self.real = real
        self.stall_seconds = stall_seconds
        # Where the trainer is (step, attempt, phase): the step writes it, this reads it.
        self.phases = phases if phases is not None else PhaseTracker()
        self.phases.subscribe(self._on_attempt)
        self.fired: list[tuple[str, int, int]] = []  # (phase, step, attempt), for tests and logs
        self._fire_counts: dict[FaultSpec, int] = {}  # passes each spec has fired on
        self.writes: dict[str, int] = {}  # writes so far per kind (disk@KIND:N)
        self.alloc_specs = [s for s in self.specs if s.phase == "alloc"]
        self.allocations = 0  # allocating ops counted in the current step window
        self.census: dict[int, list[tuple[str, str]]] | None = None  # step -> [(phase, op)]
        self._mode: AllocationMode | None = None

    def _on_attempt(self, step: int, attempt: int, new_step: bool) -> None:
        if new_step:
            self.allocations = 0  # a new step window

    # -- the allocation-level injector ------------------------------------------

    def count_allocations(self) -> None:
        """Record every allocating op of every step, in order, as (phase, op): the
        sweep's dry run, whose positions N the sweep then fails one by one."""
        self.census = {}

    def start(self) -> None:
        """Install the allocation interceptor if an alloc fault or a census needs it."""
        if (self.alloc_specs or self.census is not None) and self._mode is None:
            self._mode = AllocationMode(before=self.on_allocation)
            self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def on_allocation(self, op_name: str) -> None:
        where = self.phases
        if where.host_depth:
            return
        self.allocations += 1
        if self.census is not None:
            self.census.setdefault(where.step, []).append((where.phase, op_name))
        for spec in self.alloc_specs:
            if (spec.step == where.step and spec.nth == self.allocations
                    and not self._fire_counts.get(spec)):
                self._fire_counts[spec] = 1
                self.fired.append(("alloc", where.step, spec.nth))
                raise InjectedOutOfMemoryError(
                    f"injected OOM: allocation #{spec.nth} ({op_name}) of step {where.step} in "
                    f"phase {where.phase}, attempt {where.attempt}, rank {self.rank}")

    def _should_fire(self, phase: str, cut_ids: Sequence[str] | None) -> bool:
        """Whether a spec targets this pass through `phase`; counts the pass as fired."""
        for spec in self.specs:
            if spec.phase != phase:
                continue
            if spec.cut_id is not None:
                hit = cut_ids is not None and spec.cut_id in cut_ids
            else:
                # The first K passes of the step, whichever attempt makes them: the
                # recovery path must be able to pass the same point afterwards.
                hit = (spec.step == self.phases.step
                       and self._fire_counts.get(spec, 0) < spec.times)
            if hit:
                self._fire_counts[spec] = self._fire_counts.get(spec, 0) + 1
                self.fired.append((phase, self.phases.step, self.phases.attempt))
                return True
        return False

    def unfired(self) -> list[FaultSpec]:
        """The specs for this rank that have not fired (yet): said at the end of a run,
        so a fault point that does nothing never passes silently."""
        return [s for s in self.specs if not self._fire_counts.get(s)]

    def warn_unfired(self) -> list[str]:
        """Log one warning per fault that never fired on this rank; return their texts."""
        names = [str(spec) for spec in self.unfired()]
        for name in names:
            logger.warning("--inject-fault %s never fired on rank %d: its step did not run "
                           "here (the run ended at step %d) or its point was not reached "
                           "(no batch on this rank, cut never drawn)", name, self.rank,
                           self.phases.step)
        return names

    def maybe_fail(self, phase: str, cut_ids: Sequence[str] | None = None, device=None) -> None:
        """Raise an OOM here if a spec targets this phase now."""
        if not self.specs or not self._should_fire(phase, cut_ids):
            return
        if self.real and device is not None and torch.device(device).type == "cuda":
            exhaust_cuda_memory(device)  # raises the allocator's own OutOfMemoryError
        raise InjectedOutOfMemoryError(
            f"injected OOM: phase={phase} step={self.phases.step} attempt={self.phases.attempt} "
            f"rank={self.rank}"
        )

    def before_forward(self, cut_ids: Sequence[str], device) -> None:
        """The forward's fault points, in order: kill, stall, then an OOM."""
        if self.specs:
            self.maybe_kill()
            self.maybe_stall()
            self.maybe_fail("forward", cut_ids, device)

    def poison(self, loss: torch.Tensor) -> torch.Tensor:
        """A NaN loss, or a finite loss with a NaN gradient, where a spec says so."""
        if not self.specs:
            return loss
        return self.poison_grad(self.poison_loss(loss))

    def maybe_fail_write(self, kind: str, path) -> None:
        """disk@KIND:N[xK]: the Nth (to N+K-1th) write of KIND in this process fails as on
        a full disk (valle.train.storage.Storage.write calls this before each write)."""
        if not self.specs:
            return
        count = self.writes[kind] = self.writes.get(kind, 0) + 1
        for spec in self.specs:
            if spec.phase == "disk" and spec.write == kind and spec.step <= count < spec.step + spec.times:
                self._fire_counts[spec] = self._fire_counts.get(spec, 0) + 1
                self.fired.append(("disk", self.phases.step, count))
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))

    def maybe_stall(self) -> None:
        if self.specs and self._should_fire("stall", None):
            logger.warning("injected stall: sleeping %.0f s at step %d", self.stall_seconds,
                           self.phases.step)
            time.sleep(self.stall_seconds)

    def poison_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.specs and self._should_fire("nonfinite", None):
            return loss * float("nan")
        return loss

    def poison_grad(self, loss: torch.Tensor) -> torch.Tensor:
        if self.specs and self._should_fire("nonfinite_grad", None):
            return _NanGradient.apply(loss)
        return loss

    def maybe_kill(self) -> None:
        # kill specs are dropped in a relaunch (see _relaunched).
        if self.specs and self._should_fire("kill", None):
            logger.warning("injected kill: SIGKILL to myself at step %d", self.phases.step)
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
        hog = fill_cuda_memory(device, leave_bytes=16 << 20)
        try:
            yield
        finally:
            del hog


def _relaunched() -> bool:
    """Whether torchrun restarted this worker: a kill fault acts in the first launch
    only, so that the restarted run can pass its step (and is not reported unfired)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


def _allocates(func) -> bool:
    """Whether an aten op creates a new tensor (its outputs alias no input).

    Views and in-place/out= ops return aliases and allocate nothing; collectives
    (c10d) work in place on buffers allocated at start. `lift_fresh` marks a
    tensor made from Python data (torch.tensor), which on CUDA is an allocation."""
    cached = _ALLOCATES.get(func)
    if cached is None:
        schema = func._schema
        namespace = schema.name.split("::")[0]
        cached = namespace not in ("c10d", "_c10d_functional") and (
            schema.name == "aten::lift_fresh" or any(
                r.alias_info is None and "Tensor" in str(r.type) for r in schema.returns))
        _ALLOCATES[func] = cached
    return cached


_ALLOCATES: dict = {}


class AllocationMode(TorchDispatchMode):
    """Sees every aten op below autograd and autocast (forward, backward, optimizer
    foreach kernels, the scaler's kernels, collectives' local work).

    For each op that allocates: `before(op_name)` may raise (the fault injector), and
    `after(outputs)` sees the new tensors and may return an error to raise (the CPU memory
    meter, valle.train.resilience.meter). It is raised from here once this frame no longer
    holds the op's inputs and outputs: an error raised inside backward is kept by the
    autograd engine with its traceback until the next backward, and would pin them."""

    def __init__(self, before: Callable[[str], None] | None = None,
                 after: Callable[[Any], BaseException | None] | None = None):
        super().__init__()
        self.before = before
        self.after = after

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _allocates(func):
            return func(*args, **(kwargs or {}))
        if self.before is not None:
            self.before(str(func.overloadpacket.__name__))
        out = func(*args, **(kwargs or {}))
        error = self.after(out) if self.after is not None else None
        if error is not None:
            del out, args, kwargs
            raise error
        return out


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

"""Where the trainer is: the step, the attempt and the phase it is in.

One `PhaseTracker` per process. The resilient step and the loop write it (phase
scopes, `begin_attempt`); OOM reports read their phase, step and attempt from it;
the fault injector listens to it (a new step window resets its allocation count)
and reads it to decide which fault fires. Nothing here allocates device memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Listeners hear (step, attempt, new_step) at the start of every attempt.
AttemptListener = Callable[[int, int, bool], None]


class PhaseTracker:
    """The current step, attempt and phase name, and whether host work is running."""

    def __init__(self) -> None:
        self.step = -1
        self.attempt = 0
        self.phase = "idle"  # what reports and the allocation census name
        self.host_depth = 0  # > 0 inside host work (data loading, writing reports)
        self._error_phase: str | None = None
        self._listeners: list[AttemptListener] = []

    def subscribe(self, listener: AttemptListener) -> None:
        self._listeners.append(listener)

    def begin_attempt(self, step: int, attempt: int) -> None:
        new_step = step != self.step
        self.step, self.attempt = step, attempt
        self._error_phase = None  # an error handled elsewhere must not name a later one
        for listener in self._listeners:
            listener(step, attempt, new_step)

    @contextmanager
    def phase_scope(self, phase: str) -> Iterator[None]:
        """Name what the trainer is doing. Nested inside loop-level work the name says
        both ("validate/forward")."""
        previous = self.phase
        self.phase = phase if previous in ("idle", phase) else f"{previous}/{phase}"
        try:
            yield
        except BaseException:
            # The innermost phase an error came through: what its report names.
            if self._error_phase is None:
                self._error_phase = phase
            raise
        finally:
            self.phase = previous

    def take_error_phase(self) -> str:
        """The phase the last error was raised in (then forgotten)."""
        phase, self._error_phase = self._error_phase or self.phase, None
        return phase

    @contextmanager
    def host_work(self) -> Iterator[None]:
        """Host-memory work (data loading, writing reports): not a device allocation."""
        self.host_depth += 1
        try:
            yield
        finally:
            self.host_depth -= 1

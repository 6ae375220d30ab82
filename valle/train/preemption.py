"""Graceful preemption: SIGTERM/SIGUSR1 -> stop at the next step boundary, save, exit.

Clusters announce the end of a job with a signal and a grace period: SLURM's
`scancel` and `--signal`, a Kubernetes eviction, a spot instance's notice; torchrun
forwards SIGTERM to its workers and kills them 30 s later. The handler only sets a
flag. The flag rides in the step's existing vote (no extra collective), so every
rank learns it at the same vote and stops after the same step; then the loop writes
one checkpoint (atomic, with every rank's sampler position) and the process exits
with EXIT_PREEMPTED. Requeuing the same command resumes from it, no step redone.

The grace budget (`--preempt-grace-s`) is a deadline, armed at the signal (or, on a
rank that was not signalled, when its vote says so): a step or a validation that
cannot end in time must not leave a half-written file behind, so at the deadline
the process exits with EXIT_PREEMPTED_NO_CHECKPOINT without writing anything; every
checkpoint write is a rename of a complete file, so the last one stays the newest
valid checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator

logger = logging.getLogger(__name__)

# Exit codes (docs/training.md), after the failure codes 10-16 of valle.train.loop (75 is
# the stall watchdog's).
EXIT_PREEMPTED = 17  # stopped at a step boundary, checkpoint written: requeue resumes it
EXIT_PREEMPTED_NO_CHECKPOINT = 18  # grace ran out or the write failed: requeue resumes from the last one

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """The stop flag, its signal handlers and its deadline, for one training run."""

    def __init__(self, grace_s: float, rank: int = 0):
        self.grace_s = grace_s
        self.rank = rank
        self.signal_name: str | None = None  # the first signal received, if any
        self.stop_voted = False  # some rank's vote said stop
        self._deadline: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    # -- installation ------------------------------------------------------------

    def install(self) -> None:
        """Handle the preemption signals (main thread only: Python's rule)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    # -- the flag -------------------------------------------------------------------

    def _on_signal(self, signum: int, frame) -> None:
        # A handler runs between bytecodes of the main thread: set the flag, arm the
        # deadline, nothing else (no I/O that could deadlock, no exception). A second
        # signal changes nothing: the first one's deadline stands.
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self._arm(f"{self.signal_name} received")

    def requested(self) -> bool:
        """This rank's own stop request (its vote slot)."""
        return self.signal_name is not None

    def note_vote(self) -> None:
        """The step's vote said stop (some rank was signalled): arm this rank's deadline."""
        if not self.stop_voted:
            self.stop_voted = True
            logger.warning("preemption (%s): stopping after this step, then saving a "
                           "checkpoint (grace %.0f s)", self.signal_name or "signal on another rank",
                           self.grace_s)
            self._arm("another rank was signalled")

    def _arm(self, why: str) -> None:
        if self._deadline is not None or self.grace_s <= 0:
            return
        self._deadline = threading.Timer(self.grace_s, self._expire, args=(why, time.monotonic()))
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self, why: str, armed_at: float) -> None:
        # Whatever the main thread is doing (a long step, a collective waiting for a
        # peer that is already gone, a checkpoint write), stop now: a write in progress
        # is a temporary file that is never picked at resume.
        logger.error("preemption: the grace period (%.0f s after %s) ran out before the "
                     "checkpoint was written; exiting with %d, requeue resumes from the last "
                     "checkpoint", time.monotonic() - armed_at, why, EXIT_PREEMPTED_NO_CHECKPOINT)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED_NO_CHECKPOINT)

    # -- helpers for the loop ---------------------------------------------------------

    def until_requested(self, batches: Iterable) -> Iterator:
        """`batches`, cut short once this rank is asked to stop (validation: rank-local
        work with one vote at its end, so a rank may stop early without a mismatch)."""
        for batch in batches:
            if self.requested():
                return
            yield batch

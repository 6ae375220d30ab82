"""Stall watchdog: a step that runs far longer than usual ends the run, loudly.

A hang in a collective (a peer stuck, a mismatch the backend cannot see) shows
up as a step that never ends. A daemon thread compares the running step's age
with the recent median; past `max(stall_min_seconds, stall_factor * median)`
it writes every thread's Python stack to the log and stderr and exits the
process non-zero, so torchrun (or the user) sees a failure instead of a node
that burns hours silently. Every rank runs its own watchdog: the stalled rank
and the ranks waiting for it all dump their stacks.

The ranks of a stalled step fire within a poll interval or so of each other
(their steps start together: the previous step ended in a collective). A rank
that fires waits a grace period after its dump before it exits: exiting at
once would make its peers' pending collectives fail with a connection error
(and torchrun SIGTERM them) before their own watchdogs dumped their stacks.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from valle.train.storage import storage_error

logger = logging.getLogger(__name__)

STALL_EXIT_CODE = 75


class StallWatchdog:
    def __init__(self, stall_factor: float, stall_min_seconds: float, dump_path: Path | None,
                 rank: int = 0, history: int = 50, poll_seconds: float = 0.5):
        self.factor = stall_factor
        self.min_seconds = stall_min_seconds
        self.dump_path = dump_path
        self.rank = rank
        self.durations: deque[float] = deque(maxlen=history)
        self.poll_seconds = poll_seconds
        self._started: float | None = None
        self._step = -1
        # Time the running step spent paused (a torch.compile: --compile), not counted.
        self._paused_since: float | None = None
        self._paused_total = 0.0
        self._pause_depth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    def limit(self) -> float:
        median = statistics.median(self.durations) if self.durations else 0.0
        return max(self.min_seconds, self.factor * median)

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        self._paused_total = 0.0
        self._step, self._started = step, time.monotonic()
        try:
            yield
        finally:
            self.durations.append(self.age())
            self._started = None

    def pause(self) -> None:
        """Stop the running step's clock (a compile: legitimately long, and no hang).
        Pauses nest: the clock runs again when every pause was resumed."""
        self._pause_depth += 1
        if self._paused_since is None:
            self._paused_since = time.monotonic()

    def resume(self) -> None:
        self._pause_depth = max(0, self._pause_depth - 1)
        if self._pause_depth == 0:
            since, self._paused_since = self._paused_since, None
            if since is not None:
                self._paused_total += time.monotonic() - since

    def age(self) -> float:
        """Seconds the running step has run, paused time excluded (0 between steps)."""
        started, since = self._started, self._paused_since
        if started is None:
            return 0.0
        now = time.monotonic()
        paused = self._paused_total + (now - since if since is not None else 0.0)
        return max(0.0, now - started - paused)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            if self._started is None or self._paused_since is not None:
                continue
            age = self.age()
            if age > self.limit():
                self._fire(age)

    def grace_seconds(self) -> float:
        """How long a firing rank waits after its dump before it exits (see the module doc)."""
        return min(60.0, 2 * self.poll_seconds + 0.1 * self.limit())

    def _fire(self, age: float) -> None:
        limit, grace = self.limit(), self.grace_seconds()
        message = (f"rank {self.rank}: step {self._step} has run {age:.2f} s, over the stall limit "
                   f"of {limit:.1f} s (--stall-factor {self.factor} x median step, at least "
                   f"--stall-min-seconds {self.min_seconds}); stacks of every thread follow, then "
                   f"exit {STALL_EXIT_CODE}")
        # The dump file first: it shares no lock with the stuck main thread.
        if self.dump_path is not None:
            try:
                self.dump_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.dump_path, "a") as f:
                    f.write(message + "\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
            except OSError as exc:  # a full disk: the stacks still go to stderr, the exit stays
                print(f"could not write {self.dump_path}: {storage_error(exc)}", file=sys.stderr)
        # Exit even if the main thread holds a lock that logging or stderr needs.
        # os._exit: the main thread is stuck (in a collective or a sleep); a normal
        # exit would wait for it forever.
        hard_exit = threading.Timer(grace + 5.0, os._exit, (STALL_EXIT_CODE,))
        hard_exit.daemon = True
        hard_exit.start()
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        logger.error(message)
        for handler in logging.getLogger().handlers:
            handler.flush()
        time.sleep(grace)  # let the peers' watchdogs dump their stacks too
        os._exit(STALL_EXIT_CODE)

    def close(self) -> None:
        self._stop.set()

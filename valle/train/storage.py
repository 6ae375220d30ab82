"""The trainer's one policy for a full or failing disk.

Every file the trainer writes goes through `Storage.write`: checkpoints (step, epoch,
preemption and grad-scale checkpoints, each with its averaged model), best models, the
epoch and run summaries, the quarantine list, OOM reports, the unreadable/trained cut
lists, TensorBoard events and validation samples. A storage error there (ENOSPC, EDQUOT,
EIO, EROFS, EFBIG, ...) is one error line naming the file, the error and the newest good
checkpoint; the run goes on without that file. Nothing is deleted to make room.

Checkpoints are what a resume needs, so their outcome counts (the loop agrees it on every
rank through the control channel first): after `--max-failed-saves` failed checkpoint
saves in a row, or when the run's last save failed (its final state is not on disk), every
rank stops with `UnsavedStateError`, exit `EXIT_UNSAVED`, naming the newest good
checkpoint the same command resumes from.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EXIT_UNSAVED = 20  # the run's state could not be written (docs/training.md)

# What the trainer writes, by the name `--inject-fault disk@KIND:N` uses, and as the log says it.
WRITES = {
    "save": "checkpoint",
    "best": "best model",
    "summary": "summary",
    "quarantine": "quarantine list",
    "oom": "OOM report",
    "report": "cut list",
    "tensorboard": "TensorBoard events",
    "samples": "validation samples",
}


class UnsavedStateError(RuntimeError):
    """The run's newest state could not be written: too many failed checkpoint saves in a
    row, or the last one of the run."""


def storage_error(exc: OSError) -> str:
    """An OSError as the user needs it: errno name and message, and the file."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{name + ': ' if name else ''}{exc.strerror or exc}{where}"


class Storage:
    """Writes under one policy (module doc). `faults`: the run's FaultInjector, whose
    `maybe_fail_write(kind, path)` fails chosen writes as a full disk does (tests)."""

    def __init__(self, exp_dir: str | Path | None = None, max_failed_saves: int = 0,
                 faults: Any = None) -> None:
        self.exp_dir = Path(exp_dir) if exp_dir is not None else None
        self.max_failed_saves = max_failed_saves
        self.faults = faults
        self.failed_saves = 0  # checkpoint saves failed in a row (agreed: equal on every rank)
        self.unsaved: Path | None = None  # the newest checkpoint that could not be written
        self.said: Path | None = None  # the last file whose failed write this rank said

    def write(self, kind: str, path: str | Path, fn: Callable[[], Any]) -> bool:
        """Run `fn`, which writes `path`; False (said once, with the newest good
        checkpoint) on a storage error. Other errors propagate: they are bugs."""
        try:
            if self.faults is not None:
                self.faults.maybe_fail_write(kind, path)
            fn()
            return True
        except OSError as exc:
            self.report(kind, path, exc)
            return False

    def report(self, kind: str, path: str | Path, exc: OSError) -> None:
        failed = self.failed_saves + 1  # counting this one (the vote makes it official)
        if kind != "save":
            after = "training goes on without it"
        elif 0 < self.max_failed_saves <= failed:
            after = f"{failed} failed in a row (--max-failed-saves {self.max_failed_saves}): the run stops"
        else:
            limit = (f"the run stops at --max-failed-saves {self.max_failed_saves}"
                     if self.max_failed_saves > 0 else "--max-failed-saves 0: it never stops for it")
            after = f"training goes on, the next save tries again ({failed} failed in a row; {limit})"
        self.said = Path(path)
        if exc.filename is not None and str(exc.filename) == str(path):
            exc = OSError(exc.errno, exc.strerror)  # the path is said once
        logger.error("could not write %s %s: %s; %s; the newest good checkpoint is %s",
                     WRITES.get(kind, kind), path, storage_error(exc), after, self.newest_good())

    def newest_good(self) -> str:
        """The checkpoint a resume would start from, for messages."""
        from valle.train.checkpoint import readable_checkpoints

        if self.exp_dir is None:
            return "none (this writer has no run directory)"
        # Reading checkpoint headers (torch.load, mmap) is host work, not device memory.
        phases = getattr(self.faults, "phases", None)
        with phases.host_work() if phases is not None else contextlib.nullcontext():
            newest = next(iter(readable_checkpoints(self.exp_dir)), None)
        return str(newest) if newest is not None else "none (a resume starts afresh)"

    # -- checkpoints: the agreed outcome --------------------------------------------

    def note_save(self, path: Path, written: bool) -> None:
        """Count a checkpoint's agreed outcome (call on every rank); raise UnsavedStateError
        at --max-failed-saves failures in a row."""
        if written:
            self.failed_saves, self.unsaved = 0, None
            return
        self.failed_saves += 1
        self.unsaved = path
        if 0 < self.max_failed_saves <= self.failed_saves:
            raise UnsavedStateError(
                f"{self.failed_saves} checkpoint saves in a row could not be written (the last: "
                f"{path}; --max-failed-saves {self.max_failed_saves}; the errors above say why, "
                f"most often a full or failing disk): training on would only grow the work a "
                f"crash loses. "
                f"{self._resume_hint()}")

    def check_final(self) -> None:
        """At the end of training: the run's last checkpoint must be on disk."""
        if self.unsaved is not None:
            raise UnsavedStateError(
                f"the run's final state ({self.unsaved}) could not be written. "
                f"{self._resume_hint()}")

    def _resume_hint(self) -> str:
        return (f"The newest good checkpoint is {self.newest_good()}; free space or fix the "
                f"storage under {self.exp_dir} and run the same command: it resumes from there "
                f"(exit code {EXIT_UNSAVED})")


# -- TensorBoard's writer thread ------------------------------------------------------

_hook_lock = threading.Lock()
_hook_installed = False


def quiet_tensorboard_thread() -> None:
    """TensorBoard writes events from a thread that, on a failed write (a full disk), prints
    a traceback and dies; the error also reaches the next call from the trainer, where
    `Storage.write` says it once. This drops the thread's own traceback (only for that
    thread class; every other thread's exceptions go to the previous hook)."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            if (type(args.thread).__name__ == "_AsyncWriterThread"
                    and isinstance(args.exc_value, OSError)):
                return
            previous(args)

        threading.excepthook = hook
        _hook_installed = True


def warn_console(message: str) -> None:
    """One line to stderr, for when the log file itself cannot be written."""
    try:
        print(message, file=sys.stderr, flush=True)
    except OSError:
        pass


__all__ = ["EXIT_UNSAVED", "WRITES", "Storage", "UnsavedStateError", "quiet_tensorboard_thread",
           "storage_error", "warn_console"]

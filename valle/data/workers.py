"""DataLoader worker processes that neither outlive their parent nor inherit its open files.

A forked worker holds a copy of every file descriptor its parent had open at the fork,
and with it the parent's ``flock`` locks (HDF5 takes one on every file it opens). When the
parent is killed (SIGKILL, OOM killer, a launcher stopping it), torch's workers notice
only when they next poll their index queue, every 5 s, and never while decoding a long
file or blocked on a full queue: until then they keep the files and their locks, and a
relaunch at once fails on them (issue 50). So the loaders here

* fork their workers before opening any file they write (``bin/tokenizer.py``'s chunk
  file is opened after ``iter(loader)``), and drop lhotse's cached HDF5 handles before a
  fork (``forget_cached_files``);
* give every worker ``worker_init_fn()``: the kernel SIGKILLs it the moment its parent
  dies (Linux ``PR_SET_PDEATHSIG``; elsewhere it does nothing and torch's poll remains).
"""

from __future__ import annotations

import functools
import os
import signal
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int, worker_id: int = 0) -> None:
    """In a freshly forked worker: be SIGKILLed when the process that forked it exits. A
    parent that died before this ran (the worker was already adopted) ends the worker now."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):  # not Linux: torch's own poll of the parent remains
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def worker_init_fn():
    """``worker_init_fn`` for a DataLoader iterated on this thread: workers die with this
    process. The kernel's signal follows the *thread* that forked, so a loader made off the
    main thread (which may end before the process) gets none."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return functools.partial(die_with_parent, os.getpid())


def forget_cached_files() -> None:
    """Close lhotse's process-wide cache of open feature files (HDF5 handles it keeps for
    ``cut.load_features()``), so workers forked next do not inherit them and their locks;
    the parent reopens what it reads again."""
    from lhotse.features.io import close_cached_file_handles

    close_cached_file_handles()

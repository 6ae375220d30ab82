"""StallWatchdog (valle.train.watchdog).

Firing ends the process with os._exit, so every case that may fire runs in a
subprocess (with a hard timeout); the pure limit arithmetic runs in-process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from valle.train.watchdog import STALL_EXIT_CODE, StallWatchdog

REPO = Path(__file__).resolve().parents[2]
POLL = 0.05

# Runs `steps` (a list of seconds) under one watchdog, each inside a function whose
# name the stack dump must show; prints when each step starts, and the final limit if the
# process gets that far.
SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from valle.train.watchdog import StallWatchdog

    factor, min_seconds, dump, steps = json.loads(sys.argv[1])
    wd = StallWatchdog(factor, min_seconds, Path(dump), rank=3, poll_seconds={poll})

    def stuck_in_this_step(seconds):
        time.sleep(seconds)

    for i, seconds in enumerate(steps):
        with wd.step(i):
            print("step", i, "started", time.monotonic(), flush=True)
            stuck_in_this_step(seconds)
    wd.close()
    print("limit", wd.limit(), flush=True)
""").format(poll=POLL)


def run_steps(tmp_path: Path, factor: float, min_seconds: float, steps: list[float],
              timeout: float = 30) -> tuple[subprocess.CompletedProcess, Path, float]:
    dump = tmp_path / "log" / "stall-rank3.txt"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([factor, min_seconds,
                                                                     str(dump), steps])],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=timeout)
    return proc, dump, time.monotonic() - started


def last_step_age(proc: subprocess.CompletedProcess) -> float:
    """How long the stuck step had run when the watchdog fired (from its message)."""
    return float(re.search(r"step \d+ has run ([\d.]+) s", proc.stderr).group(1))


@pytest.mark.timeout(60)
def test_fires_after_the_limit_with_exit_75_and_stacks(tmp_path):
    proc, dump, elapsed = run_steps(tmp_path, factor=5.0, min_seconds=0.5,
                                    steps=[0.01, 0.01, 0.01, 30.0])
    assert proc.returncode == STALL_EXIT_CODE, (proc.returncode, proc.stderr)
    assert "step 3 started" in proc.stdout and "limit" not in proc.stdout  # exited mid-step
    text = dump.read_text()
    assert "rank 3: step 3 has run" in text and f"exit {STALL_EXIT_CODE}" in text
    # Every thread's stack: the watchdog's own and the main thread, stuck where it is.
    assert text.count("Thread 0x") + text.count("Current thread 0x") >= 2
    assert 'File "<string>"' in text and "stuck_in_this_step" in text
    assert "stuck_in_this_step" in proc.stderr  # stderr gets the stacks too
    # Fired past the limit (0.5 s: the median is tiny), within a few polls of it.
    assert 0.5 < last_step_age(proc) < 0.5 + 10 * POLL
    assert elapsed < 20  # start-up + 0.5 s + grace, never the 30 s sleep


@pytest.mark.timeout(60)
def test_normal_steps_do_not_fire(tmp_path):
    # Steady steps, then one three times as long as usual but under the limit (0.5 s).
    proc, dump, _ = run_steps(tmp_path, factor=10.0, min_seconds=0.5,
                              steps=[0.02] * 15 + [0.3, 0.02])
    assert proc.returncode == 0, proc.stderr
    assert "limit" in proc.stdout
    assert not dump.exists()


@pytest.mark.timeout(60)
def test_limit_follows_the_median(tmp_path):
    # Steps of 0.2 s (after one short one, each under the limit of its time): the limit
    # becomes 3 x median = 0.6 s, far above --stall-min-seconds (0.1 s).
    warm_up = [0.08, 0.2, 0.2, 0.2]
    # A 0.4 s step passes (it would fire under the minimum alone) ...
    proc, dump, _ = run_steps(tmp_path, factor=3.0, min_seconds=0.1, steps=warm_up + [0.4])
    assert proc.returncode == 0, proc.stderr
    assert not dump.exists()
    # ... and a stuck step fires at the median-derived limit, not at the minimum.
    proc, dump, _ = run_steps(tmp_path, factor=3.0, min_seconds=0.1, steps=warm_up + [30.0])
    assert proc.returncode == STALL_EXIT_CODE, proc.stderr
    limit = float(re.search(r"over the stall limit of ([\d.]+) s", dump.read_text()).group(1))
    assert 0.6 <= limit < 0.75  # 3 x the median of ~0.2 s steps (sleep may overrun a little)
    assert limit < last_step_age(proc) < limit + 10 * POLL


def test_limit_arithmetic():
    wd = StallWatchdog(4.0, 1.0, None, poll_seconds=10.0)  # the thread never polls
    try:
        assert wd.limit() == 1.0  # no history: the minimum
        wd.durations.extend([0.1, 0.1, 0.1])
        assert wd.limit() == 1.0  # 4 x 0.1 is under the minimum
        wd.durations.extend([2.0, 2.0, 2.0, 2.0])
        assert wd.limit() == pytest.approx(8.0)  # 4 x median 2.0
        wd.durations.append(1000.0)  # one outlier does not move the median much
        assert wd.limit() == pytest.approx(8.0)
        with wd.step(0):
            pass
        assert len(wd.durations) == 9  # a step records its duration
    finally:
        wd.close()

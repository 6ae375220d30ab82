"""Smoke runs of the trainer's benchmark scripts (`make bench`): they run and print their
tables, so a moved module or a renamed function fails here, not in a benchmark run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_bench_host_prints_trainer_vs_bare_loop():
    proc = subprocess.run([sys.executable, "scripts/bench_host.py", "--sizes", "tiny",
                           "--tiny-steps", "2", "--repeats", "1", "--ranks", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| bare loop (torch AdamW) |" in proc.stdout
    assert "| trainer, AdamW |" in proc.stdout

"""scripts/bench_codec.py (make bench) runs and prints its table; with the package present it
also checks both models give the same codes before timing them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_bench_codec_prints_throughput_rows():
    proc = subprocess.run([sys.executable, "scripts/bench_codec.py", "--threads", "1", "--clips", "1",
                           "--seconds", "0.5", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| valle |" in proc.stdout
    try:
        import encodec  # noqa: F401
    except ImportError:
        return
    assert "| encodec 0.1.1 |" in proc.stdout and "| valle / encodec |" in proc.stdout

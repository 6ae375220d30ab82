"""scripts/bench_models.py (`make bench`, `make gpu-check`) runs end to end at a tiny size: every
table, the KV-cache decoding one included (its unpacking of the AR's output once broke it
after the GPU tables had printed). A smoke test, not a timing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_bench_models_prints_every_table_at_a_tiny_size():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_models.py"), "--device", "cpu",
           "--dropouts", "0.0", "--repeats", "1", "--decoder-dim", "32", "--nhead", "4",
           "--num-decoder-layers", "1", "--batch-size", "2", "--text-len", "12",
           "--audio-len", "30", "--prompt-frames", "10", "--decode-frames", "20"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=170,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    for title in ("## Training step", "## AR training step with the guided-attention loss",
                  "## AR decoding: 20 frames", "| AR with KV cache |", "| NAR, 7 stages"):
        assert title in done.stdout, title

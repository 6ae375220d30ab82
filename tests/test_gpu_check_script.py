"""`make gpu-check`'s script, smoke-tested on the CPU (`--device cpu --quick`): a drawn
device only has to run it. Every section it writes for the host-overhead and decoding
items is there, with numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(420)
def test_gpu_check_runs_its_cpu_path(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick"],
                          cwd=ROOT, env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "gpu-check.md").read_text()
    # --max-duration auto (item 5): on CPU the meter is the device
    assert re.search(r"auto = \d+ cuts per global batch.*OOM events 0 \(goal 0\)", report), report
    assert "failed:" not in report, report
    assert "need CUDA: skipped" in report
    # a marginal time (the slope over steps): on a loaded CPU with one repeat it can come out
    # negative; the smoke test asks that it is a number, not that it is meaningful here
    assert re.search(r"\| 32 \| trainer, AdamW \| -?[\d.]+ \| -?[\d.]+x \|", report), report
    assert re.search(r"16x the audio per step costs -?[\d.]+x the step time", report)
    for batch in (1, 8):
        for mode in ("growing KV cache", "static cache"):
            assert re.search(rf"\| {batch} \| {mode} \| [\d.]+ \| \d+ \| [\d.]+ \|", report), report
    # --compile (item 7): the fault run finished its steps, and eager vs --compile was timed
    assert "## --compile: real OOMs" in report, report
    assert re.search(r"exit code 0, steps 4 \(expected 4\)", report), report
    assert "bench_compile.py" in report, report
    # EnCodec tokenization throughput (item 8), batched as the tokenizer batches
    assert re.search(r"\| [\d.]+ \| [\d.]+ \| [\d.]+x \|", report.split("## EnCodec tokenization")[1]), report

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
    assert "| bare loop (torch fused AdamW) |" in proc.stdout
    assert "| trainer, AdamW |" in proc.stdout


def _load_bench_host():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_host", ROOT / "scripts" / "bench_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_bench_host_demo_on_lhotse_data(tmp_path):
    """The demo's model on a real egs/tiny lhotse corpus (made as the script makes it), 1 and
    2 gloo ranks: every variant's row, the corpus named; and a corpus whose first epoch is
    shorter than 2N steps is refused, not timed across an epoch end."""
    corpus = _load_bench_host().make_corpus(tmp_path / "tiny", generated=0)
    assert (Path(corpus) / "tiny_cuts_train.jsonl.gz").is_file()
    base = [sys.executable, "scripts/bench_host.py", "--sizes", "demo-lhotse", "--lhotse-dir", corpus,
            "--repeats", "1"]
    proc = subprocess.run([*base, "--demo-steps", "2", "--ranks", "1,2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = proc.stdout.split("| demo-lhotse")[1:]
    assert len(tables) == 2, proc.stdout
    assert "1 rank" in tables[0].splitlines()[0] and "training cuts" in tables[0].splitlines()[0]
    assert "2 gloo ranks" in tables[1].splitlines()[0]
    for table in tables:
        for row in ("| bare loop (torch fused AdamW) |", "| trainer, AdamW |",
                    "| trainer, ScaledAdam + averaging (the demo's) |"):
            assert row in table
    too_long = subprocess.run([*base, "--demo-steps", "400", "--ranks", "1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert too_long.returncode != 0
    assert "fewer than the 400 this needs" in too_long.stderr, too_long.stderr[-2000:]


@pytest.mark.timeout(300)
def test_bench_lora_prints_lora_against_full_fine_tuning():
    proc = subprocess.run([sys.executable, "scripts/bench_lora.py", "--sizes", "demo", "--rank", "4",
                           "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in proc.stdout.splitlines()
            if line.startswith("| ") and "LoRA / full" not in line}
    assert float(rows["optimizer state"][2]) < 0.1  # adapters alone hold optimizer state
    assert float(rows["checkpoint model entry"][2]) < 0.1
    peak = next(v for k, v in rows.items() if k.startswith("peak memory"))
    assert float(peak[2]) < 1.0


@pytest.mark.timeout(300)
def test_bench_memory_prints_checkpointing_ratios_and_the_auto_choice():
    proc = subprocess.run([sys.executable, "scripts/bench_memory.py", "--sizes", "tiny", "--steps", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| tiny |" in proc.stdout and "peak on/off" in proc.stdout
    assert "| model | step ms | step ms counted | ratio |" in proc.stdout
    assert "| tiny | 0.05 |" in proc.stdout  # the auto row: budget, chosen, usable, seconds


@pytest.mark.timeout(600)
def test_bench_startup_prints_its_table(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/bench_startup.py", "--sizes", "30,60", "--repeats", "1",
                           "--data-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 30 |") or line.startswith("| 60 |")]
    assert len(rows) == 2 and rows[0].endswith("| 1.00 | 1.00 | 1.00 |")
    # the replicated part: unique ids, its own extremes record counting them all
    from valle.data.extremes import Extremes

    assert Extremes.read(tmp_path / "cuts-60" / "tiny_extremes_train.json").count == 60


def _fake_valgrind(path: Path, trainer: int, bare: int, fail: bool = False) -> Path:
    """A stand-in for valgrind: prints callgrind's total for a child of `--steps N`,
    2e9 of set-up plus N times the mode's per-step count (or fails)."""
    path.write_text(f"""#!/usr/bin/env bash
{'echo "valgrind: broken" >&2; exit 1' if fail else ''}
mode=""; steps=0
while [ $# -gt 0 ]; do
  case "$1" in --child) mode=$2; shift;; --steps) steps=$2; shift;; esac; shift
done
per={trainer}; [ "$mode" = bare ] && per={bare}
echo "==1== Collected : $((2000000000 + steps * per))" >&2
""")
    path.chmod(0o755)
    return path


def test_bench_host_instructions_reports_marginal_counts_per_checkout(tmp_path):
    """Per-step counts are (I(2N) - I(N)) / N for each checkout's trainer and bare loop,
    the ratio to the first checkout is printed, and a failing valgrind is named."""
    fake = _fake_valgrind(tmp_path / "valgrind", trainer=12_500_000, bare=10_000_000)
    proc = subprocess.run([sys.executable, "scripts/bench_host_instructions.py", "--checkouts",
                           f"{ROOT},{ROOT}", "--steps", "3", "--valgrind", str(fake)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {ROOT} |")]
    assert len(rows) == 2, proc.stdout
    for row in rows:
        assert row == f"| {ROOT} | 12.50 | 10.00 | 1.2500x | 1.0000x |"
    assert "(I(6) - I(3)) / 3" in proc.stdout
    broken = _fake_valgrind(tmp_path / "broken", 1, 1, fail=True)
    proc = subprocess.run([sys.executable, "scripts/bench_host_instructions.py", "--steps", "3",
                           "--valgrind", str(broken)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "failed (exit 1)" in proc.stderr and "valgrind: broken" in proc.stderr


@pytest.mark.timeout(240)
def test_bench_host_instructions_child_runs_the_checkouts_loops():
    """The process valgrind runs: the checkout's own trainer and bare loop, a few steps."""
    for mode in ("trainer", "bare"):
        proc = subprocess.run([sys.executable, "scripts/bench_host_instructions.py", "--child", mode,
                               "--steps", "2", "--checkouts", str(ROOT)], cwd=ROOT,
                              capture_output=True, text=True, timeout=200)
        assert proc.returncode == 0, proc.stderr[-3000:]

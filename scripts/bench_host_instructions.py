#!/usr/bin/env python3
"""The trainer's host work per step in instructions, compared across checkouts.

`scripts/bench_host.py` times the trainer against a bare loop in CPU time, and on
a shared or virtual machine its run-to-run noise (2-3 ms per tiny step) is larger
than the differences a refactor of the step makes. This counts instructions
instead: each loop runs under valgrind's callgrind for N and then 2N tiny steps
(1 rank, 1 thread, synthetic batches, PYTHONHASHSEED=0), and (I(2N) - I(N)) / N is
its marginal instruction count per step, set-up cancelled out. The loops are
bench_host.py's own (`run_trainer`, `run_bare`), taken from each checkout, so
every checkout runs its own trainer and its own bare loop.

    python scripts/bench_host_instructions.py --checkouts /path/to/old,.

Needs valgrind; slow (about 300x: a 10-step run takes ~5 minutes, --jobs at a
time). A per-step count repeats to about 0.2% (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODES = ("trainer", "bare")
_COLLECTED = re.compile(r"Collected : (\d+)")


def run_child(checkout: str, mode: str, steps: int) -> None:
    """Inside valgrind: one loop of `steps` tiny steps from `checkout`'s bench_host."""
    import logging

    sys.path.insert(0, str(Path(checkout) / "scripts"))
    import bench_host
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if mode == "trainer":
        bench_host.run_trainer("tiny", "AdamW", steps, 8, "cpu")
    else:
        bench_host.run_bare("tiny", steps, 8, "cpu")


def count(valgrind: str, checkout: Path, mode: str, steps: int) -> int:
    """Instructions of one child process under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        cmd = [valgrind, "--tool=callgrind", f"--callgrind-out-file={tmp}/callgrind.out",
               sys.executable, str(Path(__file__).resolve()), "--child", mode,
               "--steps", str(steps), "--checkouts", str(checkout)]
        proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    found = _COLLECTED.findall(proc.stderr)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"bench_host_instructions: {mode} at {checkout} ({steps} steps) failed "
                         f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return int(found[-1])


def per_step(counts: dict[int, int], steps: int) -> float:
    """Marginal instructions per step from the N and 2N runs."""
    return (counts[2 * steps] - counts[steps]) / steps


def table(checkouts: list[Path], results: dict[tuple[Path, str, int], int], steps: int) -> str:
    lines = [f"tiny model, 1 rank, 1 thread; marginal instructions per step = (I({2 * steps}) - "
             f"I({steps})) / {steps}, counted by callgrind", "",
             "| checkout | trainer M instr/step | bare M instr/step | trainer / bare | "
             f"trainer vs {checkouts[0].name or checkouts[0]} |", "|---|---|---|---|---|"]
    first = None
    for checkout in checkouts:
        trainer, bare = (per_step({n: results[checkout, mode, n] for n in (steps, 2 * steps)},
                                  steps) for mode in MODES)
        first = trainer if first is None else first
        lines.append(f"| {checkout} | {trainer / 1e6:.2f} | {bare / 1e6:.2f} | "
                     f"{trainer / bare:.4f}x | {trainer / first:.4f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkouts", default=".",
                        help="comma-separated source trees, the first the reference")
    parser.add_argument("--steps", type=int, default=10, help="N (and 2N) tiny steps")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind processes at a time")
    parser.add_argument("--valgrind", default="valgrind")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.checkouts, args.child, args.steps)
        return
    valgrind = shutil.which(args.valgrind)
    if valgrind is None:
        raise SystemExit(f"bench_host_instructions: {args.valgrind!r} not found (--valgrind)")
    checkouts = [Path(c).resolve() for c in args.checkouts.split(",")]
    for checkout in checkouts:
        if not (checkout / "scripts" / "bench_host.py").is_file():
            raise SystemExit(f"bench_host_instructions: {checkout} has no scripts/bench_host.py")
    jobs = [(c, mode, n) for c in checkouts for mode in MODES for n in (args.steps, 2 * args.steps)]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        counted = pool.map(lambda job: count(valgrind, *job), jobs)
        results = dict(zip(jobs, counted))
    print(table(checkouts, results, args.steps))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Memory benchmarks (`make bench`): activation checkpointing, the CPU meter's cost, and
how long `--max-duration auto` takes to choose.

1. --activation-checkpointing on against off: step time (forward + backward as training
   runs it, `ResilientStep.trial`) and peak memory (the memory meter: CUDA's allocator or
   the CPU census), as ratios on/off, at the tiny and the demo model size.
2. The CPU census meter's cost per step: the same step with the meter counting (what
   --memory-budget-gb does on CPU) against without.
3. --max-duration auto (here: --synthetic-batch-size, the synthetic data's budget): the
   seconds the search takes at set-up and what it chose, against a memory budget.

Times are medians of --steps steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    "tiny": ["--decoder-dim", "32", "--nhead", "2", "--num-decoder-layers", "1"],
    "demo": ["--decoder-dim", "256", "--nhead", "4", "--num-decoder-layers", "6"],
}


def build(size: str, device: str, exp: Path, *extra: str):
    from valle.train.build import build_run
    from valle.train.cli import parse_config
    from valle.train.dist import init_distributed

    cfg = parse_config(SIZES[size] + ["--dropout", "0", "--device", device, "--tensorboard", "false",
                                      "--exp-dir", str(exp), "--synthetic-data", "64",
                                      "--synthetic-batch-size", "16", *extra])
    run = build_run(cfg, init_distributed(device))
    run.meter.stop()
    return run


def step_time(run, batch, steps: int) -> float:
    import torch

    times = []
    for i in range(steps + 1):
        started = time.perf_counter()
        run.stepper.trial(batch)
        if run.ctx.device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def step_peak(run, batch) -> int:
    with run.meter.active():
        run.meter.reset_peak()
        run.stepper.trial(batch)
        return run.meter.peak_bytes()


def bench_checkpointing(size: str, device: str, steps: int, tmp: Path) -> str:
    results = {}
    for on in (False, True):
        run = build(size, device, tmp / f"ckpt-{size}-{on}", "--activation-checkpointing", str(on).lower())
        batch = run.data.pessimistic_batches()["longest audio"]
        results[on] = (step_time(run, batch, steps), step_peak(run, batch))
    (t_off, p_off), (t_on, p_on) = results[False], results[True]
    return (f"| {size} | {t_off * 1e3:.1f} | {t_on * 1e3:.1f} | {t_on / t_off:.2f} | "
            f"{p_off / 2**20:.1f} | {p_on / 2**20:.1f} | {p_on / p_off:.2f} |")


def bench_meter_cost(size: str, steps: int, tmp: Path) -> str:
    run = build(size, "cpu", tmp / f"meter-{size}")
    batch = run.data.pessimistic_batches()["longest audio"]
    plain = step_time(run, batch, steps)
    with run.meter.active():
        counted = step_time(run, batch, steps)
    return f"| {size} | {plain * 1e3:.1f} | {counted * 1e3:.1f} | {counted / plain:.2f} |"


def bench_auto(size: str, device: str, budget_gb: float, tmp: Path) -> str:
    started = time.perf_counter()
    run = build(size, device, tmp / f"auto-{size}", "--max-duration", "auto",
                "--memory-budget-gb", str(budget_gb))
    seconds = time.perf_counter() - started
    chosen = run.cfg.corpus_record["autobatch"]
    return (f"| {size} | {budget_gb:g} | {run.cfg.synthetic_batch_size} | "
            f"{chosen['limit_bytes'] / 2**20:.0f} | {seconds:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sizes", default="tiny,demo")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-gb", type=float, default=0.05,
                        help="--memory-budget-gb of the auto row (on CUDA: 0 = the free memory)")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    print(f"command: {' '.join(sys.argv)}\n")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("| model | step ms off | step ms on | time on/off | peak MiB off | peak MiB on | "
              "peak on/off |\n|---|---|---|---|---|---|---|")
        for size in sizes:
            print(bench_checkpointing(size, args.device, args.steps, tmp))
        if args.device == "cpu":
            print("\nThe CPU meter (counting every step, as under --memory-budget-gb):\n")
            print("| model | step ms | step ms counted | ratio |\n|---|---|---|---|")
            for size in sizes:
                print(bench_meter_cost(size, args.steps, tmp))
        print("\n--max-duration auto (synthetic data: the batch size in cuts) at set-up:\n")
        print("| model | --memory-budget-gb | chosen | usable MiB | seconds |\n|---|---|---|---|---|")
        print(bench_auto(sizes[0], args.device, args.budget_gb, tmp))


if __name__ == "__main__":
    main()

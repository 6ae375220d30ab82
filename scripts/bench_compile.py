#!/usr/bin/env python3
"""Steps/s of the resilient training step, eager against --compile, side by side.

For each model size, two runs are built exactly as bin/trainer.py builds them (same
flags, --synthetic-data, the one difference being --compile) and step through the same
batches. The compiled run's first steps compile (reported as compile seconds); then
blocks of steps alternate (eager, compiled, eager, ...) so drift in machine speed hits
both alike, and the median block time per step is reported.

    python scripts/bench_compile.py --device cpu            # the CPU table of docs/benchmarks.md
    python scripts/bench_compile.py --device cuda --sizes demo   # scripts/gpu_check.py
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {
    "tiny": ["--decoder-dim", "32", "--nhead", "2", "--num-decoder-layers", "1"],
    "demo": ["--decoder-dim", "128", "--nhead", "4", "--num-decoder-layers", "2"],
}


def build(size: str, device: str, compile_: bool, exp: Path, stage: int, batch: int,
          backend: str = "inductor"):
    from valle.train.cli import parse_config
    from valle.train.dist import init_distributed
    from valle.train.loop import build_run

    argv = [*SIZES[size], "--dropout", "0", "--device", device, "--tensorboard", "false",
            "--oom-check", "false", "--exp-dir", str(exp), "--synthetic-data", "64",
            "--synthetic-batch-size", str(batch), "--train-stage", str(stage),
            "--compile", str(compile_).lower(), "--compile-backend", backend]
    return build_run(parse_config(argv), init_distributed(device))


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed_steps(run, batches, first_step: int, count: int, device: str) -> float:
    """Seconds per step over `count` steps."""
    sync(device)
    start = time.perf_counter()
    for i in range(count):
        run.stepper.run(first_step + i, next(batches))
    sync(device)
    return (time.perf_counter() - start) / count


def bench_size(size: str, args: argparse.Namespace, tmp: Path) -> dict:
    eager = build(size, args.device, False, tmp / f"{size}-eager", args.stage, args.batch)
    compiled = build(size, args.device, True, tmp / f"{size}-compiled", args.stage, args.batch,
                     args.backend)
    drawn = list(eager.data.train_batches(1))  # the same batches for both, cycled
    streams = {"eager": itertools.cycle(drawn), "compiled": itertools.cycle(drawn)}
    runs = {"eager": eager, "compiled": compiled}
    started = time.perf_counter()
    # Warm-up: one pass over the distinct batch shapes (the compiled run compiles here).
    warm = {name: timed_steps(run, streams[name], 0, len(drawn), args.device) * len(drawn)
            for name, run in runs.items()}
    per_step: dict[str, list[float]] = {name: [] for name in runs}
    step = len(drawn)
    for _ in range(args.blocks):
        for name, run in runs.items():
            per_step[name].append(timed_steps(run, streams[name], step, args.block_steps,
                                              args.device))
        step += args.block_steps
    stats = compiled.compiler.stats
    row = {
        "size": size,
        "eager": 1.0 / statistics.median(per_step["eager"]),
        "compiled": 1.0 / statistics.median(per_step["compiled"]),
        "first_pass_s": warm,
        "compile_s": stats.seconds,
        "compiles": stats.compiles,
        "recompiles": stats.recompiles,
        "shapes": len(stats.shapes),
        "wall_s": time.perf_counter() - started,
    }
    compiled.compiler.close()
    for run in runs.values():
        run.watchdog.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", default="tiny,demo", help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--stage", type=int, default=0, choices=(0, 1, 2))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--block-steps", type=int, default=4)
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend (aot_eager: the plumbing without inductor's code "
                        "generation, as the CPU smoke test of scripts/gpu_check.py runs it)")
    args = p.parse_args()
    import torch

    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else
             f" ({torch.get_num_threads()} threads)") + f", stage {args.stage}, batch {args.batch}, "
          f"{args.blocks} blocks of {args.block_steps} steps, 64 synthetic cuts, backend {args.backend}", flush=True)
    print("| size | eager steps/s | --compile steps/s | speed-up | compile s | compiles "
          "(recompiles) | padded shapes | first pass s (eager / compiled) |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            r = bench_size(size, args, Path(tmp))
            print(f"| {size} | {r['eager']:.2f} | {r['compiled']:.2f} | "
                  f"{r['compiled'] / r['eager']:.2f}x | {r['compile_s']:.1f} | {r['compiles']} "
                  f"({r['recompiles']}) | {r['shapes']} | {r['first_pass_s']['eager']:.1f} / "
                  f"{r['first_pass_s']['compiled']:.1f} |", flush=True)


if __name__ == "__main__":
    main()

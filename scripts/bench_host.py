#!/usr/bin/env python3
"""The trainer's own per-step host time, against a bare training loop (`make bench`).

"Trainer": `valle.train.loop.train`, the function bin/trainer.py runs (data drawn
from the synthetic sampler, the resilient step with its vote, scheduler, metrics,
logging at --log-interval, watchdog), for N and then 2N steps: the difference
divided by N is its marginal time per step, set-up and teardown cancelled out.
"Bare": zero_grad / forward / backward / torch.optim.AdamW on the same model and
the same batches (drawn up front), also timed at N and 2N steps; with 2 ranks
the model is wrapped in torch DDP. Runs are interleaved and repeated; the
median marginal time is reported. Time is the process's CPU time
(time.process_time): on a shared machine it is what this process itself spent,
nearly free of other processes' load; on CUDA use --clock wall (the host's
CPU time then includes its waits on the device).

`--profile` instead runs the trainer once under torch.profiler, each phase of
the step marked with record_function, and prints the host time per region.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.harness import run_world, values  # noqa: E402

CLOCK = [time.process_time]  # --clock wall: time.perf_counter

SIZES = {
    # the smallest model that still runs every part of the step
    "tiny": ["--decoder-dim", "32", "--nhead", "4", "--num-decoder-layers", "1"],
    # egs/tiny's demo model (synthetic data: codebook 0 keeps its 1024 codes)
    "demo": ["--decoder-dim", "128", "--nhead", "4", "--num-decoder-layers", "2",
             "--guided-attention-weight", "1.0"],
}
# The trainer rows do the bare loop's work (no clipping, no averaged model) unless told.
SAME_WORK = ["--grad-clip", "0", "--average-period", "0"]
DEMO_EXTRA = ["--average-period", "5"]


def trainer_argv(size: str, optimizer: str, steps: int, batch: int, exp_dir: str,
                 device: str) -> list[str]:
    return [*SIZES[size], "--model-name", "valle", "--prefix-mode", "1", "--dropout", "0.0",
            "--optimizer-name", optimizer, "--base-lr", "0.01" if optimizer == "ScaledAdam" else "1e-4",
            "--synthetic-data", str((steps + 4) * batch), "--synthetic-batch-size", str(batch),
            "--num-epochs", "1", "--max-steps", str(steps), "--device", device,
            "--oom-check", "false", "--tensorboard", "false", "--valid-interval", "1000000",
            "--save-every-n", "1000000", "--exp-dir", exp_dir]


def run_trainer(size: str, optimizer: str, steps: int, batch: int, device: str,
                extra: list[str] = SAME_WORK) -> float:
    """Seconds of one `train()` call of `steps` steps (set-up included)."""
    from valle.train.cli import parse_config
    from valle.train.loop import train

    with tempfile.TemporaryDirectory() as exp_dir:
        cfg = parse_config(trainer_argv(size, optimizer, steps, batch, exp_dir, device) + extra)
        start = CLOCK[0]()
        train(cfg)
        elapsed = CLOCK[0]() - start
    logging.getLogger().setLevel(logging.WARNING)  # the next train() logs its set-up only
    return elapsed


def run_bare(size: str, steps: int, batch: int, device: str, profiler=None) -> float:
    """Seconds of `steps` bare steps (after 3 warm-up steps), batches drawn up front."""
    from valle.models import get_model
    from valle.train.build import model_hparams
    from valle.train.cli import parse_config
    from valle.train.data import SyntheticData
    from valle.train.dist import init_distributed

    with tempfile.TemporaryDirectory() as exp_dir:
        cfg = parse_config(trainer_argv(size, "AdamW", steps + 3, batch, exp_dir, device))
    ctx = init_distributed(device, 120)
    torch.manual_seed(cfg.seed)
    model = get_model(model_hparams(cfg, None)).to(ctx.device)
    params = [p for _, p in model.stage_parameters(0)]
    forward = model
    if ctx.distributed:
        forward = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            find_unused_parameters=True, broadcast_buffers=False)
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    batches = list(SyntheticData(cfg, ctx).train_batches(1))[:steps + 3]

    def step(b) -> None:
        optimizer.zero_grad(set_to_none=True)
        on = {k: v.to(ctx.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
              for k, v in b.items()}
        loss, _ = forward(on["text_tokens"], on["text_tokens_lens"], on["audio_features"],
                          on["audio_features_lens"], train_stage=0)
        (loss / int(b["audio_features_lens"].sum())).backward()
        optimizer.step()

    for b in batches[:3]:
        step(b)
    _sync(ctx.device)
    start = CLOCK[0]()
    with profiler if profiler is not None else contextlib.nullcontext():
        for b in batches[3:]:
            step(b)
        _sync(ctx.device)
    return CLOCK[0]() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def marginal(variants: dict, n: int, repeats: int, barrier=None) -> dict[str, float]:
    """Median over repeats of (t(2n) - t(n)) / n per variant, runs interleaved."""
    per: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times = {}
            for k in (n, 2 * n):
                if barrier:
                    barrier()
                times[k] = fn(k)
            per[name].append((times[2 * n] - times[n]) / n)
    return {name: statistics.median(v) for name, v in per.items()}


def variants(args, size: str) -> dict:
    """The bare loop, the trainer doing the same work (AdamW, no clipping, no averaged
    model), and at the demo's size the demo's own settings (ScaledAdam, which clips,
    and the averaged model)."""
    out = {"bare loop (torch AdamW)": lambda k: run_bare(size, k, args.batch, args.device),
           "trainer, AdamW": lambda k: run_trainer(size, "AdamW", k, args.batch, args.device)}
    if size == "demo":
        out["trainer, ScaledAdam + averaging (the demo's)"] = (
            lambda k: run_trainer(size, "ScaledAdam", k, args.batch, args.device, DEMO_EXTRA))
    return out


def one_rank(args, size: str) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    return marginal(variants(args, size), args.steps[size], args.repeats)


def _two_rank_worker(rank: int, world_size: int, args, size: str) -> dict[str, float]:
    import torch.distributed as dist

    from valle.train.dist import init_distributed

    init_distributed("cpu", 120)
    logging.getLogger().setLevel(logging.WARNING)
    return marginal(variants(args, size), args.steps[size], args.repeats, barrier=dist.barrier)


def print_table(title: str, times: dict[str, float]) -> None:
    base = times["bare loop (torch AdamW)"]
    print(f"| {title} | ms/step | vs bare | over bare (ms) |\n|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.3f}x | {(t - base) * 1e3:+.2f} |")
    print()


# -- profile -----------------------------------------------------------------------


@contextlib.contextmanager
def phases_marked():
    """record_function around every named phase of the step, the step itself, the
    loop's data draw and its per-step bookkeeping, for this process only."""
    from torch.profiler import record_function

    from valle.train import loop
    from valle.train.resilience import faults, step

    originals = (faults.FaultInjector.phase_scope, faults.FaultInjector.host_work,
                 step.ResilientStep.run, loop.draw, loop.step_metrics)

    def marked(name, fn):
        def wrapper(*a, **kw):
            with record_function(name):
                return fn(*a, **kw)
        return wrapper

    @contextlib.contextmanager
    def phase_scope(self, phase):
        with record_function(f"phase:{phase}"), originals[0](self, phase):
            yield

    @contextlib.contextmanager
    def host_work(self):
        with record_function("host_work"), originals[1](self):
            yield

    faults.FaultInjector.phase_scope = phase_scope
    faults.FaultInjector.host_work = host_work
    step.ResilientStep.run = marked("ResilientStep.run", originals[2])
    loop.draw = marked("loop.draw (data)", originals[3])
    loop.step_metrics = marked("loop.step_metrics", originals[4])
    try:
        yield
    finally:
        (faults.FaultInjector.phase_scope, faults.FaultInjector.host_work,
         step.ResilientStep.run, loop.draw, loop.step_metrics) = originals


def profile(args, size: str, optimizer: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(args.threads)
    steps = args.steps[size]
    extra = SAME_WORK if optimizer == "AdamW" else DEMO_EXTRA
    run_trainer(size, optimizer, 5, args.batch, args.device, extra)  # warm the caches
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with phases_marked(), torch_profile(activities=activities) as prof:
        run_trainer(size, optimizer, steps, args.batch, args.device, extra)
    bare = torch_profile(activities=activities)
    run_bare(size, steps, args.batch, args.device, profiler=bare)
    marks = ("phase:", "host_work", "ResilientStep.run", "loop.")
    rows = [e for e in prof.key_averages() if e.key.startswith(marks)]
    rows.sort(key=lambda e: -e.cpu_time_total)
    print(f"{size} model, trainer with {optimizer}, {steps} steps under torch.profiler (host "
          "time per step, profiler overhead included; regions nest: the phases are inside "
          "ResilientStep.run)\n")
    print("| region | calls/step | host ms/step |\n|---|---|---|")
    for e in rows:
        if e.count >= steps // 2:  # per-step regions, not set-up or teardown
            print(f"| {e.key} | {e.count / steps:.1f} | {e.cpu_time_total / 1e3 / steps:.3f} |")
    ours = {e.key: e for e in prof.key_averages() if not e.key.startswith(marks)}
    theirs = {e.key: e for e in bare.key_averages()}

    def per_step(table, key, attr):
        e = table.get(key)
        return getattr(e, attr) / steps if e is not None else 0.0

    # Per-step ops only (the trainer's profile also holds its set-up).
    extra = sorted((k for k in ours if per_step(ours, k, "count") >= 0.5),
                   key=lambda k: per_step(theirs, k, "self_cpu_time_total")
                   - per_step(ours, k, "self_cpu_time_total"))
    print(f"\nOps with the most self host time beyond the bare loop's ({steps} bare steps "
          "profiled the same way):\n")
    print("| op | calls/step trainer | calls/step bare | extra self host ms/step |\n|---|---|---|---|")
    for key in extra[:args.top]:
        diff = per_step(ours, key, "self_cpu_time_total") - per_step(theirs, key, "self_cpu_time_total")
        print(f"| {key} | {per_step(ours, key, 'count'):.1f} | {per_step(theirs, key, 'count'):.1f} "
              f"| {diff / 1e3:.3f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="tiny,demo")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tiny-steps", type=int, default=100)
    parser.add_argument("--demo-steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ranks", default="1,2", help="1 and/or 2 (2: gloo, CPU only)")
    parser.add_argument("--profile", action="store_true", help="the profile instead of the timing")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this process's CPU time; wall: elapsed time")
    args = parser.parse_args()
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    args.steps = {"tiny": args.tiny_steps, "demo": args.demo_steps}
    logging.basicConfig(level=logging.WARNING)
    print(f"command: python scripts/bench_host.py {' '.join(sys.argv[1:])}".rstrip())
    sizes = args.sizes.split(",")
    if args.profile:
        for size in sizes:
            for optimizer in ("AdamW", "ScaledAdam"):
                profile(args, size, optimizer)
        return
    print(f"synthetic data, batch {args.batch}, fp32, {args.device}, {args.threads} thread(s), "
          f"{'process CPU' if args.clock == 'cpu' else 'wall'} time; "
          f"marginal time per step = (t(2N) - t(N)) / N, N = "
          f"{', '.join(f'{args.steps[s]} ({s})' for s in sizes)}; median of {args.repeats} "
          "interleaved repeats\n")
    ranks = [int(r) for r in args.ranks.split(",")]
    for size in sizes:
        desc = " ".join(SIZES[size][1::2][:3])
        if 1 in ranks:
            print_table(f"{size} (d, heads, layers = {desc}), 1 rank", one_rank(args, size))
        if 2 in ranks and args.device == "cpu":
            results = values(run_world(_two_rank_worker, 2, args, size, timeout=1800))
            slowest = {name: max(r[name] for r in results) for name in results[0]}
            print_table(f"{size}, 2 gloo ranks (bare: torch DDP)", slowest)


if __name__ == "__main__":
    main()

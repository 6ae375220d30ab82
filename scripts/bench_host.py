#!/usr/bin/env python3
"""The trainer's own per-step host time, against a bare training loop (`make bench`).

"Trainer": `valle.train.loop.train`, the function bin/trainer.py runs (data drawn
from its sampler, the resilient step with its vote, scheduler, metrics, logging at
--log-interval, watchdog), for N and then 2N steps: the difference divided by N is
its marginal time per step, set-up and teardown cancelled out. "Bare": zero_grad /
forward / backward / torch.optim.AdamW(fused=True) on the same model and the same batches
(drawn up front from the same data), also timed at N and 2N steps; with 2 ranks
the model is wrapped in torch DDP.

Sizes: "tiny" and "demo" train on synthetic token batches (--batch cuts per step);
"demo-lhotse" is the demo's model on real lhotse data: an egs/tiny corpus (the
demo's recipe: eSpeak voices, mel-rvq codes with 128 codes in codebook 0), read by
the trainer's own data module with the demo's --max-duration 16 and one DataLoader
worker (--lhotse-dir names a tokenized dir; else one is made, about 40 s). All N
and 2N steps stay inside the first epoch (an epoch end would add its checkpoint and
summary to one side only): a corpus too small for that is refused.

Runs are interleaved and repeated; the median marginal time is reported. Time is
the process's CPU time (time.process_time): on a shared machine it is what this
process itself spent, nearly free of other processes' load (DataLoader workers are
other processes: their time is not counted); on CUDA use --clock wall (the host's
CPU time then includes its waits on the device).

`--profile` instead runs the trainer once under torch.profiler, each phase of
the step marked with record_function, and prints the host time per region.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
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
# The demo's model on the demo's data: its codec's codebook 0 holds 128 codes (egs/tiny/run.sh).
SIZES["demo-lhotse"] = [*SIZES["demo"], "--ar-codebook-size", "128"]
LHOTSE_SIZES = {"demo-lhotse"}
# egs/tiny/run.sh's data flags, with one loader worker (the data off the critical path).
LHOTSE_FLAGS = ["--dataset", "tiny", "--max-duration", "16", "--max-text-tokens", "400",
                "--num-workers", "1"]
# The trainer rows do the bare loop's work (no clipping, no averaged model) unless told.
SAME_WORK = ["--grad-clip", "0", "--average-period", "0"]
DEMO_EXTRA = ["--average-period", "5"]


def data_argv(size: str, steps: int, batch: int, corpus: str | None) -> list[str]:
    if size in LHOTSE_SIZES:
        if corpus is None:
            raise ValueError(f"--sizes {size} needs a tokenized egs/tiny corpus (--lhotse-dir)")
        return ["--manifest-dir", corpus, *LHOTSE_FLAGS]
    return ["--synthetic-data", str((steps + 4) * batch), "--synthetic-batch-size", str(batch)]


def trainer_argv(size: str, optimizer: str, steps: int, batch: int, exp_dir: str,
                 device: str, corpus: str | None = None) -> list[str]:
    return [*SIZES[size], "--model-name", "valle", "--prefix-mode", "1", "--dropout", "0.0",
            "--optimizer-name", optimizer, "--base-lr", "0.01" if optimizer == "ScaledAdam" else "1e-4",
            *data_argv(size, steps, batch, corpus),
            "--num-epochs", "1", "--max-steps", str(steps), "--device", device,
            "--oom-check", "false", "--tensorboard", "false", "--valid-interval", "1000000",
            "--save-every-n", "1000000", "--exp-dir", exp_dir]


def run_trainer(size: str, optimizer: str, steps: int, batch: int, device: str,
                extra: list[str] = SAME_WORK, corpus: str | None = None) -> float:
    """Seconds of one `train()` call of `steps` steps (set-up included)."""
    from valle.train.cli import parse_config
    from valle.train.loop import train

    with tempfile.TemporaryDirectory() as exp_dir:
        cfg = parse_config(trainer_argv(size, optimizer, steps, batch, exp_dir, device, corpus) + extra)
        start = CLOCK[0]()
        summary = train(cfg)
        elapsed = CLOCK[0]() - start
    if summary.steps != steps:  # --num-epochs 1: the first epoch ended before --max-steps
        raise SystemExit(f"bench_host: the trainer's first epoch ended after {summary.steps} "
                         f"steps, before {steps}: {corpus or 'the synthetic corpus'} is too small")
    logging.getLogger().setLevel(logging.WARNING)  # the next train() logs its set-up only
    return elapsed


def run_bare(size: str, steps: int, batch: int, device: str, profiler=None,
             corpus: str | None = None) -> float:
    """Seconds of `steps` bare steps (after 3 warm-up steps), on the batches the trainer's
    steps 1..`steps` train (drawn up front from its own data: the synthetic sampler or the
    lhotse data module, first epoch), so that both marginals time the same batches."""
    from valle.models import get_model
    from valle.train.cli import parse_config
    from valle.train.data import build_train_data
    from valle.train.dist import init_distributed

    with tempfile.TemporaryDirectory() as exp_dir:
        cfg = parse_config(trainer_argv(size, "AdamW", steps, batch, exp_dir, device, corpus))
        ctx = init_distributed(device, 120)
        hparams = cfg.model
        data = build_train_data(cfg, ctx, hparams.ar_codebook_size)
        batches = list(itertools.islice(data.train_batches(1), steps))
    if len(batches) < steps:
        raise SystemExit(f"bench_host: rank {ctx.rank}'s first epoch of {corpus} has "
                         f"{len(batches)} batches, fewer than the {steps} this needs")
    torch.manual_seed(cfg.seed)
    model = get_model(hparams).to(ctx.device)
    params = [p for _, p in model.stage_parameters(0)]
    forward = model
    if ctx.distributed:
        forward = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            find_unused_parameters=True, broadcast_buffers=False)
    # fused: the kernel the trainer's own AdamW launches, so that the difference is the
    # trainer's host work and not two AdamW implementations (torch's default on CPU is a
    # per-parameter loop, several times slower than the fused kernel).
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01,
                                  fused=True)

    def step(b) -> None:
        optimizer.zero_grad(set_to_none=True)
        on = {k: v.to(ctx.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
              for k, v in b.items()}
        loss, _ = forward(on["text_tokens"], on["text_tokens_lens"], on["audio_features"],
                          on["audio_features_lens"], train_stage=0)
        (loss / int(b["audio_features_lens"].sum())).backward()
        optimizer.step()

    for b in batches[:3]:  # warm-up
        step(b)
    _sync(ctx.device)
    start = CLOCK[0]()
    with profiler if profiler is not None else contextlib.nullcontext():
        for b in batches:
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
    corpus = getattr(args, "corpus", None)
    out = {"bare loop (torch fused AdamW)": lambda k: run_bare(size, k, args.batch, args.device,
                                                          corpus=corpus),
           "trainer, AdamW": lambda k: run_trainer(size, "AdamW", k, args.batch, args.device,
                                                   corpus=corpus)}
    if size.startswith("demo"):
        out["trainer, ScaledAdam + averaging (the demo's)"] = (
            lambda k: run_trainer(size, "ScaledAdam", k, args.batch, args.device, DEMO_EXTRA,
                                  corpus=corpus))
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
    base = times["bare loop (torch fused AdamW)"]
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
    from valle.train.resilience import phases, step

    originals = (phases.PhaseTracker.phase_scope, phases.PhaseTracker.host_work,
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

    phases.PhaseTracker.phase_scope = phase_scope
    phases.PhaseTracker.host_work = host_work
    step.ResilientStep.run = marked("ResilientStep.run", originals[2])
    loop.draw = marked("loop.draw (data)", originals[3])
    loop.step_metrics = marked("loop.step_metrics", originals[4])
    try:
        yield
    finally:
        (phases.PhaseTracker.phase_scope, phases.PhaseTracker.host_work,
         step.ResilientStep.run, loop.draw, loop.step_metrics) = originals


def profile(args, size: str, optimizer: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(args.threads)
    steps = args.steps[size]
    extra = SAME_WORK if optimizer == "AdamW" else DEMO_EXTRA
    corpus = getattr(args, "corpus", None)
    run_trainer(size, optimizer, 5, args.batch, args.device, extra, corpus)  # warm the caches
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with phases_marked(), torch_profile(activities=activities) as prof:
        run_trainer(size, optimizer, steps, args.batch, args.device, extra, corpus)
    bare = torch_profile(activities=activities)
    run_bare(size, steps, args.batch, args.device, profiler=bare, corpus=corpus)
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


def make_corpus(data_dir: Path, generated: int) -> str:
    """A tokenized egs/tiny corpus as the demo makes it (held-out layout, mel-rvq codes with
    128 codes in codebook 0), `generated` more sentences than the 224 natural ones."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(root / "egs/tiny/prepare.sh"), "--python", sys.executable,
         "--data-dir", str(data_dir), "--layout", "heldout", "--codec", "mel-rvq",
         "--generated", str(generated), "--first-codebook-size", "128", "--num-jobs", "0",
         "--stop-stage", "2"], cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_host: egs/tiny/prepare.sh failed:\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    return str(data_dir / "tokenized")


def corpus_note(corpus: str) -> str:
    from lhotse import CutSet

    cuts = CutSet.from_file(Path(corpus) / "tiny_cuts_train.jsonl.gz")
    seconds = sum(c.duration for c in cuts)
    return f"{len(cuts)} training cuts, {seconds / 60:.1f} min of audio"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="tiny,demo,demo-lhotse")
    parser.add_argument("--batch", type=int, default=8, help="cuts per step, synthetic sizes")
    parser.add_argument("--tiny-steps", type=int, default=100)
    parser.add_argument("--demo-steps", type=int, default=30, help="N of demo and demo-lhotse")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ranks", default="1,2", help="1 and/or 2 (2: gloo, CPU only)")
    parser.add_argument("--lhotse-dir", default=None,
                        help="demo-lhotse: a tokenized egs/tiny dir (held-out layout, codebook 0 "
                             "of 128 codes); default: one made in a temporary dir")
    parser.add_argument("--lhotse-generated", type=int, default=1000,
                        help="sentences generated beyond the natural ones for the made corpus "
                             "(1000: about 80 steps per rank in the first epoch at 2 ranks)")
    parser.add_argument("--profile", action="store_true", help="the profile instead of the timing")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this process's CPU time; wall: elapsed time")
    args = parser.parse_args()
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    args.steps = {"tiny": args.tiny_steps, "demo": args.demo_steps, "demo-lhotse": args.demo_steps}
    logging.basicConfig(level=logging.WARNING)
    print(f"command: python scripts/bench_host.py {' '.join(sys.argv[1:])}".rstrip())
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {', '.join(unknown)} (known: {', '.join(SIZES)})")
    with tempfile.TemporaryDirectory() as scratch:
        args.corpus = args.lhotse_dir
        if args.corpus is None and LHOTSE_SIZES & set(sizes):
            args.corpus = make_corpus(Path(scratch) / "tiny", args.lhotse_generated)
        if args.profile:
            for size in sizes:
                for optimizer in ("AdamW", "ScaledAdam"):
                    profile(args, size, optimizer)
            return
        print(f"batch {args.batch} (synthetic sizes), fp32, {args.device}, {args.threads} "
              f"thread(s), {'process CPU' if args.clock == 'cpu' else 'wall'} time; "
              f"marginal time per step = (t(2N) - t(N)) / N, N = "
              f"{', '.join(f'{args.steps[s]} ({s})' for s in sizes)}; median of {args.repeats} "
              "interleaved repeats\n")
        ranks = [int(r) for r in args.ranks.split(",")]
        for size in sizes:
            desc = " ".join(SIZES[size][1:6:2])
            if size in LHOTSE_SIZES:
                desc += (f"; egs/tiny corpus, {corpus_note(args.corpus)}, "
                         f"{' '.join(LHOTSE_FLAGS[2:])}")
            if 1 in ranks:
                print_table(f"{size} (d, heads, layers = {desc}), 1 rank", one_rank(args, size))
            if 2 in ranks and args.device == "cpu":
                results = values(run_world(_two_rank_worker, 2, args, size, timeout=1800))
                slowest = {name: max(r[name] for r in results) for name in results[0]}
                print_table(f"{size}, 2 gloo ranks (bare: torch DDP)", slowest)


if __name__ == "__main__":
    main()

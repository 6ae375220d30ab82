#!/usr/bin/env python3
"""Side-by-side step benchmarks (run by `make bench`).

1. Guarded vs unguarded step on one rank: `ResilientStep.run` (bucketed grads,
   the vote, fault hooks inert) against a plain zero_grad/forward/backward/step
   loop on the same model, optimizer and batch.
2. Gradient sync with 2 gloo ranks: `overlap` vs `after-backward` vs torch DDP.

Blocks of steps are interleaved (A B C A B C ...) so drift in machine speed
hits every variant alike; the median block time per step is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.harness import run_world, values  # noqa: E402


def model_args(dim: int, layers: int) -> argparse.Namespace:
    from valle.models import MODEL_DEFAULTS

    return argparse.Namespace(**{**MODEL_DEFAULTS, "decoder_dim": dim, "nhead": 4,
                                 "num_decoder_layers": layers, "dropout": 0.0})


def make_batch(batch: int, text: int, frames: int):
    from valle.train.synthetic import SyntheticCorpus, SyntheticSpec, collate

    spec = SyntheticSpec(num_cuts=batch, text_len=(text, text), audio_len=(frames, frames), seed=0)
    return collate(SyntheticCorpus(spec).cuts)


def build(dim: int, layers: int, mode: str, ctx, seed: int = 0):
    """Model + optimizer (+ the resilient step unless mode is "plain") on ctx.device."""
    from valle.models import get_model
    from valle.train.optim import build_optimizer
    from valle.train.resilience.gradsync import build_grad_sync
    from valle.train.resilience.step import ResilientStep, StepConfig

    torch.manual_seed(seed)
    model = get_model(model_args(dim, layers)).to(ctx.device)
    named = model.stage_parameters(0)
    optimizer = build_optimizer("AdamW", named, 1e-4)
    if mode == "plain":
        return model, optimizer, None
    sync = build_grad_sync(mode, model, [p for _, p in named], world_size=ctx.world_size,
                           device=ctx.device, group=ctx.group)
    return model, optimizer, ResilientStep(model, optimizer, sync, ctx, StepConfig(train_stage=0))


def plain_step(model, optimizer, batch, step: int) -> None:
    """What a trainer without any protection does."""
    from valle.train.resilience.forward_backward import sample_seed

    optimizer.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    seeds = torch.tensor([sample_seed(0, step, c) for c in batch["cut_ids"]], device=device)
    loss, _ = model(on["text_tokens"], on["text_tokens_lens"], on["audio_features"],
                    on["audio_features_lens"], train_stage=0, sample_seeds=seeds)
    (loss / int(batch["audio_features_lens"].sum())).backward()
    optimizer.step()


def time_blocks(variants: dict, batch, blocks: int, steps: int, barrier=None,
                sync=lambda: None) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    step = 0
    for _ in range(blocks + 1):  # the first round warms up and is discarded
        for name, fn in variants.items():
            if barrier:
                barrier()
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                fn(batch, step)
                step += 1
            sync()
            if barrier:
                barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def guarded_vs_plain(args) -> dict[str, float]:
    from valle.train.dist import DistContext

    torch.set_num_threads(args.threads)
    ctx = DistContext(device=torch.device(args.device))
    batch = make_batch(args.batch, args.text, args.frames)
    plain_model, plain_opt, _ = build(args.dim, args.layers, "plain", ctx)
    torch_model, _, _ = build(args.dim, args.layers, "plain", ctx)
    # torch's own foreach AdamW: what the transactional (resumable) AdamW costs
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                  weight_decay=0.01)
    _, _, guarded = build(args.dim, args.layers, "overlap", ctx)
    return time_blocks({
        "unguarded": lambda b, s: plain_step(plain_model, plain_opt, b, s),
        "unguarded, torch.optim.AdamW": lambda b, s: plain_step(torch_model, torch_opt, b, s),
        "guarded": lambda b, s: guarded.run(s, b),
    }, batch, args.blocks, args.steps,
        sync=torch.cuda.synchronize if args.device == "cuda" else (lambda: None))


def _sync_worker(rank: int, world_size: int, args) -> dict[str, float]:
    import torch.distributed as dist

    from valle.train.dist import init_distributed

    ctx = init_distributed("cpu", 120)
    batch = make_batch(args.batch, args.text, args.frames)
    variants = {}
    for mode in ("overlap", "after-backward", "ddp"):
        _, _, stepper = build(args.dim, args.layers, mode, ctx)
        variants[mode] = (lambda st: (lambda b, s: st.run(s, b)))(stepper)
    return time_blocks(variants, batch, args.blocks, args.steps, barrier=dist.barrier)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--text", type=int, default=40)
    parser.add_argument("--frames", type=int, default=150)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-sync-modes", action="store_true",
                        help="only the one-rank comparison (e.g. on a single GPU)")
    args = parser.parse_args()
    print(f"command: python scripts/bench_step.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"model d={args.dim} layers={args.layers}, batch {args.batch} x ({args.text} text, "
          f"{args.frames} frames), stage 0, fp32, {args.device}, {args.blocks} interleaved blocks of "
          f"{args.steps} steps, median\n")

    one = guarded_vs_plain(args)
    print("| one rank | s/step | ratio |\n|---|---|---|")
    for name in ("unguarded", "unguarded, torch.optim.AdamW", "guarded"):
        print(f"| {name} | {one[name]:.4f} | {one[name] / one['unguarded']:.3f}x |")

    if args.skip_sync_modes or args.device != "cpu":
        return
    ranks = values(run_world(_sync_worker, 2, args, timeout=900))
    slowest = {m: max(r[m] for r in ranks) for m in ranks[0]}
    print("\n| 2 gloo ranks | s/step | vs DDP |\n|---|---|---|")
    for mode in ("ddp", "overlap", "after-backward"):
        print(f"| {mode} | {slowest[mode]:.4f} | {slowest[mode] / slowest['ddp']:.3f}x |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""LoRA against full fine-tuning (run by `make bench`): the memory one training step needs.

For each model size, the same model, batch and optimizer (AdamW, the trainer's resilient
step on one rank) once with every parameter trained and once with LoRA adapters on a frozen
base (`--lora-rank R --lora-targets attn,ffn`). Reported, LoRA as a fraction of full:

* trained parameters and their optimizer state (bytes of every state tensor after a step);
* the step's peak: on CUDA the allocator's peak (`max_memory_allocated`) over a step; on CPU
  the peak of the step's own allocations (gradients, activations, temporaries; from the
  profiler's allocation events) plus what lives through it (weights, optimizer state);
* the checkpoint's model entry: the full state dict against the adapters alone.

The second step is measured (the first materialises state).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {  # name: (decoder_dim, nhead, layers, batch, text tokens, frames)
    "demo": (128, 4, 2, 8, 40, 150),
    "valle": (1024, 16, 12, 4, 40, 150),  # lifeiteng's VALL-E hyper-parameters
}


@dataclass
class Measure:
    trained: int  # parameters
    optimizer_bytes: int
    peak_bytes: int
    checkpoint_bytes: int


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def build(size: str, rank: int, device: torch.device):
    """The resilient step of a fresh model, LoRA adapters on it when rank > 0."""
    from bench_step import make_batch, model_args

    from valle.models import get_model
    from valle.models.lora import LoraConfig, apply_lora
    from valle.train.dist import DistContext
    from valle.train.optim import build_optimizer
    from valle.train.resilience.gradsync import build_grad_sync
    from valle.train.resilience.step import ResilientStep, StepConfig

    dim, heads, layers, batch, text, frames = SIZES[size]
    torch.manual_seed(0)
    args = model_args(dim, layers)
    args.nhead = heads
    model = get_model(args).to(device)
    if rank:
        apply_lora(model, LoraConfig(lora_rank=rank, lora_alpha=2.0 * rank))
    named = [(n, p) for n, p in model.stage_parameters(0) if p.requires_grad]
    optimizer = build_optimizer("AdamW", named, 1e-4)
    ctx = DistContext(device=device)
    sync = build_grad_sync("overlap", model, [p for _, p in named], world_size=1, device=device)
    step = ResilientStep(model, optimizer, sync, ctx, StepConfig(train_stage=0))
    return model, named, optimizer, step, make_batch(batch, text, frames)


def cpu_step_peak(step, batch, index: int) -> int:
    """Peak bytes allocated during one step above what existed before it (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step.run(index, batch)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def measure(size: str, rank: int, device: torch.device) -> Measure:
    from valle.models.lora import lora_state_dict

    model, named, optimizer, step, batch = build(size, rank, device)
    step.run(0, batch)  # materialises the optimizer state
    optimizer_bytes = tensor_bytes(v for s in optimizer.state.values() for v in s.values())
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step.run(1, batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        lasting = tensor_bytes(model.state_dict().values()) + optimizer_bytes
        peak = lasting + cpu_step_peak(step, batch, 1)
    state = lora_state_dict(model) if rank else model.state_dict()
    return Measure(sum(p.numel() for _, p in named), optimizer_bytes, peak, tensor_bytes(state.values()))


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="demo,valle", help=f"of {','.join(SIZES)}")
    p.add_argument("--rank", type=int, default=16, help="--lora-rank")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    for size in args.sizes.split(","):
        dim, heads, layers, batch, text, frames = SIZES[size]
        full, lora = measure(size, 0, device), measure(size, args.rank, device)
        print(f"\n| {size}: d={dim}, {heads} heads, {layers} layers, batch {batch} x ({text} text, "
              f"{frames} frames), AdamW, {device.type}, --lora-rank {args.rank} attn,ffn "
              "| full fine-tuning | LoRA | LoRA / full |")
        print("|---|---:|---:|---:|")
        rows = [("trained parameters", full.trained, lora.trained, lambda n: f"{n / 1e6:.2f} M"),
                ("optimizer state", full.optimizer_bytes, lora.optimizer_bytes, mib),
                ("peak memory of a step" + (" (allocator)" if device.type == "cuda" else
                                            " (weights + state + the step's allocations)"),
                 full.peak_bytes, lora.peak_bytes, mib),
                ("checkpoint model entry", full.checkpoint_bytes, lora.checkpoint_bytes, mib)]
        for name, a, b, fmt in rows:
            print(f"| {name} | {fmt(a)} | {fmt(b)} | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Forward and backward of one micro-batch, as training runs them: a plain function.

Everything a pass needs besides the model and the batch is in `PassSettings`
(device, autocast, stage, seeds, GradScaler, grad sync, fault points). The
resilient step calls `forward_backward`; torch DDP's vote-before-backward and the
pessimistic scan call `forward_loss` and `backward_loss` separately.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from valle.train.batching import Batch, to_device
from valle.train.resilience.faults import FaultInjector
from valle.train.resilience.phases import PhaseTracker


def sample_seed(seed: int, step: int, cut_id: str) -> int:
    """A 63-bit seed from (run seed, step, cut id), identical on every rank and retry."""
    digest = hashlib.blake2b(f"{seed}:{step}:{cut_id}".encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] & 0x7FFFFFFFFFFFFFFF


def _identity(module: nn.Module) -> Callable[..., Any]:
    return module


@dataclass
class PassSettings:
    """What a forward/backward pass needs besides the model and the batch."""

    device: torch.device
    sync: Any  # a grad sync (valle.train.resilience.gradsync): DDP wrapping, hooks
    phases: PhaseTracker
    faults: FaultInjector
    autocast_dtype: torch.dtype | None = None
    train_stage: int = 0
    seed: int = 42
    scaler: torch.amp.GradScaler | None = None
    # The NAR forward's memory context (the backward reserve, valle.train.resilience.memory).
    nar_context: Callable[[], Any] = nullcontext
    # --compile swaps in TrainingCompiler.wrap (valle.train.compile): same call, compiled.
    wrap_forward: Callable[[nn.Module], Callable[..., Any]] = field(default=_identity)


def forward_loss(model: nn.Module, micro: Batch, settings: PassSettings,
                 step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Copy `micro` to the device and run the model: (fp32 loss sum, metric sums)."""
    ids = micro["cut_ids"]
    phases, faults, device = settings.phases, settings.faults, settings.device
    with phases.phase_scope("to_device"):
        faults.maybe_fail("to_device", ids, device)
        on_device = to_device(micro, device)
        # Made on the host and copied without blocking: torch.tensor(..., device=cuda)
        # would wait for the device (a second host sync per step).
        seeds = torch.tensor([sample_seed(settings.seed, step, c) for c in ids],
                             dtype=torch.long).to(device, non_blocking=True)
    with phases.phase_scope("forward"):
        faults.before_forward(ids, device)
        autocast = (torch.autocast(device.type, dtype=settings.autocast_dtype)
                    if settings.autocast_dtype is not None else nullcontext())
        with autocast:
            loss, metrics = settings.wrap_forward(settings.sync.forward_module(model))(
                on_device["text_tokens"], on_device["text_tokens_lens"],
                on_device["audio_features"], on_device["audio_features_lens"],
                train_stage=settings.train_stage, sample_seeds=seeds,
                prompt_features=on_device.get("prompt_features"),
                prompt_features_lens=on_device.get("prompt_features_lens"),
                text_languages=on_device.get("text_languages"),
                nar_context=settings.nar_context,
            )
        return faults.poison(loss.float()), metrics


def backward_loss(loss: torch.Tensor, micro: Batch, settings: PassSettings, last: bool) -> None:
    """The (GradScaler-scaled) backward; `last`: the micro-batch whose gradients sync."""
    ids = micro["cut_ids"]
    faults, device = settings.faults, settings.device
    with settings.phases.phase_scope("backward"):
        faults.maybe_fail("backward", ids, device)
        scaled = settings.scaler.scale(loss) if settings.scaler is not None else loss
        with faults.memory_pressure("backward", ids, device), \
                settings.sync.backward_context(last):
            scaled.backward()


def forward_backward(model: nn.Module, micro: Batch, settings: PassSettings, step: int,
                     last: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of one micro-batch; returns the loss and metric sums."""
    loss, metrics = forward_loss(model, micro, settings, step)
    backward_loss(loss, micro, settings, last)
    return loss, metrics

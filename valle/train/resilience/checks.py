"""The loop's collective checks beside the step: validation and the consistency check.

Both run local work under the OOM guard and then one exchange through the control
channel whose layout is the same on every rank whatever failed, so they cannot
mismatch; both are called at the same points on every rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from valle.train.batching import Batch
from valle.train.dist import object_fingerprint, tensor_fingerprint
from valle.train.resilience.channel import ControlChannel
from valle.train.resilience.forward_backward import PassSettings, forward_loss
from valle.train.resilience.guard import OomGuard
from valle.train.resilience.vote import METRIC_KEYS, accumulate

logger = logging.getLogger(__name__)


class ConsistencyError(RuntimeError):
    """Ranks hold different parameters/optimizer/scaler/averaged-model state."""


@dataclass
class Validation:
    loss: float  # per predicted frame
    metrics: dict[str, float]  # global sums
    frames: float
    batches: int  # global
    oom_batches: int  # global: skipped after an OOM
    cut_short: int = 0  # ranks that stopped early (a preemption signal)


def validate(model: nn.Module, batches: Iterable[Batch], settings: PassSettings,
             guard: OomGuard, channel: ControlChannel,
             cut_short: Callable[[], bool]) -> Validation:
    """Validation loss over this rank's batches, summed over ranks with one exchange.
    A batch that runs out of memory is skipped and counted."""
    phases = settings.phases
    sums = channel.device_slots(3, 1 + len(METRIC_KEYS))
    sums.zero_()
    count = oom_batches = 0
    was_training = model.training
    model.eval()

    def eval_batch(batch: Batch) -> None:
        guard.micro = batch
        loss, metrics = forward_loss(model, batch, settings, -1)
        accumulate(loss, metrics, sums)
        guard.micro = None

    try:
        with torch.no_grad(), phases.phase_scope("validate"):
            for batch in _host_iter(batches, settings):
                failure = guard.run(-1, lambda b=batch: eval_batch(b))
                oom_batches += failure is not None
                count += 1
    finally:
        model.train(was_training)
    with phases.phase_scope("vote"):
        v = channel.reduce([float(cut_short()), float(count), float(oom_batches)],
                           used=3 + len(sums))
    metrics = {k: v[4 + i] for i, k in enumerate(METRIC_KEYS)}
    frames = metrics["ar_frames"] + metrics["nar_frames"]
    return Validation(loss=v[3] / frames if frames else math.inf, metrics=metrics,
                      frames=frames, batches=int(v[1]), oom_batches=int(v[2]),
                      cut_short=int(v[0]))


def _host_iter(batches: Iterable[Batch], settings: PassSettings) -> Iterator[Batch]:
    """Draw batches as host work (data loading allocates host memory only)."""
    iterator = iter(batches)
    while True:
        with settings.phases.host_work():
            batch = next(iterator, None)
        if batch is None:
            return
        yield batch


def fingerprints(model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None, averager) -> dict[str, int]:
    """Exact fingerprints of parameters, optimizer, scaler and averaged model."""
    return {
        "params": tensor_fingerprint([p.detach() for p in model.parameters()]),
        "optimizer": object_fingerprint(optimizer.state_dict()),
        "scaler": object_fingerprint(scaler.state_dict() if scaler else {}),
        "averaged": tensor_fingerprint(averager.tensors()) if averager else 0,
    }


def check_consistency(compute: Callable[[], dict[str, int]], guard: OomGuard,
                      channel: ControlChannel) -> dict[str, int] | None:
    """Raise ConsistencyError naming what differs between ranks. If computing the
    fingerprints ran out of memory on some rank, every rank skips this check."""
    mine: dict[str, int] = {}
    phases = guard.phases
    with phases.phase_scope("consistency"):
        failure = guard.run(-1, lambda: mine.update(compute()))
    keys = ["averaged", "optimizer", "params", "scaler"]
    with phases.phase_scope("vote"):
        table = channel.gather_ints([int(failure is not None)] + [mine.get(k, 0) for k in keys])
    if any(row[0] for row in table):
        logger.warning("consistency check skipped: out of memory computing fingerprints on "
                       "rank(s) %s", [r for r, row in enumerate(table) if row[0]])
        return None
    differing = [k for i, k in enumerate(keys, 1) if len({row[i] for row in table}) > 1]
    if differing:
        raise ConsistencyError(f"ranks disagree on {', '.join(differing)}: {table}")
    return mine

"""Learning-rate schedules for the VALL-E trainer: ``Eden`` (icefall's, written anew),
``NoamScheduler`` and ``CosineScheduler``, batch/epoch driven with one interface
(``step_batch``, ``step_epoch``, ``get_last_lr``, ``state_dict``, ``load_state_dict``)."""

from __future__ import annotations

import math

from torch.optim import Optimizer

__all__ = ["LRScheduler", "Eden", "NoamScheduler", "CosineScheduler", "build_scheduler",
           "SCHEDULERS"]

SCHEDULERS = ("Eden", "Noam", "Cosine")


class LRScheduler:
    """Base of the batch/epoch driven schedules.

    ``step_batch(step)`` is called after each optimizer step with the number of
    steps done; ``step_epoch(epoch)`` at the start of an epoch (icefall passes
    ``epoch - 1``). The lr of every group is ``base_lr * factor(batch, epoch)``
    where ``base_lr`` is the group's lr when the scheduler was created.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.batch = 0
        self.epoch = 0
        self._last_lr = list(self.base_lrs)
        self._set_lrs()

    def factor(self) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        f = self.factor()
        return [base * f for base in self.base_lrs]

    def _set_lrs(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def step_batch(self, step: int | None = None) -> None:
        self.batch = self.batch + 1 if step is None else int(step)
        self._set_lrs()

    def step_epoch(self, epoch: int | None = None) -> None:
        self.epoch = self.epoch + 1 if epoch is None else int(epoch)
        self._set_lrs()

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict) -> None:
        self.__dict__.update(state_dict)
        self._set_lrs()


class Eden(LRScheduler):
    """icefall's Eden schedule.

    lr = base_lr * ((batch² + lr_batches²) / lr_batches²) ** -0.25
                 * ((epoch² + lr_epochs²) / lr_epochs²) ** -0.25 * warmup,
    warmup rising linearly from ``warmup_start`` to 1 over ``warmup_batches``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_batches: float = 5000,
        lr_epochs: float = 4,
        warmup_batches: float = 500.0,
        warmup_start: float = 0.5,
    ) -> None:
        self.lr_batches = float(lr_batches)
        self.lr_epochs = float(lr_epochs)
        self.warmup_batches = float(warmup_batches)
        self.warmup_start = float(warmup_start)
        super().__init__(optimizer)

    def factor(self) -> float:
        b, e = float(self.batch), float(self.epoch)
        f = ((b**2 + self.lr_batches**2) / self.lr_batches**2) ** -0.25
        f *= ((e**2 + self.lr_epochs**2) / self.lr_epochs**2) ** -0.25
        if b < self.warmup_batches:
            f *= self.warmup_start + (1.0 - self.warmup_start) * b / self.warmup_batches
        return f


class NoamScheduler(LRScheduler):
    """Noam schedule, normalised so the peak (at ``warmup_steps``) is base_lr.

    With n = batch + 1 (the step about to be taken):
    lr = base_lr * min(n / warmup, sqrt(warmup / n)).
    With ``model_dim`` set, the original formula of the Transformer paper (and
    of the VALL-E recipes) is used instead:
    lr = base_lr * model_dim**-0.5 * min(n**-0.5, n * warmup**-1.5).
    """

    def __init__(
        self, optimizer: Optimizer, warmup_steps: int = 200, model_dim: int | None = None
    ) -> None:
        if warmup_steps <= 0:
            raise ValueError("NoamScheduler needs warmup_steps > 0")
        self.warmup_steps = int(warmup_steps)
        self.model_dim = model_dim
        super().__init__(optimizer)

    def factor(self) -> float:
        n = float(self.batch + 1)
        w = float(self.warmup_steps)
        if self.model_dim is not None:
            return self.model_dim**-0.5 * min(n**-0.5, n * w**-1.5)
        return min(n / w, math.sqrt(w / n))


class CosineScheduler(LRScheduler):
    """Linear warm-up to base_lr, then a cosine decay to ``min_lr_ratio * base_lr``.

    With n = batch + 1: warm-up factor n / warmup while n < warmup; then
    progress = (n - warmup) / (total - warmup), clamped to [0, 1].
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float = 0.0,
    ) -> None:
        if total_steps <= warmup_steps:
            raise ValueError(
                f"CosineScheduler needs total_steps ({total_steps}) > warmup_steps ({warmup_steps})"
            )
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.min_lr_ratio = float(min_lr_ratio)
        super().__init__(optimizer)

    def factor(self) -> float:
        n = float(self.batch + 1)
        if n < self.warmup_steps:
            return n / self.warmup_steps
        progress = (n - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cos


def build_scheduler(
    name: str,
    optimizer: Optimizer,
    warmup_steps: int,
    total_steps: int | None = None,
    lr_batches: float = 5000,
    lr_epochs: float = 4,
    model_dim: int | None = None,
    min_lr_ratio: float = 0.0,
) -> LRScheduler:
    """Build a schedule by name ("Eden", "Noam", "Cosine"; case-insensitive)."""
    key = name.lower()
    if key == "eden":
        return Eden(optimizer, lr_batches=lr_batches, lr_epochs=lr_epochs, warmup_batches=warmup_steps)
    if key == "noam":
        return NoamScheduler(optimizer, warmup_steps=warmup_steps, model_dim=model_dim)
    if key == "cosine":
        if total_steps is None:
            raise ValueError("the Cosine schedule needs total_steps")
        return CosineScheduler(
            optimizer, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
        )
    raise ValueError(f"unknown scheduler {name!r}; choose one of {SCHEDULERS}")

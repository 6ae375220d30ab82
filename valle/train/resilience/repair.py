"""Repair: ranks whose update failed receive the state of the lowest healthy rank.

Parameters, optimizer state, GradScaler and averaged model are overwritten in
place (the buffers exist on every rank, so nothing is allocated); host values
(python numbers, CPU tensors) travel as one pickled object.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from valle.train.resilience.channel import ControlChannel
from valle.train.resilience.phases import PhaseTracker

logger = logging.getLogger(__name__)


class NoHealthyRankError(RuntimeError):
    """The optimizer/averaging state is damaged on every rank: only a restart helps."""


def reset_scaler_stage(scaler: torch.amp.GradScaler | None) -> None:
    """Forget a half-done unscale/step: the scaler's per-optimizer stage would otherwise
    stay "unscaled" and the next step raise "unscale_() has already been called"."""
    if scaler is not None:
        # Private in torch (2.9 to 2.11 at least): the per-optimizer stage table, which
        # update() itself resets the same way after a complete step.
        from torch.amp.grad_scaler import OptState

        scaler._per_optimizer_states.clear()
        scaler._per_optimizer_states.default_factory = lambda: {
            "stage": OptState.READY, "found_inf_per_device": {}}


class StateRepair:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None, averager, channel: ControlChannel,
                 phases: PhaseTracker, rank: int, world_size: int, device: torch.device):
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.averager = averager
        self.channel = channel
        self.phases = phases
        self.rank = rank
        self.world_size = world_size
        self.device = device

    def state_tensors(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Everything a repair copies: device tensors (overwritten in place, in a fixed
        order) and host values (python numbers, CPU tensors), as a picklable dict."""
        tensors = [p.data for p in self.model.parameters()]
        host: dict[str, Any] = {"optimizer": {}}
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                for key, value in sorted(self.optimizer.state[p].items()):
                    if isinstance(value, torch.Tensor) and value.device == self.device:
                        tensors.append(value)
                    else:
                        host["optimizer"][(gi, pi, key)] = value
        if self.averager is not None:
            tensors += self.averager.tensors()
            host["averager_last_step"] = self.averager.last_step
        if self.scaler is not None:
            tensors += [self.scaler._scale, self.scaler._growth_tracker]
        return tensors, host

    def repair(self, bad_ranks: Sequence[int], step: int) -> None:
        """Copy parameters, optimizer, scaler and averaged model from the lowest healthy
        rank into `bad_ranks`, in place. Every rank calls it."""
        healthy = [r for r in range(self.world_size) if r not in bad_ranks]
        if not healthy:
            raise NoHealthyRankError(
                f"out of memory in the optimizer/averaging phase on every rank ({list(bad_ranks)}) "
                f"after step {step - 1}, even after retries: the parameters can no longer be "
                "trusted. Restart from the last checkpoint (under torchrun --max-restarts this "
                "happens automatically)."
            )
        src = healthy[0]
        logger.warning("repairing rank(s) %s from rank %d", list(bad_ranks), src)
        with self.phases.phase_scope("repair"):
            tensors, host = self.state_tensors()
            self.channel.broadcast_tensors(tensors, src)
            host = self.channel.broadcast_object(host, src)
        if self.rank in bad_ranks:
            self._restore_host_values(host)

    def _restore_host_values(self, host: dict[str, Any]) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        offsets = [0]
        for g in self.optimizer.param_groups:
            offsets.append(offsets[-1] + len(g["params"]))
        for (gi, pi, key), value in host["optimizer"].items():
            self.optimizer.state[params[offsets[gi] + pi]][key] = value
        if self.averager is not None:
            self.averager.last_step = host["averager_last_step"]

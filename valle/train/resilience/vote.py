"""The step's vote: one all-reduce of what every rank must agree on.

The vector is the control channel's (`ControlChannel`, buffers made at start, so a
rank that just ran out of memory can still vote): host-written slots [failed, done,
frames, cuts, give-up, stop, unreadable], one slot per rank ("state damaged"), then
the device-written sums [loss, metrics, gradient norm], added in place during the
attempt. It is the step's only host sync; a non-finite loss or gradient anywhere
makes the summed loss or norm non-finite, so it costs no extra slot or kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from valle.train.resilience.channel import ControlChannel
from valle.train.resilience.phases import PhaseTracker

# Metric sums the model returns; they ride in the vote so logging costs no extra sync.
METRIC_KEYS = ("ar_loss", "nar_loss", "ar_top10_correct", "ar_frames", "nar_top10_correct",
               "nar_frames")
_FAILED, _DONE, _FRAMES, _CUTS, _GIVE_UP, _STOP, _UNREADABLE = range(7)
_HOST0 = 7
_SUMS = 1 + len(METRIC_KEYS) + 1  # loss, metrics, gradient norm


@dataclass
class Vote:
    failed: int
    nonfinite: bool
    frames: int
    cuts: int
    done: int
    give_up: int
    stop: int  # ranks asking to stop after this step (a preemption signal)
    unreadable: int  # cuts whose codes could not be read, drawn for this step on all ranks
    loss: float
    metrics: dict[str, float]
    bad_ranks: list[int]

    def clean(self) -> bool:
        """Nothing stands in the way of this attempt's gradient (DDP's synced backward)."""
        return not (self.failed or self.done or self.nonfinite or self.bad_ranks
                    or self.give_up)


@dataclass
class Ballot:
    """This rank's host-side answers for one vote."""

    failed: bool = False
    dry: bool = False  # no data left on this rank
    frames: int = 0
    cuts: int = 0
    give_up: bool = False
    stop: bool = False
    unreadable: int = 0
    damaged: bool = False


def accumulate(loss: torch.Tensor, metrics: dict[str, torch.Tensor], sums: torch.Tensor) -> None:
    """In-place adds into a vote's device slots (allocate nothing)."""
    sums[0].add_(loss.detach())
    for i, key in enumerate(METRIC_KEYS, 1):
        if key in metrics:
            sums[i].add_(metrics[key].detach())


class VoteExchange:
    """Casts ballots through the control channel; owns the device-side sums."""

    def __init__(self, channel: ControlChannel, rank: int, world_size: int,
                 phases: PhaseTracker):
        self.channel = channel
        self.rank = rank
        self.world_size = world_size
        self.phases = phases
        self.host_slots = _HOST0 + world_size
        # Device-side sums of the vote, written in place during the attempt.
        self.sums = channel.device_slots(self.host_slots, _SUMS)

    def cast(self, ballot: Ballot) -> Vote:
        host = [0.0] * self.host_slots
        host[_FAILED] = float(ballot.failed)
        host[_DONE] = float(ballot.dry)
        host[_FRAMES] = float(ballot.frames)
        host[_CUTS] = float(ballot.cuts)
        host[_GIVE_UP] = float(ballot.give_up)
        host[_STOP] = float(ballot.stop)
        host[_UNREADABLE] = float(ballot.unreadable)
        host[_HOST0 + self.rank] = float(ballot.damaged)
        with self.phases.phase_scope("vote"):
            v = self.channel.reduce(host, used=self.host_slots + _SUMS)  # the one host sync
        sums = v[self.host_slots:]
        return Vote(
            failed=int(v[_FAILED]), frames=int(v[_FRAMES]), cuts=int(v[_CUTS]),
            done=int(v[_DONE]), give_up=int(v[_GIVE_UP]), stop=int(v[_STOP]),
            unreadable=int(v[_UNREADABLE]), loss=sums[0],
            # NaN/inf on any rank makes the sum non-finite: no extra flag needed.
            nonfinite=not (math.isfinite(sums[0]) and math.isfinite(sums[-1])),
            metrics={k: sums[1 + i] for i, k in enumerate(METRIC_KEYS)},
            bad_ranks=self._bad_ranks(v),
        )

    def damaged_ranks(self, damaged: bool) -> list[int]:
        """A vote on damaged state only (a flush), without the device sums."""
        host = [0.0] * self.host_slots
        host[_HOST0 + self.rank] = float(damaged)
        with self.phases.phase_scope("vote"):
            v = self.channel.reduce(host)
        return self._bad_ranks(v)

    def _bad_ranks(self, v: list[float]) -> list[int]:
        return [r for r in range(self.world_size) if v[_HOST0 + r] > 0]

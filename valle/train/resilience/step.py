"""The resilient optimizer step and the loop's other per-step work (docs/architecture.md,
"Resilient step"; docs/oom.md).

Rule: every rank issues the same sequence of collectives every optimizer step,
whatever failed locally. Two mechanisms make that hold for an out-of-memory
error at *any* allocation, not only at a few named points:

* Local work is guarded, collectives are not in it. Everything that allocates
  (to_device, forward, backward, a bucket's norm, the finiteness check) runs
  inside the `OomGuard` (guard.py), which turns an OOM into a `Failure` after leaving the
  except block and freeing memory. The collectives that follow (the remaining
  bucket launches, the vote, repair, quarantine sharing) allocate no device
  memory: they use the buffers of the `ControlChannel`, made at start, and the
  gradient buckets themselves. So a rank that just failed can always finish
  the protocol the others are in.
* Updates are transactions. The optimizer (ScaledAdam/Adam, valle.train.optim)
  computes each chunk of parameters' update out of place and commits it with
  in-place copies (fused AdamW: one kernel that allocates nothing, in place);
  GradScaler's unscale/update and the clipping allocate before they mutate. So an OOM in the update phase is retried locally, resuming where it
  stopped, and gives the fault-free result. Only if that keeps failing is the
  rank's state "damaged": it says so in the next vote and receives parameters,
  optimizer, scaler and averaged model from the lowest healthy rank, in place.

Per attempt, on every rank:

1. guarded local gradient over `split` micro-batches; in overlap mode the
   buckets' all-reduces launch from backward hooks;
2. `launch_remaining`: every bucket not yet launched (on failure: only the
   collectives, nothing that allocates);
3. the vote: ONE all-reduce of the channel's vector [failed, done, frames,
   cuts, give-up, per-rank damaged | loss, metrics, gradient norm] - the
   step's only host sync; a non-finite loss or gradient anywhere makes the
   summed loss or norm non-finite, so it costs no extra slot or kernel;
4. wait for the buckets; if any rank failed, all retry the same batches, the
   failed rank as it was once, then with finer splits; a cut that fails alone
   twice is quarantined;
5. otherwise: gradient / global frames, then the transactional update.

`--grad-sync ddp` uses torch DDP instead: the vote runs before the synced
backward (`sync.votes_before_backward`), so forward OOMs are recoverable; a
backward OOM raises `DdpBackwardOomError` at once.

The parts: forward_backward.py (the pass), vote.py (the vote), recovery.py
(retry, split, quarantine), update.py (the transactional update), repair.py,
guard.py (OOM -> Failure), checks.py (validation, consistency), phases.py
(where the trainer is). This module orchestrates them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from valle.args import autocast_dtype
from valle.train.batching import Batch, batch_size, frame_count, split_batch
from valle.train.dist import DistContext
from valle.train.resilience import checks
from valle.train.resilience.channel import ControlChannel
from valle.train.resilience.checks import ConsistencyError, Validation
from valle.train.resilience.faults import FaultInjector
from valle.train.resilience.forward_backward import (
    PassSettings,
    backward_loss,
    forward_loss,
    sample_seed,
)
from valle.train.resilience.guard import Failure, OomGuard
from valle.train.resilience.memory import BackwardReserve, OomReporter, is_oom_error
from valle.train.resilience.phases import PhaseTracker
from valle.train.resilience.quarantine import OomNotDataError, OomPolicy, Quarantine
from valle.train.resilience.recovery import Recovery
from valle.train.resilience.repair import NoHealthyRankError, StateRepair
from valle.train.resilience.update import TransactionalUpdate
from valle.train.resilience.vote import Ballot, Vote, VoteExchange, accumulate

logger = logging.getLogger(__name__)

# Names other modules import from here (their homes are the modules above).
__all__ = ["ConsistencyError", "DdpBackwardOomError", "NoHealthyRankError", "ResilientStep",
           "StepConfig", "StepResult", "Validation", "sample_seed"]


def _never() -> bool:
    return False


class DdpBackwardOomError(RuntimeError):
    """A backward OOM under torch DDP: the other ranks cannot be released."""


@dataclass
class StepConfig:
    train_stage: int = 0
    dtype: str = "float32"
    seed: int = 42
    grad_clip: float = 0.0  # 0: no clipping here (ScaledAdam clips itself)
    backward_reserve_mb: int = 0
    max_attempts: int = 64
    update_retries: int = 2  # local retries of an update phase that ran out of memory
    max_quarantined: int = 100
    max_fitted_before: int = 3


@dataclass
class StepResult:
    step: int
    applied: bool = False
    all_done: bool = False
    skipped_nonfinite: bool = False
    loss: float = 0.0  # global sum over frames
    frames: int = 0  # global
    metrics: dict[str, float] = field(default_factory=dict)  # global sums
    cuts_drawn: list[str] = field(default_factory=list)  # this rank
    cuts_trained: list[str] = field(default_factory=list)
    cuts_quarantined: list[str] = field(default_factory=list)
    cuts_skipped: list[str] = field(default_factory=list)  # non-finite loss
    ooms: int = 0
    attempts: int = 0
    repairs: int = 0
    stop_requested: bool = False  # some rank asked to stop after this step (same on every rank)
    unreadable: int = 0  # cuts drawn for this step whose codes could not be read, all ranks


class ResilientStep:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync,
        ctx: DistContext,
        cfg: StepConfig,
        *,
        scaler: torch.amp.GradScaler | None = None,
        averager=None,
        faults: FaultInjector | None = None,
        reporter: OomReporter | None = None,
        quarantine: Quarantine | None = None,
        channel: ControlChannel | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.sync = sync
        self.ctx = ctx
        self.cfg = cfg
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.averager = averager
        self.faults = faults if faults is not None else FaultInjector([], ctx.rank)
        # Where the trainer is; the fault injector listens to the same tracker.
        self.phases: PhaseTracker = self.faults.phases
        self.channel = channel if channel is not None else ControlChannel(ctx)
        self.device = ctx.device
        self.reserve = BackwardReserve(self.device, cfg.backward_reserve_mb)
        self.settings = PassSettings(
            device=self.device, sync=sync, phases=self.phases, faults=self.faults,
            autocast_dtype=autocast_dtype(cfg.dtype), train_stage=cfg.train_stage,
            seed=cfg.seed, scaler=self.scaler, nar_context=self.reserve.held)
        self.guard = OomGuard(self.device, ctx.rank, self.phases, self.reserve,
                              reporter if reporter is not None else OomReporter(None, ctx.rank))
        self.votes = VoteExchange(self.channel, ctx.rank, ctx.world_size, self.phases)
        self.recovery = Recovery(OomPolicy(cfg.max_quarantined, cfg.max_fitted_before),
                                 quarantine if quarantine is not None else Quarantine(None),
                                 self.channel, self.phases, ctx.rank, ctx.distributed)
        self.repairer = StateRepair(model, optimizer, self.scaler, averager, self.channel,
                                    self.phases, ctx.rank, ctx.world_size, self.device)
        self.update = TransactionalUpdate(optimizer, self.scaler, averager, sync, cfg.grad_clip,
                                          cfg.update_retries, self.guard, self.phases, self.faults)
        self.state_damaged = False  # this rank's optimizer/averager state needs repair
        if hasattr(sync, "on_launch") and sync.on_launch is None:
            sync.on_launch = self._on_bucket_launch
        # Non-finite gradients with a finite loss are voted like a non-finite loss,
        # except under GradScaler, which needs to see fp16 overflow to lower its scale.
        sync.check_finite = self.scaler is None
        self._materialized = False
        self.meter = None  # the run's memory meter (valle.train.build.attach_meter), if any

    @property
    def quarantine(self) -> Quarantine:
        return self.recovery.quarantine

    @property
    def reporter(self) -> OomReporter:
        return self.guard.reporter

    def materialize_state(self) -> None:
        """Create optimizer and scaler state now (after any checkpoint was loaded), so
        every rank holds the same tensors at all times and a repair can overwrite them
        in place. Also done by the first step if the caller did not."""
        materialize = getattr(self.optimizer, "materialize_state", None)
        if materialize is not None:
            materialize()
        if self.scaler is not None and self.scaler._scale is None:
            self.scaler.scale(torch.zeros((), device=self.device))  # creates scale + tracker
        self._materialized = True

    # -- public -----------------------------------------------------------

    def run(self, step: int, batch: Batch | None, initial_split: int = 1, *,
            stop_requested: Callable[[], bool] = _never, unreadable: int = 0) -> StepResult:
        """One optimizer step over `batch` (None: this rank has no data left).

        `initial_split` micro-batches to begin with (--accumulate-grad-steps);
        `stop_requested()`: whether this rank asks to stop after this step (preemption);
        `unreadable`: cuts drawn for this step that could not be read. Both are voted."""
        if not self._materialized:
            self.materialize_state()
        result = StepResult(step=step, cuts_drawn=list(batch["cut_ids"]) if batch else [])
        # "Done" means no data left, not "every row quarantined": that rank still has data.
        ballot = Ballot(dry=batch is None, unreadable=unreadable)
        batch, already = self.recovery.drop_quarantined(batch)
        result.cuts_quarantined += already
        split = min(initial_split, batch_size(batch)) if batch else 1
        self.recovery.policy.begin_step()
        for attempt in range(self.cfg.max_attempts):
            result.attempts = attempt + 1
            self.phases.begin_attempt(step, attempt)
            # Dropout masks etc. depend on (seed, step) only: a retry replays them.
            torch.manual_seed(sample_seed(self.cfg.seed, step, "") % (1 << 62))
            failure, vote = self._attempt(step, batch, split, ballot, stop_requested)
            result.stop_requested |= vote.stop > 0
            result.unreadable = vote.unreadable  # the same in every attempt of the step
            if vote.give_up:
                raise OomNotDataError(self.recovery.give_up_message())
            if vote.bad_ranks:
                self._repair(vote.bad_ranks, step)
                result.repairs += 1
                continue  # gradients were computed on damaged parameters somewhere
            if self.sync.epoch_over(vote.done, self.ctx.world_size):
                result.all_done = True
                result.cuts_skipped += list(batch["cut_ids"]) if batch else []
                return result
            if vote.failed:
                quarantined: list[str] = []
                if failure is not None:
                    result.ooms += 1
                    batch, split, quarantined = self.recovery.refine(step, batch, split, failure)
                    result.cuts_quarantined += quarantined
                self.recovery.share_quarantine(quarantined)
                continue
            result.loss, result.frames, result.metrics = vote.loss, vote.frames, vote.metrics
            if vote.nonfinite:
                logger.warning("step %d: non-finite loss or gradient on some rank; step skipped "
                               "on every rank", step)
                result.skipped_nonfinite = True
                result.cuts_skipped += list(batch["cut_ids"]) if batch else []
                return result
            outcome = self.update.apply(step, vote.frames)
            result.ooms += outcome.ooms
            self.state_damaged |= outcome.damaged
            result.applied = True
            if batch is not None:
                result.cuts_trained += list(batch["cut_ids"])
                self.recovery.note_trained(batch)
            return result
        raise RuntimeError(f"step {step}: no agreement after {self.cfg.max_attempts} attempts")

    def flush(self) -> None:
        """Agree on damaged state and repair it. Call at the same points on every rank
        (before checkpoints, validation, consistency checks and the end)."""
        bad_ranks = self.votes.damaged_ranks(self.state_damaged)
        if bad_ranks:
            self._repair(bad_ranks, step=self.phases.step + 1)

    def trial(self, batch: Batch) -> None:
        """Forward + scaled backward of `batch` exactly as training runs them (autocast,
        GradScaler, backward reserve), with no collective at all (DDP under no_sync, the
        buckets' hooks disarmed) and no update; for the scan."""
        if not self._materialized:
            self.materialize_state()
        self.sync.zero_grad()
        with self.sync.backward_context(False):
            loss, _ = forward_loss(self.model, batch, self.settings, 0)
            backward_loss(loss, batch, self.settings, last=False)
        loss = None
        self.sync.zero_grad()

    def validate(self, batches: Iterable[Batch],
                 cut_short: Callable[[], bool] = _never) -> Validation:
        """Validation loss over this rank's batches, summed over ranks with one vote.
        `cut_short()` after the batches: whether this rank stopped early (said in the vote)."""
        self.flush()
        return checks.validate(self.model, batches, self.settings, self.guard, self.channel,
                               cut_short)

    def fingerprints(self) -> dict[str, int]:
        """Exact fingerprints of parameters, optimizer, scaler and averaged model."""
        return checks.fingerprints(self.model, self.optimizer, self.scaler, self.averager)

    def check_consistency(self) -> dict[str, int] | None:
        """Raise ConsistencyError naming what differs between ranks (None: skipped)."""
        self.flush()
        return checks.check_consistency(self.fingerprints, self.guard, self.channel)

    def local(self, phase: str, fn: Callable[[], Any], retries: int = 1) -> bool:
        """Run rank-local work that issues no collective (a checkpoint write, a best
        model): an OOM frees memory and retries; False if it still fails. The other
        ranks need not know: nothing they do next depends on it."""
        with self.phases.phase_scope(phase):
            for _ in range(retries + 1):
                if self.guard.run(-1, fn) is None:
                    return True
        logger.error("%s failed after %d attempt(s): out of memory (see the OOM report)",
                     phase, retries + 1)
        return False

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable object (through the control channel: no allocation)."""
        with self.phases.phase_scope("gather"):
            return self.channel.gather_objects(obj)

    def reduce_counts(self, values: Sequence[float]) -> list[float]:
        with self.phases.phase_scope("vote"):
            return self.channel.reduce(list(values))

    # -- one attempt ---------------------------------------------------------

    def _attempt(self, step: int, batch: Batch | None, split: int, ballot: Ballot,
                 stop_requested: Callable[[], bool]) -> tuple[Failure | None, Vote]:
        self.guard.split = split
        self.sync.zero_grad()
        self.votes.sums.zero_()
        deferred: list[Any] = []  # DDP: (loss, micro) of the backward that syncs
        failure = None
        ballot.frames = ballot.cuts = 0
        if self.state_damaged:
            # Nothing to compute on damaged parameters: go straight to the vote (the
            # buckets still go out, zeros), which repairs this rank.
            self.sync.launch_remaining(failed=True)
        else:
            failure = self.guard.run(step, lambda: self._local_gradient(step, batch, split,
                                                                       deferred))
            if failure is not None:
                deferred.clear()
                self.sync.launch_remaining(failed=True)
            elif batch is not None:
                with self.phases.host_work():
                    ballot.frames, ballot.cuts = frame_count(batch), batch_size(batch)
        ballot.failed, ballot.damaged = failure is not None, self.state_damaged
        ballot.give_up = self.recovery.give_up is not None
        # Asked at the vote, not before the work: a signal during this attempt still
        # makes this step the last.
        ballot.stop = stop_requested()
        vote = self.votes.cast(ballot)
        if deferred and vote.clean():
            self._synced_backward(step, *deferred)
        deferred.clear()  # nobody runs the synced backward otherwise: no collective issued
        with self.phases.phase_scope("grad_sync"):
            self.sync.wait()
        return failure, vote

    def _local_gradient(self, step: int, batch: Batch | None, split: int,
                        deferred: list[Any]) -> None:
        """Forward + backward of every micro-batch, sums into the vote, buckets out.
        Under DDP the last backward is deferred until after the vote."""
        if batch is not None:
            with self.phases.host_work():
                micro_batches = split_batch(batch, split)
            for index, micro in enumerate(micro_batches):
                self.guard.micro = micro
                last = index == len(micro_batches) - 1
                defer = last and self.sync.votes_before_backward
                with self.sync.forward_context(last):
                    loss, metrics = forward_loss(self.model, micro, self.settings, step)
                    if not defer:
                        backward_loss(loss, micro, self.settings, last)
                accumulate(loss, metrics, self.votes.sums)
                if defer:
                    deferred[:] = [loss, micro]
                loss = metrics = None
            self.guard.micro = None
        with self.phases.phase_scope("grad_sync"):
            self.sync.launch_remaining()
            self.sync.write_grad_norm(self.votes.sums[-1])

    def _synced_backward(self, step: int, loss: torch.Tensor, micro: Batch) -> None:
        try:
            backward_loss(loss, micro, self.settings, last=True)
        except Exception as exc:  # noqa: BLE001
            if not is_oom_error(exc):
                raise
            raise DdpBackwardOomError(
                f"rank {self.ctx.rank}: out of memory in backward at step {step} under "
                "--grad-sync ddp. DDP all-reduces inside backward, so the other ranks cannot "
                "be released; they will fail at the collective timeout. Use --grad-sync "
                f"overlap (the default) to recover from backward OOMs. ({exc})"
            ) from None

    def _on_bucket_launch(self, bucket_index: int) -> None:
        with self.phases.phase_scope("grad_sync"):
            self.faults.maybe_fail("grad_sync", None, self.device)

    def _repair(self, bad_ranks: Sequence[int], step: int) -> None:
        self.repairer.repair(bad_ranks, step)
        self.state_damaged = False

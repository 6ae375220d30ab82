"""The resilient optimizer step (DESIGN.md §3) and the loop's other per-step work.

Rule: every rank issues the same sequence of collectives every optimizer step,
whatever failed locally. Two mechanisms make that hold for an out-of-memory
error at *any* allocation, not only at a few named points:

* Local work is guarded, collectives are not in it. Everything that allocates
  (to_device, forward, backward, a bucket's norm, the finiteness check) runs
  inside `_guarded`, which turns an OOM into a `Failure` after leaving the
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
backward, so forward OOMs are recoverable; a backward OOM raises
`DdpBackwardOomError` at once.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from valle.args import autocast_dtype
from valle.train.batching import (
    Batch,
    batch_size,
    drop_cuts,
    frame_count,
    select_rows,
    split_batch,
    to_device,
)
from valle.train.dist import DistContext, object_fingerprint, tensor_fingerprint
from valle.train.optim import scale_and_clip_
from valle.train.resilience.channel import ControlChannel
from valle.train.resilience.faults import FaultInjector, InjectedOutOfMemoryError
from valle.train.resilience.memory import (
    BackwardReserve,
    OomEvent,
    OomReporter,
    describe_batch,
    free_memory,
    is_oom_error,
    memory_figures,
)
from valle.train.resilience.quarantine import OomNotDataError, OomPolicy, Quarantine

logger = logging.getLogger(__name__)

# Metric sums the model returns; they ride in the vote so logging costs no extra sync.
METRIC_KEYS = ("ar_loss", "nar_loss", "ar_top10_correct", "ar_frames", "nar_top10_correct",
               "nar_frames")
# The vote vector: host-written slots, then one per rank ("state damaged"), then the
# device-written sums.
_FAILED, _DONE, _FRAMES, _CUTS, _GIVE_UP, _STOP, _UNREADABLE = range(7)
_HOST0 = 7
_SUMS = 1 + len(METRIC_KEYS) + 1  # loss, metrics, gradient norm



class NoHealthyRankError(RuntimeError):
    """The optimizer/averaging state is damaged on every rank: only a restart helps."""


class DdpBackwardOomError(RuntimeError):
    """A backward OOM under torch DDP: the other ranks cannot be released."""


class ConsistencyError(RuntimeError):
    """Ranks hold different parameters/optimizer/scaler/averaged-model state."""


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
class Failure:
    phase: str
    cut_ids: list[str]
    message: str
    injected: bool
    memory: dict[str, int] = field(default_factory=dict)  # at the failure, before freeing


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


@dataclass
class Validation:
    loss: float  # per predicted frame
    metrics: dict[str, float]  # global sums
    frames: float
    batches: int  # global
    oom_batches: int  # global: skipped after an OOM
    cut_short: int = 0  # ranks that stopped early (a preemption signal)


def sample_seed(seed: int, step: int, cut_id: str) -> int:
    """A 63-bit seed from (run seed, step, cut id), identical on every rank and retry."""
    digest = hashlib.blake2b(f"{seed}:{step}:{cut_id}".encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] & 0x7FFFFFFFFFFFFFFF


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
        self.reporter = reporter if reporter is not None else OomReporter(None, ctx.rank)
        self.quarantine = quarantine if quarantine is not None else Quarantine(None)
        self.channel = channel if channel is not None else ControlChannel(ctx)
        self.policy = OomPolicy(cfg.max_quarantined, cfg.max_fitted_before)
        self.device = ctx.device
        self.reserve = BackwardReserve(self.device, cfg.backward_reserve_mb)
        if hasattr(model, "nar_forward_context"):
            model.nar_forward_context = self.reserve.held
        self.autocast_dtype = autocast_dtype(cfg.dtype)
        self.state_damaged = False  # this rank's optimizer/averager state needs repair
        self._give_up: str | None = None  # why this rank says the GPU is the problem
        self._split = 1
        self._dry = False
        self._micro: Batch | None = None  # the micro-batch in flight (for reports)
        # This rank's stop request (preemption), carried by the step's vote.
        self.stop_requested: Callable[[], bool] = lambda: False
        # Cuts drawn for this step that could not be read (the loop sets it), voted.
        self.unreadable_cuts = 0
        self._host_slots = _HOST0 + ctx.world_size
        # Device-side sums of the vote, written in place during the attempt.
        self._sums = self.channel.device_slots(self._host_slots, _SUMS)
        if hasattr(sync, "on_launch") and sync.on_launch is None:
            sync.on_launch = self._on_bucket_launch
        self.is_ddp = getattr(sync, "mode", "") == "ddp"
        # Non-finite gradients with a finite loss are voted like a non-finite loss,
        # except under GradScaler, which needs to see fp16 overflow to lower its scale.
        sync.check_finite = self.scaler is None
        self._materialized = False
        # --compile swaps in TrainingCompiler.wrap (valle.train.compile): same call, compiled.
        self.wrap_forward: Callable[[nn.Module], Callable[..., Any]] = lambda module: module

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

    def run(self, step: int, batch: Batch | None, initial_split: int = 1) -> StepResult:
        """One optimizer step over `batch` (None: this rank has no data left).

        `initial_split` micro-batches to begin with (--accumulate-grad-steps)."""
        if not self._materialized:
            self.materialize_state()
        result = StepResult(step=step, cuts_drawn=list(batch["cut_ids"]) if batch else [])
        # "Done" means no data left, not "every row quarantined": that rank still has data.
        self._dry = batch is None
        batch, already = self._drop_quarantined(batch)
        result.cuts_quarantined += already
        split = min(initial_split, batch_size(batch)) if batch else 1
        self.policy.begin_step()
        for attempt in range(self.cfg.max_attempts):
            result.attempts = attempt + 1
            self.faults.begin_attempt(step, attempt)
            # Dropout masks etc. depend on (seed, step) only: a retry replays them.
            torch.manual_seed(sample_seed(self.cfg.seed, step, "") % (1 << 62))
            failure, vote = (self._attempt_ddp if self.is_ddp else self._attempt)(step, batch, split)
            result.stop_requested |= vote.stop > 0
            result.unreadable = vote.unreadable  # the same in every attempt of the step
            if vote.give_up:
                raise OomNotDataError(self._give_up_message(vote))
            if vote.bad_ranks:
                self._repair(vote.bad_ranks, step)
                result.repairs += 1
                continue  # gradients were computed on damaged parameters somewhere
            if self._all_done(vote):
                result.all_done = True
                result.cuts_skipped += list(batch["cut_ids"]) if batch else []
                return result
            if vote.failed:
                quarantined: list[str] = []
                if failure is not None:
                    result.ooms += 1
                    batch, split, quarantined = self._refine(step, batch, split, failure)
                    result.cuts_quarantined += quarantined
                self._share_quarantine(quarantined)
                continue
            result.loss, result.frames, result.metrics = vote.loss, vote.frames, vote.metrics
            if vote.nonfinite:
                logger.warning("step %d: non-finite loss or gradient on some rank; step skipped "
                               "on every rank", step)
                result.skipped_nonfinite = True
                result.cuts_skipped += list(batch["cut_ids"]) if batch else []
                return result
            result.ooms += self._apply(step, vote.frames)
            result.applied = True
            if batch is not None:
                result.cuts_trained += list(batch["cut_ids"])
                with self.faults.host_work():
                    self.policy.note_trained(batch["audio_features_lens"].tolist(),
                                             batch["text_tokens_lens"].tolist())
            return result
        raise RuntimeError(f"step {step}: no agreement after {self.cfg.max_attempts} attempts")

    def flush(self) -> None:
        """Agree on damaged state and repair it. Call at the same points on every rank
        (before checkpoints, validation, consistency checks and the end)."""
        host = [0.0] * self._host_slots
        host[_HOST0 + self.ctx.rank] = float(self.state_damaged)
        with self.faults.phase_scope("vote"):
            v = self.channel.reduce(host)
        bad_ranks = [r for r in range(self.ctx.world_size) if v[_HOST0 + r] > 0]
        if bad_ranks:
            self._repair(bad_ranks, step=self.faults.step + 1)

    def trial(self, batch: Batch) -> None:
        """Forward + scaled backward of `batch` exactly as training runs them (autocast,
        GradScaler, backward reserve), with no collective at all (DDP under no_sync, the
        buckets' hooks disarmed) and no update; for the scan."""
        if not self._materialized:
            self.materialize_state()
        self.sync.zero_grad()
        with self.sync.backward_context(False):
            loss, _ = self._forward(0, batch)
            self._backward(loss, batch, last=False)
        loss = None
        self.sync.zero_grad()

    def validate(self, batches: Iterable[Batch],
                 cut_short: Callable[[], bool] = lambda: False) -> Validation:
        """Validation loss over this rank's batches, summed over ranks with one vote.
        `cut_short()` after the batches: whether this rank stopped early (said in the vote).

        A batch that runs out of memory is skipped and counted; the reduction has the
        same layout on every rank whatever failed, so it cannot mismatch."""
        self.flush()
        sums = self.channel.device_slots(3, 1 + len(METRIC_KEYS))
        sums.zero_()
        count = oom_batches = 0
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.faults.phase_scope("validate"):
                for batch in self._host_iter(batches):
                    failure = self._guarded(-1, lambda b=batch: self._eval_batch(b, sums))
                    oom_batches += failure is not None
                    count += 1
        finally:
            self.model.train(was_training)
        with self.faults.phase_scope("vote"):
            v = self.channel.reduce([float(cut_short()), float(count), float(oom_batches)],
                                    used=3 + len(sums))
        metrics = {k: v[4 + i] for i, k in enumerate(METRIC_KEYS)}
        frames = metrics["ar_frames"] + metrics["nar_frames"]
        return Validation(loss=v[3] / frames if frames else math.inf, metrics=metrics,
                          frames=frames, batches=int(v[1]), oom_batches=int(v[2]),
                          cut_short=int(v[0]))

    def fingerprints(self) -> dict[str, int]:
        """Exact fingerprints of parameters, optimizer, scaler and averaged model."""
        return {
            "params": tensor_fingerprint([p.detach() for p in self.model.parameters()]),
            "optimizer": object_fingerprint(self.optimizer.state_dict()),
            "scaler": object_fingerprint(self.scaler.state_dict() if self.scaler else {}),
            "averaged": tensor_fingerprint(self.averager.tensors()) if self.averager else 0,
        }

    def check_consistency(self) -> dict[str, int] | None:
        """Raise ConsistencyError naming what differs between ranks. If computing the
        fingerprints ran out of memory on some rank, every rank skips this check."""
        self.flush()
        mine: dict[str, int] = {}
        with self.faults.phase_scope("consistency"):
            failure = self._guarded(-1, lambda: mine.update(self.fingerprints()))
        keys = ["averaged", "optimizer", "params", "scaler"]
        with self.faults.phase_scope("vote"):
            table = self.channel.gather_ints([int(failure is not None)]
                                             + [mine.get(k, 0) for k in keys])
        if any(row[0] for row in table):
            logger.warning("consistency check skipped: out of memory computing fingerprints on "
                           "rank(s) %s", [r for r, row in enumerate(table) if row[0]])
            return None
        differing = [k for i, k in enumerate(keys, 1) if len({row[i] for row in table}) > 1]
        if differing:
            raise ConsistencyError(f"ranks disagree on {', '.join(differing)}: {table}")
        return mine

    def local(self, phase: str, fn: Callable[[], Any], retries: int = 1) -> bool:
        """Run rank-local work that issues no collective (a checkpoint write, a best
        model): an OOM frees memory and retries; False if it still fails. The other
        ranks need not know: nothing they do next depends on it."""
        with self.faults.phase_scope(phase):
            for _ in range(retries + 1):
                if self._guarded(-1, fn) is None:
                    return True
        logger.error("%s failed after %d attempt(s): out of memory (see the OOM report)",
                     phase, retries + 1)
        return False

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable object (through the control channel: no allocation)."""
        with self.faults.phase_scope("gather"):
            return self.channel.gather_objects(obj)

    def reduce_counts(self, values: Sequence[float]) -> list[float]:
        with self.faults.phase_scope("vote"):
            return self.channel.reduce(list(values))

    # -- one attempt (bucketed modes) ----------------------------------------

    def _attempt(self, step: int, batch: Batch | None, split: int) -> tuple[Failure | None, Vote]:
        self._split = split
        self.sync.zero_grad()
        self._sums.zero_()
        failure = None
        frames = cuts = 0
        if self.state_damaged:
            # Nothing to compute on damaged parameters: go straight to the vote (the
            # buckets still go out, zeros), which repairs this rank.
            self.sync.launch_remaining(failed=True)
        else:
            failure = self._guarded(step, lambda: self._local_gradient(step, batch, split))
            if failure is not None:
                self.sync.launch_remaining(failed=True)
            elif batch is not None:
                with self.faults.host_work():
                    frames, cuts = frame_count(batch), batch_size(batch)
        vote = self._vote(failure is not None, frames, cuts)
        with self.faults.phase_scope("grad_sync"):
            self.sync.wait()
        return failure, vote

    def _local_gradient(self, step: int, batch: Batch | None, split: int) -> None:
        """Forward + backward of every micro-batch, sums into the vote, buckets out."""
        if batch is not None:
            with self.faults.host_work():
                micro_batches = split_batch(batch, split)
            for index, micro in enumerate(micro_batches):
                self._micro = micro
                loss, metrics = self._forward(step, micro)
                self._backward(loss, micro, index == len(micro_batches) - 1)
                self._accumulate(loss, metrics, self._sums)
                loss = metrics = None
            self._micro = None
        with self.faults.phase_scope("grad_sync"):
            self.sync.launch_remaining()
            self.sync.write_grad_norm(self._sums[-1])

    @staticmethod
    def _accumulate(loss: torch.Tensor, metrics: dict[str, torch.Tensor],
                    sums: torch.Tensor) -> None:
        """In-place adds into the vote's device slots (allocate nothing)."""
        sums[0].add_(loss.detach())
        for i, key in enumerate(METRIC_KEYS, 1):
            if key in metrics:
                sums[i].add_(metrics[key].detach())

    # -- one attempt (torch DDP) ---------------------------------------------

    def _attempt_ddp(self, step: int, batch: Batch | None, split: int) -> tuple[Failure | None, Vote]:
        self._split = split
        self.sync.zero_grad()
        self._sums.zero_()
        pending: list[torch.Tensor] = []
        micro_batches: list[Batch] = []

        def forward_all() -> None:
            micro_batches.extend(split_batch(batch, split) if batch is not None else [])
            for index, micro in enumerate(micro_batches):
                self._micro = micro
                last = index == len(micro_batches) - 1
                # DDP decides at forward time whether backward will all-reduce:
                # earlier micro-batches run forward *and* backward under no_sync.
                with self.sync.backward_context(last):
                    loss, metrics = self._forward(step, micro)
                    if not last:
                        self._backward(loss, micro, last=False)
                self._accumulate(loss, metrics, self._sums)
                if last:
                    pending.append(loss)
            self._micro = None

        failure = None if self.state_damaged else self._guarded(step, forward_all)
        frames = cuts = 0
        if failure is None and batch is not None and not self.state_damaged:
            with self.faults.host_work():
                frames, cuts = frame_count(batch), batch_size(batch)
        if failure is not None:
            pending.clear()
        vote = self._vote(failure is not None, frames, cuts)
        if vote.failed or vote.done or vote.nonfinite or vote.bad_ranks or vote.give_up:
            pending.clear()  # nobody runs the synced backward: no collective is issued
        elif pending:
            try:
                self._backward(pending.pop(), micro_batches[-1], last=True)
            except Exception as exc:  # noqa: BLE001
                if not is_oom_error(exc):
                    raise
                raise DdpBackwardOomError(
                    f"rank {self.ctx.rank}: out of memory in backward at step {step} under "
                    "--grad-sync ddp. DDP all-reduces inside backward, so the other ranks cannot "
                    "be released; they will fail at the collective timeout. Use --grad-sync "
                    f"overlap (the default) to recover from backward OOMs. ({exc})"
                ) from None
        return failure, vote

    def _all_done(self, vote: Vote) -> bool:
        # Bucketed modes: a dry rank contributes zero gradient until every rank is
        # dry, so nothing drawn is dropped. DDP cannot run a backward without a
        # batch, so there the epoch ends when the first rank runs dry.
        return vote.done > 0 if self.is_ddp else vote.done == self.ctx.world_size

    # -- phases ------------------------------------------------------------

    def _forward(self, step: int, micro: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids = micro["cut_ids"]
        with self.faults.phase_scope("to_device"):
            self.faults.maybe_fail("to_device", ids, self.device)
            on_device = to_device(micro, self.device)
            # Made on the host and copied without blocking: torch.tensor(..., device=cuda)
            # would wait for the device (a second host sync per step).
            seeds = torch.tensor([sample_seed(self.cfg.seed, step, c) for c in ids],
                                 dtype=torch.long).to(self.device, non_blocking=True)
        with self.faults.phase_scope("forward"):
            self.faults.maybe_kill()
            self.faults.maybe_stall()
            self.faults.maybe_fail("forward", ids, self.device)
            autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype)
                        if self.autocast_dtype is not None else nullcontext())
            with autocast:
                loss, metrics = self.wrap_forward(self.sync.forward_module(self.model))(
                    on_device["text_tokens"], on_device["text_tokens_lens"],
                    on_device["audio_features"], on_device["audio_features_lens"],
                    train_stage=self.cfg.train_stage, sample_seeds=seeds,
                    prompt_features=on_device.get("prompt_features"),
                    prompt_features_lens=on_device.get("prompt_features_lens"),
                    text_languages=on_device.get("text_languages"),
                )
            return self.faults.poison_grad(self.faults.poison_loss(loss.float())), metrics

    def _backward(self, loss: torch.Tensor, micro: Batch, last: bool) -> None:
        ids = micro["cut_ids"]
        with self.faults.phase_scope("backward"):
            self.faults.maybe_fail("backward", ids, self.device)
            scaled = self.scaler.scale(loss) if self.scaler is not None else loss
            with self.faults.memory_pressure("backward", ids, self.device), \
                    self.sync.backward_context(last):
                scaled.backward()

    def _eval_batch(self, batch: Batch, sums: torch.Tensor) -> None:
        self._micro = batch
        loss, metrics = self._forward(-1, batch)
        self._accumulate(loss, metrics, sums)
        self._micro = None

    def _on_bucket_launch(self, bucket_index: int) -> None:
        with self.faults.phase_scope("grad_sync"):
            self.faults.maybe_fail("grad_sync", None, self.device)

    def _apply(self, step: int, global_frames: int) -> int:
        """Normalise, then the update as a resumable transaction; returns the OOMs it
        met. Retried locally up to `update_retries` times (resuming where it stopped,
        same result as a clean update); after that this rank's state is damaged and
        is repaired at the next vote."""
        factor = 1.0 / max(global_frames, 1)
        if self.cfg.grad_clip <= 0:
            self.sync.scale_(factor)  # in place, allocates nothing
            factor = 1.0
        done: set[str] = set()
        for tries in range(self.cfg.update_retries + 1):
            failure = self._guarded(step, lambda: self._update(step, done, factor))
            if failure is None:
                return tries
            if "step started" in done and "step" not in done \
                    and not hasattr(self.optimizer, "resuming"):
                break  # an optimizer without resumable steps cannot finish a half-done one
        self.state_damaged = True
        reset_scaler_stage(self.scaler)
        if hasattr(self.optimizer, "_progress"):
            self.optimizer._progress = None
        logger.warning("rank %d: the update of step %d still ran out of memory after %d "
                       "retries; its state will be repaired from a healthy rank", self.ctx.rank,
                       step, self.cfg.update_retries)
        return self.cfg.update_retries + 1

    def _update(self, step: int, done: set[str], factor: float = 1.0) -> None:
        """Unscale, clip, step, scaler update, averaging; each sub-phase at most once.
        Each allocates before it mutates (the optimizer per chunk of parameters), so
        after an OOM calling this again finishes the update exactly. With clipping, the
        division by the global frame count (`factor`) happens in the clip's multiply."""
        with self.faults.phase_scope("optimizer"):
            self.faults.maybe_fail("optimizer", None, self.device)
            if self.scaler is not None and "unscale" not in done:
                self.scaler.unscale_(self.optimizer)
                done.add("unscale")
            if self.cfg.grad_clip > 0 and "clip" not in done:
                # On device, no sync; one norm pass (none on one rank: the finiteness
                # check's norms are reused) and one multiply.
                scale_and_clip_(self.sync.grad_tensors(), self.sync.grad_factor(factor),
                                self.cfg.grad_clip, norms=self.sync.grad_norms())
                done.add("clip")
            if "step" not in done:
                done.add("step started")
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)
                else:
                    self.optimizer.step()
                done.add("step")
            if self.scaler is not None and "update" not in done:
                self.scaler.update()
                done.add("update")
        with self.faults.phase_scope("average"):
            self.faults.maybe_fail("average", None, self.device)
            if self.averager is not None and "average" not in done:
                self.averager.update(step + 1)  # in place: allocates nothing
                done.add("average")

    # -- the vote and its consequences -----------------------------------------

    def _vote(self, failed: bool, frames: int, cuts: int) -> Vote:
        world = self.ctx.world_size
        host = [0.0] * self._host_slots
        host[_FAILED] = float(failed)
        host[_DONE] = float(self._dry)
        host[_FRAMES] = float(frames)
        host[_CUTS] = float(cuts)
        host[_GIVE_UP] = float(self._give_up is not None)
        host[_STOP] = float(self.stop_requested())
        host[_UNREADABLE] = float(self.unreadable_cuts)
        host[_HOST0 + self.ctx.rank] = float(self.state_damaged)
        with self.faults.phase_scope("vote"):
            v = self.channel.reduce(host, used=self._host_slots + _SUMS)  # the one host sync
        sums = v[self._host_slots:]
        return Vote(
            failed=int(v[_FAILED]), frames=int(v[_FRAMES]), cuts=int(v[_CUTS]),
            done=int(v[_DONE]), give_up=int(v[_GIVE_UP]), stop=int(v[_STOP]),
            unreadable=int(v[_UNREADABLE]), loss=sums[0],
            # NaN/inf on any rank makes the sum non-finite: no extra flag needed.
            nonfinite=not (math.isfinite(sums[0]) and math.isfinite(sums[-1])),
            metrics={k: sums[1 + i] for i, k in enumerate(METRIC_KEYS)},
            bad_ranks=[r for r in range(world) if v[_HOST0 + r] > 0],
        )

    def _refine(self, step: int, batch: Batch | None, split: int,
                failure: Failure) -> tuple[Batch | None, int, list[str]]:
        """After a local failure: retry, split finer, or quarantine a cut that failed
        alone twice (memory freed in between)."""
        if batch is None:
            return None, split, []
        if not failure.cut_ids:
            # Not while this rank's data was in flight: retry as is - unless it keeps
            # happening, which no split can fix (said in the next vote: all stop).
            if self.policy.non_data_failure():
                self._give_up = (f"step {step} failed {self.policy.non_data_failures} times "
                                 "outside any batch's forward/backward")
            return batch, split, []
        if len(failure.cut_ids) > 1:
            if self.policy.retry_as_is(split):
                # Memory was freed: a transient failure passes as it is, and the same
                # micro-batches give bit for bit the same gradient (in fp16 too).
                return batch, split, []
            return batch, min(split * 2, batch_size(batch)), []
        cut_id = failure.cut_ids[0]
        if not self.policy.quarantine_now(cut_id):
            return batch, split, []  # one transient failure is not a verdict on the cut
        with self.faults.host_work():
            info = describe_batch(_rows_of(batch, cut_id))
            row = {k: v[0] for k, v in info.items() if v and k != "cut_ids"}
            fitted = self.policy.fitted_before_here(row.get("audio_frame_lens", 0),
                                                    row.get("text_token_lens", 0))
            self.quarantine.add(cut_id, reason=f"out of memory in {failure.phase} even alone, "
                                "twice", step=step, rank=self.ctx.rank, message=failure.message,
                                fitted_before=fitted, **row)
            batch, _ = drop_cuts(batch, {cut_id})
        return batch, min(split, batch_size(batch)) if batch else 1, [cut_id]

    def _state_tensors(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
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

    def _repair(self, bad_ranks: Sequence[int], step: int) -> None:
        """Copy parameters, optimizer, scaler and averaged model from the lowest healthy
        rank, in place: the buffers exist on every rank, so nothing is allocated."""
        healthy = [r for r in range(self.ctx.world_size) if r not in bad_ranks]
        if not healthy:
            raise NoHealthyRankError(
                f"out of memory in the optimizer/averaging phase on every rank ({list(bad_ranks)}) "
                f"after step {step - 1}, even after retries: the parameters can no longer be "
                "trusted. Restart from the last checkpoint (under torchrun --max-restarts this "
                "happens automatically)."
            )
        src = healthy[0]
        logger.warning("repairing rank(s) %s from rank %d", list(bad_ranks), src)
        with self.faults.phase_scope("repair"):
            tensors, host = self._state_tensors()
            self.channel.broadcast_tensors(tensors, src)
            host = self.channel.broadcast_object(host, src)
        if self.ctx.rank in bad_ranks:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            offsets = [0]
            for g in self.optimizer.param_groups:
                offsets.append(offsets[-1] + len(g["params"]))
            for (gi, pi, key), value in host["optimizer"].items():
                self.optimizer.state[params[offsets[gi] + pi]][key] = value
            if self.averager is not None:
                self.averager.last_step = host["averager_last_step"]
        self.state_damaged = False

    # -- bookkeeping ---------------------------------------------------------

    def _share_quarantine(self, new_ids: list[str]) -> None:
        """Tell every rank about newly quarantined cuts (the sampler may deal the cut
        to another rank next epoch). Runs on every rank after a failed vote only."""
        entries = [self.quarantine.entries[c] for c in new_ids]
        if self.ctx.distributed:
            with self.faults.phase_scope("quarantine"):
                gathered = self.channel.gather_objects(entries)
            entries = [e for per_rank in gathered for e in per_rank]
            self.quarantine.merge(entries)
        self.policy.note_quarantined(entries)
        self._give_up = self.policy.verdict()  # said in the next vote, so all stop together

    def _give_up_message(self, vote: Vote) -> str:
        why = self._give_up or "another rank found it (see its log)"
        return (f"out-of-memory errors are not explained by the data: {why}. The GPU, not the "
                "data, is the problem: another process on the device, a leak, or settings "
                "that no longer fit (check nvidia-smi and <exp-dir>/oom/events-rank*.jsonl). "
                "Cuts quarantined in this run are listed in <exp-dir>/quarantine.jsonl; "
                "remove the lines of healthy cuts before restarting.")

    def _drop_quarantined(self, batch: Batch | None) -> tuple[Batch | None, list[str]]:
        if batch is None or not len(self.quarantine):
            return batch, []
        with self.faults.host_work():
            return drop_cuts(batch, self.quarantine.cut_ids)

    def _guarded(self, step: int, work: Callable[[], Any]) -> Failure | None:
        """Run local work; an OOM anywhere in it becomes a Failure (reported, memory
        freed) instead of an exception. Other errors propagate."""
        try:
            work()
            return None
        except Exception as exc:  # noqa: BLE001 - non-OOM errors are re-raised
            if not is_oom_error(exc):
                raise
            failure = self._failure(exc)
        # Outside the except block: the exception and the frames it pinned
        # (activations, the autograd graph) are released before cached blocks are
        # returned to the device.
        micro, self._micro = self._micro, None
        self._cleanup()
        self._report(step, failure, micro)
        return failure

    def _failure(self, exc: BaseException) -> Failure:
        """Facts about an OOM, taken inside the except block: the memory figures describe
        the pool at the failure, not after it was freed."""
        return Failure(
            phase=self.faults.take_error_phase(),
            cut_ids=list(self._micro["cut_ids"]) if self._micro is not None else [],
            message=str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
            injected=isinstance(exc, InjectedOutOfMemoryError),
            memory=memory_figures(self.device),
        )

    def _cleanup(self) -> None:
        self.reserve.release()
        free_memory(self.device)

    def _report(self, step: int, failure: Failure, micro: Batch | None) -> None:
        with self.faults.host_work():
            event = OomEvent(
                phase=failure.phase, rank=self.ctx.rank, step=step if step >= 0 else self.faults.step, attempt=self.faults.attempt,
                split=self._split, injected=failure.injected, message=failure.message,
                memory=failure.memory, **describe_batch(micro),
            )
            self.reporter.report(event, micro)

    def _host_iter(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Draw batches as host work (data loading allocates host memory only)."""
        iterator = iter(batches)
        while True:
            with self.faults.host_work():
                batch = next(iterator, None)
            if batch is None:
                return
            yield batch


def _rows_of(batch: Batch, cut_id: str) -> Batch:
    return select_rows(batch, [batch["cut_ids"].index(cut_id)])

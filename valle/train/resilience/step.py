"""The resilient optimizer step (DESIGN.md §3).

Rule: every rank issues the same sequence of collectives every optimizer step,
whatever failed locally. Per attempt, on every rank:

1. local gradient: forward + backward over the batch as `split` micro-batches;
   an OOM anywhere in it (to_device, forward, loss scaling, backward, a bucket
   launch) is caught, the except block is left, memory is freed;
2. `launch_remaining()`: every gradient bucket not yet all-reduced is launched,
   in order, so a failed rank completes the protocol the others are in;
3. the vote: ONE small all_reduce of [failed, non-finite, frames, cuts, done,
   metric sums, per-rank "state needs repair"] — the step's only host sync;
4. wait for the buckets; if any rank failed, all discard and retry the same
   batches, the failed rank with a finer split; a single cut that fails alone
   is quarantined; if any rank's optimizer/averaging state is damaged, it is
   repaired from the lowest healthy rank first;
5. otherwise: gradient / global frames, optimizer step, averaged model. An
   OOM there marks this rank's state as damaged; the mark travels in the next
   vote (or in `flush()`), so the healthy path keeps a single sync per step.

`--grad-sync ddp` uses torch DDP instead: the vote runs before the synced
backward, so forward OOMs are recoverable; a backward OOM raises
`DdpBackwardOomError` at once.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from valle.train.batching import (
    Batch,
    batch_size,
    drop_cuts,
    frame_count,
    select_rows,
    split_batch,
    to_device,
)
from valle.train.dist import (
    DistContext,
    all_reduce_sum,
    broadcast_object,
    broadcast_tensors,
    gather_ints,
    object_fingerprint,
    tensor_fingerprint,
)
from valle.train.optim import clip_grad_norm_
from valle.train.resilience.faults import CUT_PHASES, FaultInjector, InjectedOutOfMemoryError
from valle.train.resilience.memory import (
    BackwardReserve,
    OomEvent,
    OomReporter,
    describe_batch,
    free_memory,
    is_oom_error,
    memory_figures,
)
from valle.train.resilience.quarantine import Quarantine

logger = logging.getLogger(__name__)

# Metric sums the model returns; they ride in the vote so logging costs no extra sync.
METRIC_KEYS = ("ar_loss", "nar_loss", "ar_top10_correct", "ar_frames", "nar_top10_correct",
               "nar_frames")
_FAILED, _NONFINITE, _FRAMES, _CUTS, _DONE, _LOSS = range(6)
_METRICS0 = 6
_BAD0 = _METRICS0 + len(METRIC_KEYS)

AUTOCAST_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


@dataclass
class Failure:
    phase: str
    cut_ids: list[str]
    message: str
    injected: bool


@dataclass
class LocalOutcome:
    failure: Failure | None = None
    loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    frames: int = 0
    cuts: int = 0

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], frames: int, cuts: int) -> None:
        self.loss = loss if self.loss is None else self.loss + loss
        for key in METRIC_KEYS:
            if key in metrics:
                value = metrics[key].detach().float()
                self.metrics[key] = value if key not in self.metrics else self.metrics[key] + value
        self.frames += frames
        self.cuts += cuts


@dataclass
class Vote:
    failed: int
    nonfinite: int
    frames: int
    cuts: int
    done: int
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


def sample_seed(seed: int, step: int, cut_id: str) -> int:
    """A 63-bit seed from (run seed, step, cut id), identical on every rank and retry."""
    digest = hashlib.blake2b(f"{seed}:{step}:{cut_id}".encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] & 0x7FFFFFFFFFFFFFFF


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
        self.device = ctx.device
        self.reserve = BackwardReserve(self.device, cfg.backward_reserve_mb)
        self.autocast_dtype = AUTOCAST_DTYPES[cfg.dtype]
        self.state_damaged = False  # this rank's optimizer/averager state needs repair
        self._phase = "idle"
        self._split = 1
        self._dry = False
        if hasattr(sync, "on_launch") and sync.on_launch is None:
            sync.on_launch = self._on_bucket_launch
        self.is_ddp = getattr(sync, "mode", "") == "ddp"
        # Non-finite gradients with a finite loss are voted like a non-finite loss,
        # except under GradScaler, which needs to see fp16 overflow to lower its scale.
        sync.check_finite = self.scaler is None

    # -- public -----------------------------------------------------------

    def run(self, step: int, batch: Batch | None, initial_split: int = 1) -> StepResult:
        """One optimizer step over `batch` (None: this rank has no data left).

        `initial_split` micro-batches to begin with (--accumulate-grad-steps)."""
        result = StepResult(step=step, cuts_drawn=list(batch["cut_ids"]) if batch else [])
        # "Done" means no data left, not "every row quarantined": that rank still has data.
        self._dry = batch is None
        batch, already = self._drop_quarantined(batch)
        result.cuts_quarantined += already
        split = min(initial_split, batch_size(batch)) if batch else 1
        for attempt in range(self.cfg.max_attempts):
            result.attempts = attempt + 1
            self.faults.begin_attempt(step, attempt)
            # Dropout masks etc. depend on (seed, step) only: a retry replays them.
            torch.manual_seed(sample_seed(self.cfg.seed, step, "") % (1 << 62))
            local, vote = (self._attempt_ddp if self.is_ddp else self._attempt)(step, batch, split)
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
                if local.failure is not None:
                    result.ooms += 1
                    batch, split, quarantined = self._refine(step, batch, split, local.failure)
                    result.cuts_quarantined += quarantined
                self._share_quarantine(quarantined)
                continue
            result.loss, result.frames, result.metrics = vote.loss, vote.frames, vote.metrics
            if vote.nonfinite:
                logger.warning("step %d: non-finite loss or gradient on %d rank(s); step skipped "
                               "on every rank",
                               step, vote.nonfinite)
                result.skipped_nonfinite = True
                result.cuts_skipped += list(batch["cut_ids"]) if batch else []
                return result
            result.ooms += int(not self._apply(step, vote.frames))
            result.applied = True
            result.cuts_trained += list(batch["cut_ids"]) if batch else []
            return result
        raise RuntimeError(f"step {step}: no agreement after {self.cfg.max_attempts} attempts")

    def flush(self) -> None:
        """Agree on damaged state and repair it. Call at the same points on every rank
        (before checkpoints, validation, consistency checks and the end)."""
        bad = self.state_damaged
        if self.ctx.distributed:
            flags = torch.zeros(self.ctx.world_size, dtype=torch.float64, device=self.device)
            flags[self.ctx.rank] = float(bad)
            all_reduce_sum(flags, self.ctx)
            bad_ranks = [r for r, v in enumerate(flags.tolist()) if v > 0]
        else:
            bad_ranks = [0] if bad else []
        if bad_ranks:
            self._repair(bad_ranks, step=self.faults.step + 1)

    def trial(self, batch: Batch) -> None:
        """Forward + scaled backward of `batch` exactly as training runs them (autocast,
        GradScaler, backward reserve), without collectives or an update; for the scan."""
        self.sync.zero_grad()
        loss, _ = self._forward(0, batch)
        self._backward(loss, batch, last=False)  # not armed: no bucket is launched
        loss = None
        self.sync.zero_grad()

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> dict[str, float | torch.Tensor]:
        """Validation forward; an OOM skips the batch (counted), never a collective."""
        try:
            loss, metrics = self._forward(0, batch)
        except Exception as exc:  # noqa: BLE001
            if not is_oom_error(exc):
                raise
            failure = self._failure(exc, batch)
        else:
            self._phase = "idle"
            sums = {k: v.detach().float() for k, v in metrics.items() if k in METRIC_KEYS}
            return {"loss": loss.detach(), "frames": sums["ar_frames"] + sums["nar_frames"], **sums}
        self._cleanup()
        self._report(-1, failure, batch)
        return {"valid_oom_batches": 1}

    def fingerprints(self) -> dict[str, int]:
        """Exact fingerprints of parameters, optimizer, scaler and averaged model."""
        fp = {
            "params": tensor_fingerprint([p.detach() for p in self.model.parameters()]),
            "optimizer": object_fingerprint(self.optimizer.state_dict()),
            "scaler": object_fingerprint(self.scaler.state_dict() if self.scaler else {}),
            "averaged": tensor_fingerprint(self.averager.tensors()) if self.averager else 0,
        }
        return fp

    def check_consistency(self) -> dict[str, int]:
        """Raise ConsistencyError naming what differs between ranks."""
        self.flush()
        mine = self.fingerprints()
        keys = sorted(mine)
        table = gather_ints([mine[k] for k in keys], self.ctx)
        differing = [k for i, k in enumerate(keys) if len({row[i] for row in table}) > 1]
        if differing:
            raise ConsistencyError(f"ranks disagree on {', '.join(differing)}: {table}")
        return mine

    # -- one attempt (bucketed modes) ----------------------------------------

    def _attempt(self, step: int, batch: Batch | None, split: int) -> tuple[LocalOutcome, Vote]:
        self._split = split
        self.sync.zero_grad()
        local = LocalOutcome()
        if batch is not None:
            micro_batches = split_batch(batch, split)
            for index, micro in enumerate(micro_batches):
                local.failure = self._micro_batch(step, micro, index == len(micro_batches) - 1, local)
                if local.failure is not None:
                    break
        self._complete_sync(step, local)
        vote = self._vote(local, done=self._dry)
        self.sync.wait()
        return local, vote

    def _micro_batch(self, step: int, micro: Batch, last: bool, local: LocalOutcome) -> Failure | None:
        loss = metrics = None
        try:
            loss, metrics = self._forward(step, micro)
            self._backward(loss, micro, last)
        except Exception as exc:  # noqa: BLE001 - non-OOM errors are re-raised
            if not is_oom_error(exc):
                raise
            failure = self._failure(exc, micro)
        else:
            local.add(loss.detach(), metrics, frame_count(micro), batch_size(micro))
            return None
        # Outside the except block: the exception and the frames it pinned
        # (activations, the autograd graph) are released; drop our own
        # references too before returning cached blocks.
        loss = metrics = None
        self._cleanup()
        self._report(step, failure, micro)
        return failure

    def _complete_sync(self, step: int, local: LocalOutcome) -> None:
        """Launch every bucket not yet launched; a failure here is voted like any other."""
        try:
            self.sync.launch_remaining()
            return
        except Exception as exc:  # noqa: BLE001
            if not is_oom_error(exc):
                raise
            failure = self._failure(exc, None)
        self._cleanup()
        self._report(step, failure, None)
        local.failure = local.failure or failure
        # The collectives must still go out, or the other ranks wait for ever.
        self.sync.launch_remaining()

    # -- one attempt (torch DDP) ---------------------------------------------

    def _attempt_ddp(self, step: int, batch: Batch | None, split: int) -> tuple[LocalOutcome, Vote]:
        self._split = split
        self.sync.zero_grad()
        local = LocalOutcome()
        pending: torch.Tensor | None = None
        micro_batches = split_batch(batch, split) if batch is not None else []
        for index, micro in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            try:
                # DDP decides at forward time whether backward will all-reduce:
                # earlier micro-batches run forward *and* backward under no_sync.
                with self.sync.backward_context(last):
                    loss, metrics = self._forward(step, micro)
                    if not last:
                        self._backward(loss, micro, last=False)
            except Exception as exc:  # noqa: BLE001
                if not is_oom_error(exc):
                    raise
                local.failure = self._failure(exc, micro)
            else:
                local.add(loss.detach(), metrics, frame_count(micro), batch_size(micro))
                if last:
                    pending = loss
                continue
            loss = metrics = pending = None
            self._cleanup()
            self._report(step, local.failure, micro)
            break
        vote = self._vote(local, done=self._dry)
        if vote.failed or vote.done or vote.nonfinite or vote.bad_ranks:
            pending = None  # nobody runs the synced backward: no collective is issued
        elif pending is not None:
            try:
                self._backward(pending, micro_batches[-1], last=True)
            except Exception as exc:  # noqa: BLE001
                if not is_oom_error(exc):
                    raise
                raise DdpBackwardOomError(
                    f"rank {self.ctx.rank}: out of memory in backward at step {step} under "
                    "--grad-sync ddp. DDP all-reduces inside backward, so the other ranks cannot "
                    "be released; they will fail at the collective timeout. Use --grad-sync "
                    f"overlap (the default) to recover from backward OOMs. ({exc})"
                ) from None
        return local, vote

    def _all_done(self, vote: Vote) -> bool:
        # Bucketed modes: a dry rank contributes zero gradient until every rank is
        # dry, so nothing drawn is dropped. DDP cannot run a backward without a
        # batch, so there the epoch ends when the first rank runs dry.
        return vote.done > 0 if self.is_ddp else vote.done == self.ctx.world_size

    # -- phases ------------------------------------------------------------

    def _forward(self, step: int, micro: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids = micro["cut_ids"]
        self._phase = "to_device"
        self.faults.maybe_fail("to_device", ids, self.device)
        on_device = to_device(micro, self.device)
        seeds = torch.tensor([sample_seed(self.cfg.seed, step, c) for c in ids], dtype=torch.long,
                             device=self.device)
        self._phase = "forward"
        self.faults.maybe_kill()
        self.faults.maybe_stall()
        self.faults.maybe_fail("forward", ids, self.device)
        self.reserve.hold()
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None else nullcontext())
        with autocast:
            loss, metrics = self.sync.forward_module(self.model)(
                on_device["text_tokens"], on_device["text_tokens_lens"],
                on_device["audio_features"], on_device["audio_features_lens"],
                train_stage=self.cfg.train_stage, sample_seeds=seeds,
                prompt_features=on_device.get("prompt_features"),
                prompt_features_lens=on_device.get("prompt_features_lens"),
            )
        return self.faults.poison_grad(self.faults.poison_loss(loss.float())), metrics

    def _backward(self, loss: torch.Tensor, micro: Batch, last: bool) -> None:
        ids = micro["cut_ids"]
        self._phase = "backward"
        # Hand backward the contiguous block held through the forward.
        self.reserve.release()
        self.faults.maybe_fail("backward", ids, self.device)
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        with self.faults.memory_pressure("backward", ids, self.device), \
                self.sync.backward_context(last):
            scaled.backward()
        self._phase = "idle"

    def _on_bucket_launch(self, bucket_index: int) -> None:
        previous, self._phase = self._phase, "grad_sync"
        self.faults.maybe_fail("grad_sync", None, self.device)
        self._phase = previous

    def _apply(self, step: int, global_frames: int) -> bool:
        """Normalise, step the optimizer, update the averaged model. False after an OOM,
        which marks this rank's state damaged (repaired at the next vote)."""
        self.sync.scale_(1.0 / max(global_frames, 1))
        try:
            self._phase = "optimizer"
            self.faults.maybe_fail("optimizer", None, self.device)
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.cfg.grad_clip > 0:
                clip_grad_norm_(self.sync.params, self.cfg.grad_clip)  # on device, no sync
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self._phase = "average"
            self.faults.maybe_fail("average", None, self.device)
            if self.averager is not None:
                self.averager.update(step + 1)
        except Exception as exc:  # noqa: BLE001
            if not is_oom_error(exc):
                raise
            failure = self._failure(exc, None)
        else:
            self._phase = "idle"
            return True
        self._cleanup()
        self._report(step, failure, None)
        self.state_damaged = True
        return False

    # -- the vote and its consequences -----------------------------------------

    def _vote(self, local: LocalOutcome, done: bool) -> Vote:
        world = self.ctx.world_size
        values = [0.0] * (_BAD0 + world)
        values[_FAILED] = float(local.failure is not None)
        values[_FRAMES] = float(local.frames)
        values[_CUTS] = float(local.cuts)
        values[_DONE] = float(done)
        values[_BAD0 + self.ctx.rank] = float(self.state_damaged)
        vector = torch.tensor(values, dtype=torch.float64, device=self.device)
        if local.failure is None and local.loss is not None:
            # Device-side writes: no host sync before the all_reduce.
            bad = ~torch.isfinite(local.loss)
            grads_finite = self.sync.local_grads_finite()
            if grads_finite is not None:
                bad = bad | ~grads_finite
            vector[_NONFINITE] = bad.double()
            sums = [local.loss] + [local.metrics.get(k, torch.zeros((), device=self.device))
                                   for k in METRIC_KEYS]
            vector[_LOSS:_BAD0] = torch.stack([s.double().reshape(()) for s in sums])
        all_reduce_sum(vector, self.ctx)
        v = vector.tolist()  # the step's one host sync
        return Vote(
            failed=int(v[_FAILED]), nonfinite=int(v[_NONFINITE]), frames=int(v[_FRAMES]),
            cuts=int(v[_CUTS]), done=int(v[_DONE]), loss=v[_LOSS],
            metrics={k: v[_METRICS0 + i] for i, k in enumerate(METRIC_KEYS)},
            bad_ranks=[r for r in range(world) if v[_BAD0 + r] > 0],
        )

    def _refine(self, step: int, batch: Batch | None, split: int,
                failure: Failure) -> tuple[Batch | None, int, list[str]]:
        """After a local failure: split finer, or quarantine a cut that failed alone."""
        if batch is None:
            return None, split, []
        if len(failure.cut_ids) == 1 and failure.phase in CUT_PHASES:
            cut_id = failure.cut_ids[0]
            info = describe_batch(_rows_of(batch, cut_id))
            self.quarantine.add(cut_id, reason=f"out of memory in {failure.phase} even alone",
                                step=step, rank=self.ctx.rank, message=failure.message,
                                **{k: v[0] for k, v in info.items() if v and k != "cut_ids"})
            batch, _ = drop_cuts(batch, {cut_id})
            return batch, min(split, batch_size(batch)) if batch else 1, [cut_id]
        return batch, min(split * 2, batch_size(batch)), []

    def _repair(self, bad_ranks: Sequence[int], step: int) -> None:
        """Copy parameters, optimizer, scaler and averaged model from the lowest healthy rank."""
        healthy = [r for r in range(self.ctx.world_size) if r not in bad_ranks]
        if not healthy:
            raise NoHealthyRankError(
                f"out of memory in the optimizer/averaging phase on every rank ({list(bad_ranks)}) "
                f"after step {step - 1}: the parameters can no longer be trusted. Restart from the last "
                "checkpoint (under torchrun --max-restarts this happens automatically)."
            )
        src = healthy[0]
        logger.warning("repairing rank(s) %s from rank %d", list(bad_ranks), src)
        broadcast_tensors([p.data for p in self.model.parameters()], src, self.ctx)
        if self.averager is not None:
            broadcast_tensors(self.averager.tensors(), src, self.ctx)
        opt_state = broadcast_object(self.optimizer.state_dict() if self.ctx.rank == src else None,
                                     src, self.ctx)
        scaler_state = broadcast_object(
            self.scaler.state_dict() if self.scaler is not None and self.ctx.rank == src else None,
            src, self.ctx)
        if self.ctx.rank in bad_ranks:
            self.optimizer.load_state_dict(opt_state)
            if self.scaler is not None:
                self.scaler.load_state_dict(scaler_state)
        self.state_damaged = False

    # -- bookkeeping ---------------------------------------------------------

    def _share_quarantine(self, new_ids: list[str]) -> None:
        """Tell every rank about newly quarantined cuts (the sampler may deal the cut
        to another rank next epoch). Runs on every rank after a failed vote only."""
        if not self.ctx.distributed:
            return
        gathered: list = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, [self.quarantine.entries[c] for c in new_ids],
                               group=self.ctx.group)
        self.quarantine.merge([entry for entries in gathered for entry in entries])

    def _drop_quarantined(self, batch: Batch | None) -> tuple[Batch | None, list[str]]:
        if batch is None or not len(self.quarantine):
            return batch, []
        return drop_cuts(batch, self.quarantine.cut_ids)

    def _failure(self, exc: BaseException, micro: Batch | None) -> Failure:
        """Facts about an OOM, taken inside the except block (holds no tensor)."""
        return Failure(
            phase=self._phase,
            cut_ids=list(micro["cut_ids"]) if micro is not None else [],
            message=str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
            injected=isinstance(exc, InjectedOutOfMemoryError),
        )

    def _cleanup(self) -> None:
        self._phase = "idle"
        self.reserve.release()
        free_memory(self.device)

    def _report(self, step: int, failure: Failure, micro: Batch | None) -> None:
        event = OomEvent(
            phase=failure.phase, rank=self.ctx.rank, step=step, attempt=self.faults.attempt,
            split=self._split, injected=failure.injected, message=failure.message,
            memory=memory_figures(self.device), **describe_batch(micro),
        )
        self.reporter.report(event, micro)


def _rows_of(batch: Batch, cut_id: str) -> Batch:
    return select_rows(batch, [batch["cut_ids"].index(cut_id)])

"""The training loop: epochs of resilient steps, validation, logging, checkpoints.

It reads top to bottom: set up, resume, scan, then for every step draw a batch
and hand it to `ResilientStep.run`. Everything that can fail in a step lives
in valle.train.resilience.step; this file holds no OOM handling of its own.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from valle.train.batching import Batch, concat_batches
from valle.train.checkpoint import (
    CorruptCheckpointError,
    apply_stage_switch,
    find_latest_checkpoint,
    load_checkpoint,
    make_payload,
    remove_old_checkpoints,
    save_best,
    save_checkpoint,
)
from valle.train.compile import TrainingCompiler, attach_compiler, compile_note
from valle.train.config import TrainConfig
from valle.train.data import TrainData, build_train_data
from valle.train.dist import DistContext, init_distributed, shutdown
from valle.train.metrics import MetricsTracker, TensorBoardLogger, ThroughputMeter, setup_logging
from valle.train.optim import build_optimizer, build_scheduler
from valle.train.preemption import EXIT_PREEMPT_TIMEOUT, EXIT_PREEMPTED, Preemption
from valle.train.resilience.channel import VOTE_SLOTS, ControlChannel
from valle.train.resilience.faults import FaultInjector
from valle.train.resilience.gradsync import build_grad_sync
from valle.train.resilience.memory import OomReporter, configure_allocator
from valle.train.resilience.quarantine import OomNotDataError, Quarantine
from valle.train.resilience.scan import BatchTooLargeError, scan_pessimistic_batches
from valle.train.resilience.step import ResilientStep, StepConfig, StepResult
from valle.train.watchdog import StallWatchdog

logger = logging.getLogger(__name__)

GRAD_SCALE_COLLAPSED = 1e-4


@dataclass
class EpochAccount:
    """Nothing lost: drawn = trained + quarantined + skipped, per rank and epoch."""

    drawn: int = 0
    trained: int = 0
    quarantined: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # non-finite loss / dropped at epoch end
    ooms: int = 0
    retries: int = 0
    steps: int = 0
    loss_sum: float = 0.0  # global, over predicted frames of applied steps
    loss_frames: float = 0.0

    def add(self, r: StepResult) -> None:
        self.drawn += len(r.cuts_drawn)
        self.trained += len(r.cuts_trained)
        self.quarantined += r.cuts_quarantined
        self.skipped += r.cuts_skipped
        self.ooms += r.ooms
        self.retries += r.attempts - 1
        if r.applied:
            self.loss_sum += r.loss
            self.loss_frames += r.metrics.get("ar_frames", 0.0) + r.metrics.get("nar_frames", 0.0)

    @property
    def train_loss(self) -> float:
        return self.loss_sum / self.loss_frames if self.loss_frames else math.inf


@dataclass
class TrainSummary:
    steps: int = 0
    epochs: list[dict[str, Any]] = field(default_factory=list)
    fingerprints: dict[str, int] = field(default_factory=dict)
    final_loss: float = float("nan")
    unfired_faults: list[str] = field(default_factory=list)  # --inject-fault specs that never fired here
    preempted: bool = False  # stopped by a preemption signal after a checkpoint (exit 17)
    model_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # not in the JSON

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "model_state"}


@dataclass
class Run:
    """Everything one training run holds."""

    cfg: TrainConfig
    ctx: DistContext
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    averager: Any
    stepper: ResilientStep
    data: TrainData
    quarantine: Quarantine
    tb: TensorBoardLogger
    watchdog: StallWatchdog
    step: int = 0
    epoch: int = 1
    best_train: float = math.inf
    best_valid: float = math.inf
    scale_warned: bool = False
    steps_per_epoch: int = 0  # learnt from the first full epoch, for the ETA
    resumed: bool = False
    preemption: Preemption = field(default_factory=lambda: Preemption(0.0))
    compiler: TrainingCompiler | None = None  # --compile


def train(cfg: TrainConfig) -> TrainSummary:
    configure_allocator()  # before CUDA initialises
    ctx = init_distributed(cfg.device, cfg.collective_timeout)
    cfg.exp_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(cfg.exp_dir / "log", ctx.rank, ctx.world_size)
    # The recovery path's buffers, first: after an OOM nothing else may be allocatable.
    ctx.channel = control_channel(ctx)
    faults = fault_injector(cfg, ctx)
    if cfg.count_allocations:
        faults.count_allocations()
    faults.start()
    # Before set-up: a signal while the model loads must not kill the process either.
    preemption = Preemption(cfg.preempt_grace_s, ctx.rank)
    preemption.install()
    try:
        with faults.phase_scope("startup"):
            run = build_run_agreed(cfg, ctx, faults)
        run.preemption = preemption
        run.stepper.stop_requested = preemption.requested
        try:
            summary = train_epochs(run)
        finally:
            run.watchdog.close()
            if run.compiler is not None:
                run.compiler.close()
            run.tb.close()
            run.stepper.sync.close()
    finally:
        preemption.uninstall()
        faults.stop()
        unfired = faults.warn_unfired()  # on every exit: a fault that did nothing is said
        if cfg.count_allocations:
            write_census(Path(cfg.count_allocations), faults, ctx.rank)
    summary.unfired_faults = unfired
    return summary


def control_channel(ctx: DistContext) -> ControlChannel:
    """The step's vote buffers, with a slot per rank for the set-up vote."""
    return ControlChannel(ctx, vote_slots=VOTE_SLOTS + ctx.world_size)


def fault_injector(cfg: TrainConfig, ctx: DistContext) -> FaultInjector:
    return FaultInjector(cfg.inject_fault, ctx.rank, real=cfg.inject_fault_real,
                         stall_seconds=cfg.stall_seconds)


class StartupError(RuntimeError):
    """Set-up failed on some rank; every rank stops together instead of waiting."""


class SetupOutcome(IntEnum):
    """What a rank says in the set-up vote (its slot of the vote vector)."""

    OK = 0
    ERROR = 1
    OUT_OF_MEMORY = 2


def build_run_agreed(cfg: TrainConfig, ctx: DistContext, faults: FaultInjector) -> Run:
    """build_run, then one vote: if set-up failed on any rank (out of memory building the
    model or its state, a missing file, ...), every rank stops at once with the reason,
    rather than the healthy ones waiting for a peer until the collective timeout."""
    from valle.train.resilience.memory import is_oom_error

    run, error = None, None
    try:
        run = build_run(cfg, ctx, faults)
    except Exception as exc:  # noqa: BLE001 - voted, then re-raised on this rank
        error = exc
    outcome = SetupOutcome.OK if error is None else (
        SetupOutcome.OUT_OF_MEMORY if is_oom_error(error) else SetupOutcome.ERROR)
    host = [float(SetupOutcome.OK)] * ctx.world_size
    host[ctx.rank] = float(outcome)
    votes = [SetupOutcome(round(v)) for v in ctx.channel.reduce(host)]
    if error is not None:
        if is_oom_error(error):
            raise StartupError(f"rank {ctx.rank}: out of memory while setting up (model, "
                               f"optimizer state, data): {str(error).splitlines()[0]}. Lower "
                               "the model size or free the device.") from error
        raise error
    failed = [r for r, v in enumerate(votes) if v != SetupOutcome.OK]
    if failed:
        what = "out of memory" if SetupOutcome.OUT_OF_MEMORY in votes else "an error"
        raise StartupError(f"set-up failed on rank(s) {failed} ({what}; see their log): "
                           "every rank stops")
    return run


def train_epochs(run: Run) -> TrainSummary:
    cfg, summary = run.cfg, TrainSummary()
    if cfg.oom_check and not run.resumed:
        scan_pessimistic_batches(run.stepper, run.data.pessimistic_batches(), cfg)
    elif cfg.oom_check:
        # The run passed the scan when it started; under --max-restarts every relaunch
        # would otherwise pay a full pass over the manifest again.
        logger.info("pessimistic scan skipped: resuming a run that already passed it")
    meter = ThroughputMeter()
    totals = MetricsTracker()
    stopping = False  # a preemption was voted: save at this step boundary and return
    for epoch in range(run.epoch, cfg.num_epochs + 1):
        run.epoch = epoch
        account = EpochAccount()
        with run.stepper.faults.host_work():
            batches = run.data.train_batches(epoch)
        while True:
            with run.stepper.faults.host_work():  # data loading: host memory
                batch = draw(batches, cfg.accumulate_grad_steps)
            run.scheduler.step_batch(run.step)
            with run.watchdog.step(run.step):
                result = run.stepper.run(run.step, batch, initial_split=cfg.accumulate_grad_steps)
            account.add(result)
            stopping = stopping or result.stop_requested
            if stopping:
                run.preemption.note_vote()
            if result.all_done:
                break
            run.step += 1
            account.steps += 1
            meter.step()
            totals.update(step_metrics(result))
            log_trained_cuts(run, result)
            if stopping:
                break  # every rank: the same vote said so
            if run.step % cfg.log_interval == 0:
                log_progress(run, totals, meter)
                summary.final_loss = totals.normalized().get("loss", float("nan"))
                totals = MetricsTracker()
                if grad_scale_just_collapsed(run):
                    save(run, f"checkpoint-{run.step}.pt")  # keep what we have before NaNs
            if run.step % cfg.valid_interval == 0:
                valid_loss = validate(run)
                if valid_loss is not None and valid_loss < run.best_valid:  # same on every rank
                    run.best_valid = valid_loss
                    save_best_model(run, "valid")
            if cfg.check_consistency_every and run.step % cfg.check_consistency_every == 0:
                run.stepper.check_consistency()
            if run.step % cfg.save_every_n == 0:
                save(run, f"checkpoint-{run.step}.pt")
            if cfg.max_steps and run.step >= cfg.max_steps:
                break
        if stopping and not result.all_done:
            return preempted(run, summary, account)
        run.scheduler.step_epoch(epoch)
        run.steps_per_epoch = run.steps_per_epoch or account.steps
        summary.epochs.append(close_epoch(run, epoch, account))
        run.stepper.flush()  # a damaged rank is repaired before anything is saved
        if account.train_loss < run.best_train:  # the same value on every rank (from the votes)
            run.best_train = account.train_loss
            save_best_model(run, "train")
        if cfg.max_steps and run.step >= cfg.max_steps:
            break
        save(run, f"epoch-{epoch}.pt", next_epoch=True)
        if stopping:  # the epoch's own checkpoint is the one to resume from
            return preempted(run, summary, account=None)
    run.stepper.flush()
    logger.info("done: %d steps, last logged loss %.4f; checkpoints, logs and TensorBoard in %s%s",
                run.step, summary.final_loss, run.cfg.exp_dir, compile_note(run.compiler))
    summary.steps = run.step
    run.stepper.local("summary", lambda: summary.fingerprints.update(run.stepper.fingerprints()))
    summary.model_state = run.model.state_dict()
    write_json(run.cfg.exp_dir / f"summary-rank{run.ctx.rank}.json", summary.to_json())
    return summary


def preempted(run: Run, summary: TrainSummary, account: EpochAccount | None) -> TrainSummary:
    """Stop at this step boundary: one checkpoint (unless the epoch's was just written),
    then the caller exits with EXIT_PREEMPTED. The epoch is not closed: its summary is
    written by the resumed run, which continues it from the sampler's position."""
    if account is not None:
        save(run, f"checkpoint-{run.step}.pt")
    logger.warning("preempted: stopped after step %d with a checkpoint; run the same command "
                   "to resume (exit code %d)", run.step, EXIT_PREEMPTED)
    summary.steps, summary.preempted = run.step, True
    summary.model_state = run.model.state_dict()
    return summary


def draw(batches: Iterator[Batch], accumulate: int) -> Batch | None:
    """The next optimizer step's data: `accumulate` batches joined (None when dry)."""
    drawn = [b for b in (next(batches, None) for _ in range(accumulate)) if b is not None]
    return concat_batches(drawn) if drawn else None


# -- construction -------------------------------------------------------------


def build_run(cfg: TrainConfig, ctx: DistContext, faults: FaultInjector | None = None) -> Run:
    from valle.models import get_model

    if ctx.channel is None:  # callers other than train() (GPU checks, benchmarks)
        ctx.channel = control_channel(ctx)
    if faults is None:
        faults = fault_injector(cfg, ctx)

    torch.manual_seed(cfg.seed)
    payload = find_resume_payload(cfg)
    architecture, initial_weights = payload, None
    if payload is None and cfg.start_from:
        from valle.models.convert import load_model_checkpoint

        # the architecture of the weights we start from, whatever the flags say
        initial_weights, hparams = load_model_checkpoint(cfg.start_from)
        architecture = {"config": hparams, "model": {}}
    model = get_model(model_hparams(cfg, architecture)).to(ctx.device)
    named = model.stage_parameters(cfg.train_stage)
    optimizer = build_optimizer(cfg.optimizer_name, named, cfg.base_lr, weight_decay=cfg.weight_decay)
    scheduler = build_scheduler(cfg.scheduler_name, optimizer, cfg.warmup_steps,
                                total_steps=cfg.max_steps or None, lr_batches=cfg.lr_batches,
                                lr_epochs=cfg.lr_epochs,
                                model_dim=getattr(model, "hparams", {}).get("decoder_dim"))
    scaler = torch.amp.GradScaler(ctx.device.type, init_scale=cfg.grad_scale_init,
                                  enabled=cfg.dtype == "float16")
    averager = None
    if cfg.average_period > 0:
        from valle.train.averaging import ModelAverager

        averager = ModelAverager(named, cfg.average_period)
    sync = build_grad_sync(cfg.grad_sync, model, [p for _, p in named], world_size=ctx.world_size,
                           device=ctx.device, group=ctx.group, bucket_cap_mb=cfg.bucket_cap_mb)
    quarantine = Quarantine(cfg.exp_dir / "quarantine.jsonl")
    if cfg.oom_snapshot and ctx.device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100000)
    stepper = ResilientStep(
        model, optimizer, sync, ctx,
        StepConfig(train_stage=cfg.train_stage, dtype=cfg.dtype, seed=cfg.seed,
                   grad_clip=cfg.grad_clip if cfg.optimizer_name != "ScaledAdam" else 0.0,
                   backward_reserve_mb=backward_reserve_mb(cfg, ctx),
                   update_retries=cfg.update_retries, max_quarantined=cfg.max_quarantined_cuts,
                   max_fitted_before=cfg.max_fitted_before_quarantines),
        scaler=scaler, averager=averager, faults=faults,
        reporter=OomReporter(cfg.exp_dir, ctx.rank, cfg.save_oom_batches, cfg.oom_snapshot),
        quarantine=quarantine, channel=ctx.channel,
    )
    # The model's head (a resumed checkpoint's, whatever the flag) must fit the corpus's codebook 0.
    data = build_train_data(cfg, ctx, ar_codebook_size=model.ar_codebook_size)
    run = Run(cfg, ctx, model, optimizer, scheduler, scaler, averager, stepper, data, quarantine,
              TensorBoardLogger(cfg.exp_dir / "tensorboard" / f"stage{cfg.train_stage}", enabled=cfg.tensorboard and ctx.is_main),
              StallWatchdog(cfg.stall_factor, cfg.stall_min_seconds,
                            cfg.exp_dir / "log" / f"stall-rank{ctx.rank}.txt", ctx.rank))
    if payload is not None:
        # A new stage has a new memory profile: only a same-stage resume skips the scan.
        run.resumed = not restore(run, payload)
    elif initial_weights is not None:
        start_from(run, initial_weights)
    if cfg.compile:
        injector = bool(cfg.count_allocations) or any(s.phase == "alloc" for s in cfg.inject_fault)
        run.compiler = attach_compiler(stepper, run.watchdog, cfg.compile_pad, cfg.compile_backend,
                                       allocation_injector=injector)
    # After restore: state created from the weights training starts from.
    stepper.materialize_state()
    logger.info("model: %.2f M parameters, %.2f M trained in stage %d; grad sync %s; %d rank(s) on %s",
                sum(p.numel() for p in model.parameters()) / 1e6,
                sum(p.numel() for _, p in named) / 1e6, cfg.train_stage, cfg.grad_sync,
                ctx.world_size, ctx.device)
    return run


def model_hparams(cfg: TrainConfig, payload: dict | None):
    """Model hyper-parameters: the flags, or a checkpoint's when resuming (old
    checkpoints included: keys they predate take the values they were trained with)."""
    import argparse

    from valle.models import add_model_arguments
    from valle.models.convert import ours_hparams

    defaults = argparse.ArgumentParser(add_help=False)
    add_model_arguments(defaults)
    values = {**vars(defaults.parse_args([])), **cfg.args}
    if payload is not None:
        # Resuming: the architecture is the checkpoint's, whatever the flags say.
        values.update(ours_hparams(payload.get("config", {}), payload["model"]))
    return argparse.Namespace(**values)


def start_from(run: Run, state: dict[str, torch.Tensor]) -> None:
    """--start-from: initial weights from a checkpoint (ours or lifeiteng/vall-e's, already
    converted); the architecture came from it too; optimizer, schedule and data start afresh."""
    run.model.load_state_dict(state, strict=True)
    logger.info("initial weights from %s", run.cfg.start_from)


def backward_reserve_mb(cfg: TrainConfig, ctx: DistContext) -> int:
    if cfg.backward_reserve_mb >= 0:
        return cfg.backward_reserve_mb
    return 1024 if ctx.device.type == "cuda" and cfg.trains_nar else 0


# -- resume and save ------------------------------------------------------------


def find_resume_payload(cfg: TrainConfig) -> dict | None:
    if cfg.start_batch > 0:
        return load_checkpoint(cfg.exp_dir / f"checkpoint-{cfg.start_batch}.pt")
    if cfg.start_epoch > 1:
        return load_checkpoint(cfg.exp_dir / f"epoch-{cfg.start_epoch - 1}.pt")
    # A stage-2 run in the AR run's directory continues its own checkpoints once it
    # has some, and starts from the newest AR one (a stage switch) before that.
    found = find_latest_checkpoint(cfg.exp_dir, prefer_stage=cfg.train_stage)
    if found is None:
        return None
    path, payload = found
    logger.info("resuming from %s (step %d, epoch %d)", path, payload["step"], payload["epoch"])
    return payload


def restore(run: Run, payload: dict) -> list[str]:
    """Load a checkpoint into the run; returns what a stage switch dropped."""
    payload, dropped = apply_stage_switch(payload, run.cfg.train_stage)
    if dropped:
        logger.warning("checkpoint was trained in another stage: dropped %s; keeping the weights",
                       ", ".join(dropped))
    missing, unexpected = run.model.load_state_dict(payload["model"], strict=False)
    if missing or unexpected:
        logger.warning("checkpoint weights: %d missing, %d unexpected keys", len(missing), len(unexpected))
    if run.averager is not None and payload.get("model_avg") is not None:
        run.averager.load_from_model_state_dict(payload["model_avg"], strict=False)
    if payload.get("optimizer") is not None:
        run.optimizer.load_state_dict(payload["optimizer"])
    if payload.get("scheduler") is not None:
        run.scheduler.load_state_dict(payload["scheduler"])
    if payload.get("scaler") is not None and run.scaler is not None:
        run.scaler.load_state_dict(payload["scaler"])
    if payload.get("sampler") is not None:
        run.data.load_state_dict(payload["sampler"], run.ctx)
    run.quarantine.merge(payload.get("quarantine") or [])
    run.step, run.epoch = payload["step"], payload["epoch"]
    return dropped


def save(run: Run, name: str, next_epoch: bool = False) -> None:
    """Checkpoint on rank 0 (every rank's sampler position included).

    The collectives (repair, sampler positions) go through the control channel; the
    write itself is rank 0's local work: an OOM there (the averaged model's copy) frees
    memory and retries once, and if it still fails the run goes on without this file
    (said in the log) - the other ranks' path is the same either way."""
    run.stepper.flush()  # repair damaged state first: what we save is what every rank holds
    with run.stepper.faults.phase_scope("checkpoint"):
        sampler = run.data.state_dict(run.ctx, next_epoch=next_epoch)
    if not run.ctx.is_main:
        return

    def write() -> None:
        scaler = active_scaler(run)
        payload = make_payload(
            model=run.model.state_dict(),
            model_avg=averaged_state(run),
            optimizer=run.optimizer.state_dict(), scheduler=run.scheduler.state_dict(),
            scaler=scaler.state_dict() if scaler is not None else None,
            sampler=sampler, step=run.step,
            epoch=run.epoch + 1 if next_epoch else run.epoch,
            batch_in_epoch=0 if next_epoch else sampler.get("batch_in_epoch", 0),
            train_stage=run.cfg.train_stage, config=run.cfg.args, quarantine=run.quarantine.state(),
        )
        logger.info("saved %s", save_checkpoint(run.cfg.exp_dir / name, payload))

    if run.stepper.local("checkpoint", write) and name.startswith("checkpoint-"):
        remove_old_checkpoints(run.cfg.exp_dir, run.cfg.keep_last_k)


def averaged_state(run: Run) -> dict[str, torch.Tensor] | None:
    """The averaged model as a full model state dict (None without --average-period)."""
    return run.averager.averaged_state_dict(run.model) if run.averager else None


def save_best_model(run: Run, kind: str) -> None:
    """best-<kind>-loss.pt (kind: train or valid), the weights only: rank 0's local work."""
    if not run.ctx.is_main:
        return
    run.stepper.local("checkpoint", lambda: save_best(run.cfg.exp_dir, kind, make_payload(
        model=run.model.state_dict(), model_avg=averaged_state(run), step=run.step,
        epoch=run.epoch, train_stage=run.cfg.train_stage, config=run.cfg.args)))


# -- validation -------------------------------------------------------------------


def validate(run: Run) -> float | None:
    """The validation loss, logged and in TensorBoard (None if a preemption signal cut it
    short on some rank). Each rank runs its own shard without collectives; one vote at
    the end."""
    with run.stepper.faults.host_work():
        batches = run.preemption.until_requested(run.data.valid_batches())
    result = run.stepper.validate(batches, cut_short=run.preemption.requested)
    values = MetricsTracker({**result.metrics, "loss": result.loss * result.frames,
                             "frames": result.frames}).normalized()
    values["valid_oom_batches"] = result.oom_batches
    logger.info("validation at step %d: loss %.4f over %d batches (%d skipped: out of memory)",
                run.step, result.loss, result.batches, result.oom_batches)
    run.tb.scalars(run.step, values, prefix="valid/")
    if result.cut_short:
        logger.warning("validation at step %d cut short by a preemption signal on %d rank(s): "
                       "not a best-model candidate", run.step, result.cut_short)
        return None
    return result.loss


# -- logging ----------------------------------------------------------------------


def step_metrics(r: StepResult) -> dict[str, float]:
    values = {"loss": 0.0, "frames": 0.0}
    if r.applied:
        values.update(r.metrics)
        # Logged loss is per *predicted* frame (AR + NAR), comparable across stages.
        values.update(loss=r.loss, frames=r.metrics["ar_frames"] + r.metrics["nar_frames"])
    values.update(oom_events=r.ooms, retries=r.attempts - 1, quarantined=len(r.cuts_quarantined),
                  skipped_steps=int(r.skipped_nonfinite), repairs=r.repairs)
    return values


def active_scaler(run: Run) -> torch.amp.GradScaler | None:
    """The GradScaler when it scales (--dtype float16), else None."""
    return run.scaler if run.scaler is not None and run.scaler.is_enabled() else None


def grad_scale(run: Run) -> float | None:
    """The GradScaler's current loss scale (None without one: no --dtype float16)."""
    scaler = active_scaler(run)
    return scaler.get_scale() if scaler is not None else None


def grad_scale_just_collapsed(run: Run) -> bool:
    """True the first time the fp16 loss scale is found collapsed, with a warning.

    A collapsed scale means an overflow at every step: the caller keeps what it has (a
    checkpoint) and the user is told, rather than training dying with NaNs later."""
    scale = grad_scale(run)
    if scale is None or scale >= GRAD_SCALE_COLLAPSED or run.scale_warned:
        return False
    run.scale_warned = True
    logger.warning("grad scale collapsed to %.3g at step %d: saving a checkpoint; consider "
                   "--dtype bfloat16 or a lower --base-lr", scale, run.step)
    return True


def log_progress(run: Run, totals: MetricsTracker, meter: ThroughputMeter) -> None:
    """The progress line and the train/ TensorBoard scalars of the last --log-interval steps."""
    values = totals.normalized()
    lr = run.scheduler.get_last_lr()[0]
    scale = grad_scale(run)
    with run.stepper.faults.host_work():  # the sampler's length: host work
        hint = run.data.steps_hint(run.cfg.num_epochs)
    total = run.cfg.max_steps or hint or (
        run.steps_per_epoch * run.cfg.num_epochs if run.steps_per_epoch else 0)
    eta = meter.eta(run.step, total) if total else "? (known after the first epoch)"
    memory = torch.cuda.max_memory_allocated(run.ctx.device) / 2**20 if run.ctx.device.type == "cuda" else 0.0
    parts = [f"loss {values.get('loss', math.nan):.4f}"]
    for head in ("ar", "nar"):  # only the heads trained in this stage
        if values.get(f"{head}_frames", 0) > 0:
            parts.append(f"{head} {values[head + '_loss']:.4f} top10 {values[head + '_top10_acc']:.3f}")
    logger.info(
        "epoch %d step %d | %s | lr %.2e | %s | ETA %s | ooms %d retries %d quarantined %d "
        "skipped %d%s%s",
        run.epoch, run.step, " | ".join(parts), lr, meter, eta, int(values.get("oom_events", 0)),
        int(values.get("retries", 0)), int(values.get("quarantined", 0)),
        int(values.get("skipped_steps", 0)), f" | grad scale {scale:.3g}" if scale else "",
        compile_note(run.compiler),
    )
    run.tb.scalars(run.step, {**values, "lr": lr, "grad_scale": scale, "it_per_s": meter.rate,
                              "step_time_s": 1.0 / meter.rate if meter.rate else None,
                              "max_memory_mib": memory}, prefix="train/")


def log_trained_cuts(run: Run, result: StepResult) -> None:
    if not run.cfg.log_trained_cuts:
        return
    with open(run.cfg.exp_dir / f"trained-cuts-rank{run.ctx.rank}.tsv", "a") as f:
        f.write(f"{result.step}\t{','.join(result.cuts_trained)}\n")


def close_epoch(run: Run, epoch: int, account: EpochAccount) -> dict[str, Any]:
    """Per-epoch summary across ranks: cuts drawn = trained + quarantined + skipped."""
    with run.stepper.faults.phase_scope("epoch_end"):
        counts = run.stepper.reduce_counts([account.drawn, account.trained, len(account.quarantined),
                                            len(account.skipped), account.ooms])
    drawn, trained, quarantined, skipped, ooms = (int(x) for x in counts)
    retries = account.retries  # every rank retries together: the local count is the global one
    record = {"epoch": epoch, "steps": account.steps, "cuts_drawn": drawn, "cuts_trained": trained,
              "cuts_quarantined": quarantined, "cuts_skipped": skipped, "oom_events": ooms,
              "retries": retries, "train_loss": account.train_loss,
              "quarantined_ids": account.quarantined,
              "skipped_ids": account.skipped, "balanced": drawn == trained + quarantined + skipped}
    logger.info("epoch %d summary: %d steps; cuts drawn %d = trained %d + quarantined %d + skipped %d "
                "%s; %d OOM events, %d retries", epoch, account.steps, drawn, trained, quarantined,
                skipped, "(balanced)" if record["balanced"] else "(UNBALANCED)", ooms, retries)
    run.tb.scalars(epoch, {"cuts_drawn": drawn, "cuts_trained": trained,
                           "cuts_quarantined": quarantined}, prefix="epoch/")
    write_json(run.cfg.exp_dir / f"epoch-{epoch}-summary-rank{run.ctx.rank}.json", record)
    return record


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))


def write_census(path: Path, faults: FaultInjector, rank: int) -> None:
    """The allocation census of the sweep's dry run: per step, every (phase, op) in order."""
    census = {str(step): [list(entry) for entry in entries]
              for step, entries in (faults.census or {}).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{path}.rank{rank}").write_text(json.dumps(census))


# Exit codes of failures the trainer cannot repair in place (docs/training.md).
# Kept clear of argparse's 2 and Python's 1 so torchrun's report says what happened.
EXIT_CODES = {
    "NoHealthyRankError": 10,
    "DdpBackwardOomError": 11,
    "ConsistencyError": 12,
    "BatchTooLargeError": 13,
    "PeerFailure": 14,
    "OomNotDataError": 15,
    "StartupError": 16,
    # not failures: a preemption signal (valle/train/preemption.py)
    "Preempted": EXIT_PREEMPTED,
    "PreemptGraceExpired": EXIT_PREEMPT_TIMEOUT,
}
_PEER_FAILURE_MARKERS = ("Timed out", "timed out", "Connection reset", "Connection closed",
                         "pair closure", "NCCL communicator was aborted")


def main_from_config(cfg: TrainConfig) -> int:
    """Run and map unrecoverable failures to exit codes with one clear message."""
    from valle.models.convert import CheckpointError
    from valle.train.resilience.step import (
        ConsistencyError,
        DdpBackwardOomError,
        NoHealthyRankError,
    )

    try:
        summary = train(cfg)
    except (NoHealthyRankError, DdpBackwardOomError, ConsistencyError, BatchTooLargeError,
            OomNotDataError, StartupError) as e:
        logger.error("%s", e)
        return EXIT_CODES[type(e).__name__]
    except (FileNotFoundError, CorruptCheckpointError, CheckpointError) as e:
        # A checkpoint or manifest named by a flag (--start-batch, --start-epoch,
        # --manifest-dir, --text-tokens) that is not there: a usage error.
        logger.error("%s", e)
        return 2
    except (dist.DistError, RuntimeError) as e:
        if not any(m in str(e) for m in _PEER_FAILURE_MARKERS):
            raise
        logger.error("a peer rank failed or hung (collective timeout %.0f s): %s. Under torchrun "
                     "--max-restarts every worker restarts from the newest checkpoint.",
                     cfg.collective_timeout, str(e).splitlines()[0])
        return EXIT_CODES["PeerFailure"]
    shutdown()  # success only: after a peer failure destroying the group can block
    return EXIT_PREEMPTED if summary.preempted else 0


__all__ = ["train", "TrainSummary", "main_from_config", "Run", "EpochAccount", "EXIT_CODES"]

"""The training loop: epochs of resilient steps, validation, logging, checkpoints.

It reads top to bottom: set up, resume, scan, then for every step draw a batch
and hand it to `ResilientStep.run`. Building the run and resuming it live in
valle.train.build, writing checkpoints in valle.train.saving. Everything that can fail in a step lives
in valle.train.resilience.step; this file holds no OOM handling of its own.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from valle.train.batching import Batch, concat_batches
from valle.train.build import (
    Run,
    StartupError,
    active_scaler,
    build_run_agreed,
    control_channel,
    fault_injector,
)
from valle.train.checkpoint import (
    CorruptCheckpointError,
)
from valle.train.compile import compile_note
from valle.train.config import TrainConfig
from valle.train.dist import init_distributed, shutdown
from valle.train.metrics import MetricsTracker, ThroughputMeter, setup_logging
from valle.train.preemption import EXIT_PREEMPTED, EXIT_PREEMPTED_NO_CHECKPOINT, Preemption
from valle.train.resilience.faults import FaultInjector
from valle.train.resilience.memory import configure_allocator
from valle.train.resilience.quarantine import OomNotDataError
from valle.train.resilience.scan import BatchTooLargeError, scan_pessimistic_batches
from valle.train.resilience.step import StepResult
from valle.train.samples import write_samples
from valle.train.saving import save, save_best_model
from valle.train.storage import EXIT_UNSAVED, UnsavedStateError

logger = logging.getLogger(__name__)

GRAD_SCALE_COLLAPSED = 1e-4


@dataclass
class EpochAccount:
    """Nothing lost: drawn = trained + quarantined + skipped, per rank and epoch."""

    drawn: int = 0
    trained: int = 0
    quarantined: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # non-finite loss, unreadable, epoch end
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

    def add_unreadable(self, entries: list[dict[str, str]]) -> None:
        """Cuts drawn whose codes could not be read: drawn, and skipped."""
        self.drawn += len(entries)
        self.skipped += [e["cut_id"] for e in entries]

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
    preempted: bool = False  # stopped by a preemption signal (exit 17, or 18 without checkpoint)
    preempt_checkpoint: bool = False  # ... and its checkpoint was written
    # memory (docs/oom.md): the batch budget used, the memory budget, the training peak
    max_duration: float | None = None
    max_text_tokens: int | None = None
    synthetic_batch_size: int | None = None
    memory_budget_bytes: int = 0
    peak_memory_bytes: int = 0  # max over training steps (0: not measured, CPU without a budget)
    oom_events: int = 0  # every epoch's, all ranks
    model_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # not in the JSON

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "model_state"}


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
    ignore_file_size_signal()
    try:
        with faults.phases.phase_scope("startup"):
            run = build_run_agreed(cfg, ctx, faults)
        run.preemption = preemption
        try:
            summary = train_epochs(run)
        finally:
            run.meter.stop()
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


def ignore_file_size_signal() -> None:
    """A file size limit (ulimit -f, RLIMIT_FSIZE) then fails a checkpoint write with
    EFBIG, which save() reports and survives, instead of SIGXFSZ killing the process."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def train_epochs(run: Run) -> TrainSummary:
    cfg, summary = run.cfg, TrainSummary()
    if cfg.oom_check and not run.resumed:
        scan_pessimistic_batches(run.stepper, run.data.pessimistic_batches(), cfg)
    elif cfg.oom_check:
        # The run passed the scan when it started; under --max-restarts every relaunch
        # would otherwise pay a full pass over the manifest again.
        logger.info("pessimistic scan skipped: resuming a run that already passed it")
    run.meter.reset_peak()  # the training peak, not the scan's
    meter = ThroughputMeter()
    totals = MetricsTracker()
    stopping = False  # a preemption was voted: save at this step boundary and return
    for epoch in range(run.epoch, cfg.num_epochs + 1):
        run.epoch = epoch
        account = EpochAccount()
        with run.stepper.phases.host_work():
            batches = run.data.train_batches(epoch)
        while True:
            with run.stepper.phases.host_work():  # data loading: host memory
                batch = draw(batches, cfg.accumulate_grad_steps)
                unreadable = run.data.take_unreadable()
                note_unreadable(run, account, unreadable)
            run.scheduler.step_batch(run.step)
            with run.watchdog.step(run.step):
                result = run.stepper.run(run.step, batch, initial_split=cfg.accumulate_grad_steps,
                                         stop_requested=run.preemption.requested,
                                         unreadable=len(unreadable))
            account.add(result)
            check_unreadable(run, result)
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
                write_samples(run)  # rank 0's held-out syntheses to TensorBoard (local work)
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
            return preempted(run, summary, save(run, f"checkpoint-{run.step}.pt"))
        run.scheduler.step_epoch(epoch)
        run.steps_per_epoch = run.steps_per_epoch or account.steps
        summary.epochs.append(close_epoch(run, epoch, account))
        run.stepper.flush()  # a damaged rank is repaired before anything is saved
        if account.train_loss < run.best_train:  # the same value on every rank (from the votes)
            run.best_train = account.train_loss
            save_best_model(run, "train")
        if cfg.max_steps and run.step >= cfg.max_steps:
            break
        saved = save(run, f"epoch-{epoch}.pt", next_epoch=True)
        if stopping:  # the epoch's own checkpoint is the one to resume from
            return preempted(run, summary, saved)
    run.stepper.flush()
    run.storage.check_final()  # every rank: the count of failed saves is agreed
    logger.info("done: %d steps, last logged loss %.4f; checkpoints, logs and TensorBoard in %s%s",
                run.step, summary.final_loss, run.cfg.exp_dir, compile_note(run.compiler))
    summary.steps = run.step
    record_memory(run, summary)
    run.meter.stop()  # the budget binds training; what follows is bookkeeping
    run.stepper.local("summary", lambda: summary.fingerprints.update(run.stepper.fingerprints()))
    summary.model_state = run.model.state_dict()
    write_json(run, run.cfg.exp_dir / f"summary-rank{run.ctx.rank}.json", summary.to_json())
    return summary


def training_peak(run: Run) -> int:
    """Peak bytes since training began: CUDA's allocator, or the CPU meter when it runs
    (--memory-budget-gb); 0 when nothing measured it."""
    return run.meter.peak_bytes() if run.meter.running else 0


def record_memory(run: Run, summary: TrainSummary) -> None:
    """The summary's memory facts: the batch budget used, the memory budget, the peak."""
    cfg = run.cfg
    summary.max_duration = None if cfg.synthetic_data else cfg.data.max_duration
    summary.max_text_tokens = None if cfg.synthetic_data else cfg.data.max_text_tokens
    summary.synthetic_batch_size = cfg.synthetic_batch_size if cfg.synthetic_data else None
    summary.memory_budget_bytes = int(run.meter.budget_bytes)
    summary.peak_memory_bytes = int(training_peak(run))
    summary.oom_events = sum(int(e.get("oom_events", 0)) for e in summary.epochs)


def preempted(run: Run, summary: TrainSummary, saved: bool) -> TrainSummary:
    """Stop at this step boundary, after its checkpoint (`saved`: written on rank 0, as
    every rank agreed); the caller exits with EXIT_PREEMPTED, or EXIT_PREEMPTED_NO_CHECKPOINT
    if the write failed. The epoch is not closed: the resumed run continues it from the
    sampler's position and writes its summary."""
    if saved:
        logger.warning("preempted: stopped after step %d with a checkpoint; run the same "
                       "command to resume (exit code %d)", run.step, EXIT_PREEMPTED)
    else:
        logger.error("preempted: stopped after step %d but its checkpoint could not be written; "
                     "the same command resumes from the newest good checkpoint (exit code %d)",
                     run.step, EXIT_PREEMPTED_NO_CHECKPOINT)
    summary.steps, summary.preempted, summary.preempt_checkpoint = run.step, True, saved
    summary.model_state = run.model.state_dict()
    return summary


class UnreadableDataError(RuntimeError):
    """More cuts than --max-unreadable-cuts could not be read: the storage, not one file."""


def note_unreadable(run: Run, account: EpochAccount, entries: list[dict[str, str]]) -> None:
    """Report each unreadable cut (id, file, error), log it to unreadable-rank<R>.jsonl,
    count it as drawn and skipped; the step's vote tells every rank how many there were."""
    if not entries:
        return
    account.add_unreadable(entries)
    for entry in entries:
        logger.warning("cut %s skipped: its codes cannot be read from %s (%s)",
                       entry["cut_id"], entry["file"] or "?", entry["error"])
    append_lines(run, run.cfg.exp_dir / f"unreadable-rank{run.ctx.rank}.jsonl",
                 [json.dumps({"step": run.step, **entry}) for entry in entries])


def check_unreadable(run: Run, result: StepResult) -> None:
    """Stop every rank at the same step once the run's unreadable cuts (summed by the
    votes, so equal on every rank) pass --max-unreadable-cuts: training on whatever
    fraction of a failing store still reads is not what the user asked for."""
    run.unreadable_total += result.unreadable
    if run.unreadable_total > run.cfg.max_unreadable_cuts:
        raise UnreadableDataError(
            f"{run.unreadable_total} cuts could not be read so far (more than "
            f"--max-unreadable-cuts {run.cfg.max_unreadable_cuts}): the storage is failing, not "
            f"one file. Each is listed with its file and error in {run.cfg.exp_dir}/"
            "unreadable-rank*.jsonl; fix or restore the data and run the same command to resume.")


def draw(batches: Iterator[Batch], accumulate: int) -> Batch | None:
    """The next optimizer step's data: `accumulate` batches joined (None when dry)."""
    drawn = [b for b in (next(batches, None) for _ in range(accumulate)) if b is not None]
    return concat_batches(drawn) if drawn else None


# -- validation -------------------------------------------------------------------


def validate(run: Run) -> float | None:
    """The validation loss, logged and in TensorBoard (None if a preemption signal cut it
    short on some rank). Each rank runs its own shard without collectives; one vote at
    the end."""
    with run.stepper.phases.host_work():
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
    with run.stepper.phases.host_work():  # the sampler's length: host work
        hint = run.data.steps_hint(run.cfg.num_epochs)
    total = run.cfg.max_steps or hint or (
        run.steps_per_epoch * run.cfg.num_epochs if run.steps_per_epoch else 0)
    eta = meter.eta(run.step, total) if total else "? (known after the first epoch)"
    peak = training_peak(run)
    memory = peak / 2**20
    budget = run.meter.budget_bytes
    fraction = peak / budget if peak and budget else None
    parts = [f"loss {values.get('loss', math.nan):.4f}"]
    for head in ("ar", "nar"):  # only the heads trained in this stage
        if values.get(f"{head}_frames", 0) > 0:
            parts.append(f"{head} {values[head + '_loss']:.4f} top10 {values[head + '_top10_acc']:.3f}")
    logger.info(
        "epoch %d step %d | %s | lr %.2e | %s | ETA %s | ooms %d retries %d quarantined %d "
        "skipped %d%s%s%s",
        run.epoch, run.step, " | ".join(parts), lr, meter, eta, int(values.get("oom_events", 0)),
        int(values.get("retries", 0)), int(values.get("quarantined", 0)),
        int(values.get("skipped_steps", 0)), f" | grad scale {scale:.3g}" if scale else "",
        f" | peak memory {fraction:.0%} of budget" if fraction else "",
        compile_note(run.compiler),
    )
    run.tb.scalars(run.step, {**values, "lr": lr, "grad_scale": scale, "it_per_s": meter.rate,
                              "step_time_s": 1.0 / meter.rate if meter.rate else None,
                              "max_memory_mib": memory, "memory_fraction": fraction},
                   prefix="train/")


def log_trained_cuts(run: Run, result: StepResult) -> None:
    if not run.cfg.log_trained_cuts:
        return
    append_lines(run, run.cfg.exp_dir / f"trained-cuts-rank{run.ctx.rank}.tsv",
                 [f"{result.step}\t{','.join(result.cuts_trained)}"])


def append_lines(run: Run, path: Path, lines: list[str]) -> None:
    """Append to one of the run's cut lists (storage policy: a failed write is said)."""
    def append() -> None:
        with open(path, "a") as f:
            f.write("".join(line + "\n" for line in lines))

    run.storage.write("report", path, append)


def close_epoch(run: Run, epoch: int, account: EpochAccount) -> dict[str, Any]:
    """Per-epoch summary across ranks: cuts drawn = trained + quarantined + skipped."""
    with run.stepper.phases.phase_scope("epoch_end"):
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
    write_json(run, run.cfg.exp_dir / f"epoch-{epoch}-summary-rank{run.ctx.rank}.json", record)
    return record


def write_json(run: Run, path: Path, obj: Any) -> None:
    """A summary file (storage policy: a failed write is said, training goes on)."""
    text = json.dumps(obj, indent=1, default=str)
    run.storage.write("summary", path, lambda: path.write_text(text))


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
    "UnreadableDataError": 19,
    "UnsavedStateError": EXIT_UNSAVED,  # 20: the run's state could not be written
    # not failures: a preemption signal (valle/train/preemption.py)
    "Preempted": EXIT_PREEMPTED,
    "PreemptedNoCheckpoint": EXIT_PREEMPTED_NO_CHECKPOINT,
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
            OomNotDataError, StartupError, UnreadableDataError, UnsavedStateError) as e:
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
    if summary.preempted:
        return EXIT_PREEMPTED if summary.preempt_checkpoint else EXIT_PREEMPTED_NO_CHECKPOINT
    return 0


__all__ = ["train", "TrainSummary", "main_from_config", "Run", "EpochAccount", "EXIT_CODES"]

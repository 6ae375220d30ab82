"""Checkpoints of a run: the periodic and epoch checkpoints (written by rank 0, the
outcome agreed by every rank) and the best models."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from valle.train.build import Run, active_scaler, averaged_state, checkpoint_extras, model_state
from valle.train.checkpoint import (
    make_payload,
    readable_checkpoints,
    remove_old_checkpoints,
    save_best,
    save_checkpoint,
)

logger = logging.getLogger(__name__)


def save(run: Run, name: str, next_epoch: bool = False) -> bool:
    """Checkpoint on rank 0 (every rank's sampler position included); True on every rank
    if it was written.

    The collectives (repair, sampler positions, the outcome) go through the control
    channel; the write itself is rank 0's local work. An OOM there (the averaged model's
    copy) frees memory and retries once; a storage error (disk full, I/O error, read-only
    directory, file size limit) is reported with the path. Either way the run goes on
    without this file - the older checkpoints are untouched, the next save tries again -
    and every rank learns the outcome (a preempted run exits accordingly)."""
    run.stepper.flush()  # repair damaged state first: what we save is what every rank holds
    with run.stepper.phases.phase_scope("checkpoint"):
        sampler = run.data.state_dict(run.ctx, next_epoch=next_epoch)
    path = run.cfg.exp_dir / name
    written = not run.ctx.is_main or write_checkpoint(run, path, sampler, next_epoch)
    with run.stepper.phases.phase_scope("checkpoint"):
        written = run.stepper.reduce_counts([float(not written)])[0] == 0
    # Reading checkpoint headers (torch.load, mmap) is host work, not device memory.
    with run.stepper.phases.host_work():
        if not written:
            newest = next(iter(readable_checkpoints(run.cfg.exp_dir)), None)
            logger.error("checkpoint %s was not written (see rank 0's log); training goes on, "
                         "the next save tries again; the newest good checkpoint is %s", path, newest)
        elif run.ctx.is_main and name.startswith("checkpoint-"):
            remove_old_checkpoints(run.cfg.exp_dir, run.cfg.keep_last_k)
    return written


def write_checkpoint(run: Run, path: Path, sampler: dict, next_epoch: bool) -> bool:
    """Rank 0's write of a checkpoint; False (reported) on an OOM or a storage error."""

    def write() -> None:
        scaler = active_scaler(run)
        payload = make_payload(
            model=model_state(run),
            model_avg=averaged_state(run),
            optimizer=run.optimizer.state_dict(), scheduler=run.scheduler.state_dict(),
            scaler=scaler.state_dict() if scaler is not None else None,
            sampler=sampler, step=run.step,
            epoch=run.epoch + 1 if next_epoch else run.epoch,
            batch_in_epoch=0 if next_epoch else sampler.get("batch_in_epoch", 0),
            train_stage=run.cfg.train_stage, config=run.cfg.checkpoint_config(), quarantine=run.quarantine.state(),
        ) | checkpoint_extras(run)
        run.stepper.faults.maybe_fail_save(path)
        logger.info("saved %s", save_checkpoint(path, payload))

    try:
        return run.stepper.local("checkpoint", write)
    except OSError as exc:
        logger.error("could not write checkpoint %s: %s", path, storage_error(exc))
        return False


def storage_error(exc: OSError) -> str:
    """An OSError as the user needs it: errno name and message, and the file."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{name + ': ' if name else ''}{exc.strerror or exc}{where}"


def save_best_model(run: Run, kind: str) -> None:
    """best-<kind>-loss.pt (kind: train or valid), the weights only: rank 0's local work."""
    if not run.ctx.is_main:
        return
    run.stepper.local("checkpoint", lambda: save_best(run.cfg.exp_dir, kind, make_payload(
        model=model_state(run), model_avg=averaged_state(run), step=run.step,
        epoch=run.epoch, train_stage=run.cfg.train_stage, config=run.cfg.checkpoint_config()
    ) | checkpoint_extras(run)))

"""Checkpoints of a run: the periodic and epoch checkpoints (written by rank 0, the
outcome agreed by every rank) and the best models."""

from __future__ import annotations

import logging
from pathlib import Path

from valle.train.build import Run, active_scaler, averaged_state, checkpoint_extras, model_state
from valle.train.checkpoint import (
    best_path,
    make_payload,
    remove_old_checkpoints,
    save_best,
    save_checkpoint,
)
from valle.train.storage import storage_error

logger = logging.getLogger(__name__)


def save(run: Run, name: str, next_epoch: bool = False) -> bool:
    """Checkpoint on rank 0 (every rank's sampler position included); True on every rank
    if it was written.

    The collectives (repair, sampler positions, the outcome) go through the control
    channel; the write itself is rank 0's local work. An OOM there (the averaged model's
    copy) frees memory and retries once; a storage error (disk full, I/O error, read-only
    directory, file size limit) is said by the storage policy (valle.train.storage) with
    the path. Either way the run goes on without this file - the older checkpoints are
    untouched, the next save tries again - and every rank learns the outcome: a preempted
    run exits accordingly, and --max-failed-saves failures in a row stop every rank here
    with UnsavedStateError."""
    run.stepper.flush()  # repair damaged state first: what we save is what every rank holds
    with run.stepper.phases.phase_scope("checkpoint"):
        sampler = run.data.state_dict(run.ctx, next_epoch=next_epoch)
    path = run.cfg.exp_dir / name
    written = not run.ctx.is_main or write_checkpoint(run, path, sampler, next_epoch)
    with run.stepper.phases.phase_scope("checkpoint"):
        written = run.stepper.reduce_counts([float(not written)])[0] == 0
    # Reading checkpoint headers (torch.load, mmap) is host work, not device memory.
    with run.stepper.phases.host_work():
        # Rank 0 said a storage error with the newest good checkpoint already (not an OOM).
        if not written and run.storage.said != path:
            logger.error("checkpoint %s was not written (see rank 0's log); training goes on, "
                         "the next save tries again; the newest good checkpoint is %s", path,
                         run.storage.newest_good())
        elif written and run.ctx.is_main and name.startswith("checkpoint-"):
            remove_old(run)
    run.storage.note_save(path, written)  # every rank: the same count, the same stop
    return written


def remove_old(run: Run) -> None:
    """--keep-last-k; a file that cannot be deleted (read-only storage) stays, said once."""
    try:
        remove_old_checkpoints(run.cfg.exp_dir, run.cfg.keep_last_k)
    except OSError as exc:
        logger.warning("could not delete old checkpoints in %s (--keep-last-k %d): %s",
                       run.cfg.exp_dir, run.cfg.keep_last_k, storage_error(exc))


def write_checkpoint(run: Run, path: Path, sampler: dict, next_epoch: bool) -> bool:
    """Rank 0's write of a checkpoint; False (reported) on an OOM or a storage error."""
    written = False

    def write() -> None:
        nonlocal written
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
        written = run.storage.write("save", path, lambda: logger.info(
            "saved %s", save_checkpoint(path, payload)))

    return run.stepper.local("checkpoint", write) and written


def save_best_model(run: Run, kind: str) -> None:
    """best-<kind>-loss.pt (kind: train or valid), the weights only: rank 0's local work.
    A failed write is said (storage policy) and changes nothing else: the file is not what
    a resume needs, so no rank waits for it or counts it."""
    if not run.ctx.is_main:
        return
    path = best_path(run.cfg.exp_dir, kind)

    def write() -> None:
        payload = make_payload(
            model=model_state(run), model_avg=averaged_state(run), step=run.step,
            epoch=run.epoch, train_stage=run.cfg.train_stage, config=run.cfg.checkpoint_config(),
        ) | checkpoint_extras(run)
        if run.storage.write("best", path, lambda: save_best(run.cfg.exp_dir, kind, payload)):
            logger.info("saved %s", path)

    run.stepper.local("checkpoint", write)

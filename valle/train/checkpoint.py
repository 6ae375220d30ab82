"""Checkpoints: the payload of docs/architecture.md, written atomically.

Files in ``<exp-dir>``: ``checkpoint-<step>.pt`` (every --save-every-n steps,
the last --keep-last-k kept), ``epoch-<N>.pt``, ``best-train-loss.pt``,
``best-valid-loss.pt``. Each is written to a temporary file in the same
directory, flushed, fsync'ed and renamed over the target, so a crash leaves
either the old file or the new one, never half of one.
"""

from __future__ import annotations

import logging
import os
import random
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from valle.durable import fsync_dir

__all__ = [
    "FORMAT",
    "REQUIRED_KEYS",
    "CorruptCheckpointError",
    "make_payload",
    "save_checkpoint",
    "atomic_save",
    "load_checkpoint",
    "find_latest_checkpoint",
    "list_checkpoints",
    "remove_old_checkpoints",
    "save_best",
    "best_path",
    "capture_rng_state",
    "restore_rng_state",
    "apply_stage_switch",
]

log = logging.getLogger(__name__)

FORMAT = "valle-checkpoint-1"
REQUIRED_KEYS = ("format", "model", "step", "epoch", "train_stage")
# Keys a payload may lack (older or hand-made files) and their defaults.
OPTIONAL_DEFAULTS: dict[str, Any] = {
    "model_avg": None,
    "optimizer": None,
    "scheduler": None,
    "scaler": None,
    "sampler": None,
    "rng": None,
    "batch_in_epoch": 0,
    "config": {},
    "quarantine": [],
}
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)\.pt$")
_EPOCH_RE = re.compile(r"^epoch-(\d+)\.pt$")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file that cannot be loaded or is not a valle payload."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"corrupt checkpoint {os.fspath(path)}: {reason}")
        self.path = Path(path)
        self.reason = reason


def make_payload(
    *,
    model: Mapping[str, Any],
    step: int,
    epoch: int,
    train_stage: int,
    model_avg: Mapping[str, Any] | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    rng: Mapping[str, Any] | None = None,
    batch_in_epoch: int = 0,
    config: Mapping[str, Any] | None = None,
    quarantine: list[dict] | None = None,
) -> dict[str, Any]:
    """The payload dict with every key of the documented format."""
    return {
        "format": FORMAT,
        "model": model,
        "model_avg": model_avg,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": scaler,
        "sampler": sampler,
        "rng": dict(rng) if rng is not None else capture_rng_state(),
        "step": int(step),
        "epoch": int(epoch),
        "batch_in_epoch": int(batch_in_epoch),
        "train_stage": int(train_stage),
        "config": dict(config or {}),
        "quarantine": list(quarantine or []),
    }


def _check_payload(payload: Any) -> str | None:
    """Why ``payload`` is not a valid payload, or None."""
    if not isinstance(payload, dict):
        return f"not a dict but {type(payload).__name__}"
    if payload.get("format") != FORMAT:
        return f"format {payload.get('format')!r}, expected {FORMAT!r}"
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        return f"missing keys {missing}"
    for key in ("step", "epoch", "train_stage"):
        if not isinstance(payload[key], int):
            return f"{key} is {type(payload[key]).__name__}, not int"
    return None


def save_checkpoint(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` to ``path`` atomically (temp file, fsync, os.replace)."""
    path = Path(path)
    payload = dict(payload)
    payload.setdefault("format", FORMAT)
    reason = _check_payload(payload)
    if reason is not None:
        raise ValueError(f"save_checkpoint({path}): {reason}")
    return atomic_save(path, payload)


def atomic_save(path: str | os.PathLike, obj: Any) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (temp file, fsync, os.replace); a failed
    write raises the file system's OSError (ENOSPC, EIO, EFBIG) and leaves nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Hidden and without the .pt suffix, so the scanners never pick it up.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _WriteErrors(f)
            try:
                torch.save(obj, writer)
            except RuntimeError:
                # torch's zip writer turns a failed write (ENOSPC, EIO, EFBIG) into
                # "unexpected pos ...": raise what the file system said instead.
                if writer.error is not None:
                    raise writer.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


class _WriteErrors:
    """A file for torch.save that remembers the first OSError of its writes."""

    def __init__(self, f):
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str):  # flush, truncate, ...: the file's own
        return getattr(self._f, name)


def load_checkpoint(
    path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = False
) -> dict[str, Any]:
    """Load and validate a checkpoint; raise ``CorruptCheckpointError`` naming it.

    The file is read fully (a truncated file fails here, not later). Missing
    optional keys get their defaults. ``weights_only`` is False by default
    because the payload holds the sampler's state as well as tensors; only
    load checkpoints you wrote.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        raise CorruptCheckpointError(path, f"{type(e).__name__}: {e}") from e
    reason = _check_payload(payload)
    if reason is not None:
        raise CorruptCheckpointError(path, reason)
    for key, default in OPTIONAL_DEFAULTS.items():
        if key not in payload:
            payload[key] = default.copy() if isinstance(default, (dict, list)) else default
    return payload


def _peek_order(path: Path, prefer_stage: int | None = None) -> tuple[int, int, int] | None:
    """(stage matches, step, epoch) of a checkpoint without reading its tensors, or None
    if unreadable. With `prefer_stage`, checkpoints of that train stage sort first."""
    try:
        payload = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:
        return None
    if _check_payload(payload) is not None:
        return None
    same_stage = int(prefer_stage is None or payload.get("train_stage") == prefer_stage)
    return same_stage, payload["step"], payload["epoch"]


def list_checkpoints(exp_dir: str | os.PathLike) -> list[Path]:
    """``checkpoint-<n>.pt`` and ``epoch-<n>.pt`` in ``exp_dir`` (not best-*)."""
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        return []
    return sorted(
        p
        for p in exp_dir.iterdir()
        if p.is_file() and (_CHECKPOINT_RE.match(p.name) or _EPOCH_RE.match(p.name))
    )


def readable_checkpoints(
    exp_dir: str | os.PathLike, prefer_stage: int | None = None, pattern: re.Pattern | None = None
) -> list[Path]:
    """The readable checkpoints in ``exp_dir``, newest first (optionally only names matching
    ``pattern``). Newest means the largest payload step, then epoch (then checkpoint-* over
    epoch-* at a tie, then the later modification time). An unreadable or truncated file is
    left out with a warning. Reads headers only (mmap)."""
    candidates: list[tuple[tuple, Path]] = []
    for path in list_checkpoints(exp_dir):
        if pattern is not None and not pattern.match(path.name):
            continue
        order = _peek_order(path, prefer_stage)
        if order is None:
            log.warning("Checkpoint %s is unreadable (truncated or corrupt); skipping it", path)
            continue
        is_step_ckpt = 1 if _CHECKPOINT_RE.match(path.name) else 0
        candidates.append(((*order, is_step_ckpt, path.stat().st_mtime), path))
    return [path for _, path in sorted(candidates, key=lambda c: c[0], reverse=True)]


def find_latest_checkpoint(
    exp_dir: str | os.PathLike, map_location: Any = "cpu", prefer_stage: int | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest valid checkpoint in ``exp_dir`` and its payload, or None (order:
    ``readable_checkpoints``; one that fails to load falls back to the one before)."""
    for path in readable_checkpoints(exp_dir, prefer_stage):
        try:
            return path, load_checkpoint(path, map_location=map_location)
        except CorruptCheckpointError as e:
            log.warning("%s; falling back to the previous checkpoint", e)
    return None


def remove_old_checkpoints(exp_dir: str | os.PathLike, keep_last_k: int) -> list[Path]:
    """Delete the readable ``checkpoint-<n>.pt`` older than the ``keep_last_k`` newest
    readable ones.

    Only readable files count as kept, so a truncated or corrupt newest file never
    costs the last good one; unreadable files are left for the user to inspect.
    ``keep_last_k <= 0`` keeps everything. epoch-* and best-* are never touched.
    Returns the removed paths.
    """
    if keep_last_k <= 0:
        return []
    removed = []
    for p in readable_checkpoints(exp_dir, pattern=_CHECKPOINT_RE)[keep_last_k:]:
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def best_path(exp_dir: str | os.PathLike, kind: str) -> Path:
    """``best-train-loss.pt`` or ``best-valid-loss.pt`` in ``exp_dir``."""
    if kind not in ("train", "valid"):
        raise ValueError(f"save_best: kind must be 'train' or 'valid', not {kind!r}")
    return Path(exp_dir) / f"best-{kind}-loss.pt"


def save_best(exp_dir: str | os.PathLike, kind: str, payload: Mapping[str, Any]) -> Path:
    """Write ``best-train-loss.pt`` or ``best-valid-loss.pt`` atomically."""
    return save_checkpoint(best_path(exp_dir, kind), payload)


# --------------------------------------------------------------------------
# RNG


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and current-CUDA-device generator states.

    Plain types and tensors only (numpy's state is stored as a dict of lists),
    so the payload stays loadable with ``weights_only=True``.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": None,
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional for valle.train
        np = None
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "bit_generator": str(name),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    # Only when CUDA is in use: querying it would otherwise initialise it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Mapping[str, Any] | None) -> None:
    """Restore what ``capture_rng_state`` captured (missing parts are left alone)."""
    if not state:
        return
    if state.get("python") is not None:
        py = state["python"]
        # A tuple may come back as a list after some serialisations.
        random.setstate((py[0], tuple(py[1]), py[2]))
    if state.get("numpy") is not None:
        import numpy as np

        s = state["numpy"]
        np.random.set_state(
            (
                s["bit_generator"],
                np.asarray(s["keys"], dtype=np.uint32),
                s["pos"],
                s["has_gauss"],
                s["cached_gaussian"],
            )
        )
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


# --------------------------------------------------------------------------
# Stage switch

# State that belongs to one stage's optimisation: the parameters trained
# differ between stages, so optimizer/scheduler/scaler state no longer
# applies, and the sampler position belongs to the old run.
_STAGE_BOUND_STATE = ("optimizer", "scheduler", "scaler", "sampler")


def apply_stage_switch(
    payload: Mapping[str, Any], new_stage: int
) -> tuple[dict[str, Any], list[str]]:
    """Adapt a payload saved in one train stage to resume in ``new_stage``.

    Same stage: returned unchanged, nothing dropped. Different stage (1 -> 2,
    1/2 -> 0, 2 -> 1, 0 -> 1/2): model weights and model_avg are kept; the
    optimizer, scheduler, scaler and sampler state, the step/epoch/batch
    counters (training starts afresh at epoch 1, step 0) and the quarantine
    list (cuts that ran out of memory under the old stage's memory profile)
    are dropped. Returns (payload, names of what held something and was dropped).
    """
    old_stage = payload.get("train_stage")
    if old_stage == new_stage:
        return dict(payload), []
    out = dict(payload)
    dropped: list[str] = []
    for key in _STAGE_BOUND_STATE:
        if out.get(key) is not None:
            dropped.append(key)
        out[key] = None
    fresh = {"step": 0, "epoch": 1, "batch_in_epoch": 0}
    for key, value in fresh.items():
        if out.get(key, value) != value:
            dropped.append(key)
        out[key] = value
    if out.get("quarantine"):
        dropped.append("quarantine")
    out["quarantine"] = []
    out["train_stage"] = int(new_stage)
    return out, dropped

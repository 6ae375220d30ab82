"""Memory: OOM detection, memory figures, the NAR backward reserve, OOM reports.

Everything here is safe to call on CPU (figures are zero, the reserve is a no-op).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from valle.train.checkpoint import atomic_save
from valle.train.storage import Storage

logger = logging.getLogger(__name__)

MiB = 1 << 20

# Messages of allocation failures that do not arrive as torch.OutOfMemoryError
# (cuBLAS/cuDNN workspaces, NCCL buffers, CPU allocations).
_OOM_MARKERS = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
)


def is_oom_error(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, (RuntimeError, MemoryError)):
        text = str(exc)
        return isinstance(exc, MemoryError) or any(m in text for m in _OOM_MARKERS)
    return False


def configure_allocator() -> str:
    """Ask for expandable segments unless the user chose an allocator config.

    Expandable segments let the allocator grow one mapping instead of carving
    fixed segments, which removes most of the fragmentation that makes a
    backward pass fail with gigabytes nominally free. Must run before CUDA
    initialises; returns the setting in force.
    """
    names = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    chosen = next((os.environ[n] for n in names if n in os.environ), None)
    if chosen is not None:
        return chosen  # the user's choice wins
    if not torch.cuda.is_available():
        return ""
    # torch >= 2.9 reads PYTORCH_ALLOC_CONF and warns about the old name.
    new_name = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 9)
    os.environ[names[0] if new_name else names[1]] = "expandable_segments:True"
    return "expandable_segments:True"


def free_memory(device: torch.device) -> None:
    """Return cached blocks after an OOM so the retry starts from a clean pool."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def largest_free_block(device: torch.device) -> int:
    """Largest block the caching allocator could hand out without a new cudaMalloc."""
    best = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != device.index:
            continue
        for block in segment.get("blocks", []):
            if block.get("state") == "inactive":
                best = max(best, int(block.get("size", 0)))
    return best


def memory_figures(device: torch.device) -> dict[str, int]:
    """The allocator's state, read at the failure (before anything is freed), in bytes:
    allocated, reserved, peak, free on the device, the largest free cached block, and
    fragmentation figures from `torch.cuda.memory_stats` (bytes cached but split off
    inactive blocks, allocation retries that had to flush the cache, OOMs so far)."""
    if device.type != "cuda":
        return {"allocated": 0, "reserved": 0, "max_allocated": 0, "device_free": 0,
                "device_total": 0, "largest_free_block": 0}
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "device_free": int(free),
        "device_total": int(total),
        "largest_free_block": largest_free_block(device),
        "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
    }


class BackwardReserve:
    """Holds a contiguous block during the NAR forward, released when it ends.

    The NAR backward needs a few large contiguous buffers; after a long forward
    the pool can be fragmented so that they do not fit although enough memory is
    nominally free. Holding `size_mb` through the NAR forward and releasing it as
    the forward ends hands backward one contiguous free segment (the reference
    discussion measured blocks of ~480 MB). The model enters `held()` around its
    NAR forward only (not the AR forward, not under no_grad: no backward follows
    there), and leaves it on every path, an OOM included. Size 0 disables it.
    """

    def __init__(self, device: torch.device, size_mb: int):
        self.device = device
        self.nbytes = size_mb * MiB
        self._block: torch.Tensor | None = None
        self.holds = 0  # how often it was taken (tests, logs)

    @property
    def is_held(self) -> bool:
        return self._block is not None

    @contextmanager
    def held(self) -> Iterator[None]:
        self.hold()
        try:
            yield
        finally:
            self.release()

    def hold(self) -> None:
        if self.nbytes and self._block is None and torch.is_grad_enabled():
            try:
                self._block = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                self.holds += 1
            except Exception as exc:  # noqa: BLE001
                if not is_oom_error(exc):
                    raise
                # Not holding the reserve is not an error: the step may still fit.
                logger.warning("could not hold the %d MiB backward reserve", self.nbytes // MiB)

    def release(self) -> None:
        self._block = None


@dataclass
class OomEvent:
    """One OOM, as written to `<exp-dir>/oom/events-rank<R>.jsonl` and the log."""

    phase: str
    rank: int
    step: int
    attempt: int
    split: int
    injected: bool
    message: str
    cut_ids: list[str] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    text_token_lens: list[int] = field(default_factory=list)
    audio_frame_lens: list[int] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    saved_batch: str | None = None
    time: float = field(default_factory=time.time)

    def summary(self) -> str:
        mem = self.memory
        return (
            f"OOM in {self.phase} on rank {self.rank} at step {self.step} (attempt {self.attempt}, "
            f"split {self.split}): {len(self.cut_ids)} cuts, "
            f"max duration {max(self.durations, default=0):.2f}s, "
            f"max text tokens {max(self.text_token_lens, default=0)}, "
            f"max frames {max(self.audio_frame_lens, default=0)}; "
            f"allocated {mem.get('allocated', 0) / MiB:.0f} MiB, "
            f"reserved {mem.get('reserved', 0) / MiB:.0f} MiB, "
            f"largest free block {mem.get('largest_free_block', 0) / MiB:.0f} MiB; "
            + (f"predicted peak {mem['predicted_peak'] / MiB:.0f} MiB of a "
               f"{mem.get('budget', 0) / MiB:.0f} MiB budget; " if "predicted_peak" in mem else "")
            + f"cuts {self.cut_ids[:8]}{' ...' if len(self.cut_ids) > 8 else ''}"
        )


def describe_batch(batch: dict[str, Any] | None) -> dict[str, list]:
    """The per-cut facts an OOM report needs, from a (CPU) batch."""
    if not batch:
        return {}

    def as_list(key: str) -> list:
        value = batch.get(key)
        if value is None:
            return []
        return value.tolist() if isinstance(value, torch.Tensor) else list(value)

    return {
        "cut_ids": [str(c) for c in as_list("cut_ids")],
        "durations": [round(float(d), 3) for d in as_list("durations")],
        "texts": [str(t) for t in as_list("text")],
        "text_token_lens": [int(x) for x in as_list("text_tokens_lens")],
        "audio_frame_lens": [int(x) for x in as_list("audio_features_lens")],
    }


class OomReporter:
    """Writes each OOM event, saves the first few batches, optionally a CUDA snapshot."""

    def __init__(self, exp_dir: str | Path | None, rank: int, save_batches: int = 3,
                 memory_snapshots: bool = False, storage: Storage | None = None):
        self.dir = Path(exp_dir) / "oom" if exp_dir else None
        self.rank = rank
        self.save_batches = save_batches
        self.memory_snapshots = memory_snapshots
        self.storage = storage if storage is not None else Storage()  # a full disk: said once
        self.saved = 0
        self.events: list[OomEvent] = []
        self.meter = None  # valle.train.resilience.meter (set by the trainer): budget, CPU figures
        self.predict_peak = None  # batch -> bytes, set when --max-duration auto fitted a model

    def report(self, event: OomEvent, batch: dict[str, Any] | None) -> OomEvent:
        self._add_budget_figures(event, batch)
        if self.dir is not None:
            self._write(event, batch, self.dir)
        self.events.append(event)
        logger.warning("%s", event.summary())
        return event

    def _write(self, event: OomEvent, batch: dict[str, Any] | None, out: Path) -> None:
        """The event's files; each write that fails is said and left out (training goes on)."""
        write = self.storage.write
        if not write("oom", out, lambda: out.mkdir(parents=True, exist_ok=True)):
            return
        if batch is not None and self.saved < self.save_batches:
            path = out / f"batch-step{event.step}-rank{self.rank}-attempt{event.attempt}-{event.phase}.pt"
            if write("oom", path, lambda: atomic_save(path, dict(batch))):
                event.saved_batch = str(path)
                self.saved += 1
        if self.memory_snapshots and torch.cuda.is_available():
            path = out / f"snapshot-step{event.step}-rank{self.rank}.pickle"
            write("oom", path, lambda: torch.cuda.memory._dump_snapshot(str(path)))

        def append() -> None:
            with open(out / f"events-rank{self.rank}.jsonl", "a") as f:
                f.write(json.dumps(asdict(event)) + "\n")

        write("oom", out / f"events-rank{self.rank}.jsonl", append)

    def _add_budget_figures(self, event: OomEvent, batch: dict[str, Any] | None) -> None:
        """The budget, the batch's predicted peak beside it, and on CPU the meter's figures."""
        if self.meter is None:
            return
        event.memory["budget"] = int(self.meter.budget_bytes)
        if self.meter.kind == "census":
            event.memory.update(allocated=self.meter.live_bytes(),
                                max_allocated=self.meter.peak_bytes())
        if self.predict_peak is not None and batch is not None:
            event.memory["predicted_peak"] = int(self.predict_peak(batch))

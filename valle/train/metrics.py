"""Metrics, logging and progress for the trainer.

* ``MetricsTracker``: named sums (losses are sums over frames, accuracies are
  counts) kept as tensors so accumulating costs no host sync; ``reduce()``
  all-reduces all of them in one collective; ``normalized()`` divides at
  report time.
* ``TensorBoardLogger``: rank-0 scalars, tensorboard imported lazily.
* ``setup_logging``: log file under ``<exp-dir>/log/`` plus console, rank shown.
* ``ThroughputMeter``: it/s and ETA.
* ``plot_loss_curve``: a PNG of the loss from TensorBoard events or points.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from valle.train.storage import Storage, quiet_tensorboard_thread, storage_error, warn_console

__all__ = [
    "MetricsTracker",
    "TensorBoardLogger",
    "setup_logging",
    "ThroughputMeter",
    "format_duration",
    "plot_loss_curve",
]

Number = float | int | Tensor


class MetricsTracker:
    """Named sums that add up across micro-batches, steps and ranks.

    Values may be Python numbers or 0-dim tensors (kept on their device, so
    ``add`` never syncs). Conventions for ``normalized()``:

    * ``<x>loss`` is divided by ``<prefix>frames`` when that key exists
      (``ar_loss`` / ``ar_frames``), else by ``frames``;
    * ``<prefix>top10_correct`` becomes ``<prefix>top10_acc`` =
      correct / ``<prefix>frames``;
    * everything else (frames, cuts, counters) is reported as the sum.
    """

    def __init__(self, values: Mapping[str, Number] | None = None) -> None:
        self._sums: dict[str, Number] = {}
        if values:
            self.update(values)

    # ------------------------------------------------------------ accumulate

    def add(self, name: str, value: Number) -> None:
        if isinstance(value, Tensor):
            value = value.detach()
        cur = self._sums.get(name)
        self._sums[name] = value if cur is None else cur + value

    def update(self, values: Mapping[str, Number]) -> MetricsTracker:
        for k, v in values.items():
            self.add(k, v)
        return self

    def __add__(self, other: MetricsTracker) -> MetricsTracker:
        out = MetricsTracker(self._sums)
        out.update(other._sums)
        return out

    def __mul__(self, factor: float) -> MetricsTracker:
        """Scale every sum (icefall's decaying running totals: tot * (1 - 1/n) + cur)."""
        return MetricsTracker({k: v * factor for k, v in self._sums.items()})

    def __contains__(self, name: str) -> bool:
        return name in self._sums

    def __getitem__(self, name: str) -> float:
        return _to_float(self._sums[name])

    def get(self, name: str, default: float = 0.0) -> float:
        return _to_float(self._sums[name]) if name in self._sums else default

    def keys(self) -> list[str]:
        return sorted(self._sums)

    def raw(self) -> dict[str, Number]:
        return dict(self._sums)

    def reset(self) -> None:
        self._sums.clear()

    # ---------------------------------------------------------------- reduce

    def to_tensor(self, names: Iterable[str] | None = None, device=None) -> tuple[list[str], Tensor]:
        """Pack the sums (sorted names) into one float64 tensor."""
        names = sorted(self._sums) if names is None else list(names)
        if device is None:
            device = next(
                (v.device for v in self._sums.values() if isinstance(v, Tensor)), torch.device("cpu")
            )
        parts = []
        for n in names:
            v = self._sums.get(n, 0.0)
            if isinstance(v, Tensor):
                parts.append(v.to(device=device, dtype=torch.float64).reshape(1))
            else:
                parts.append(torch.tensor([float(v)], dtype=torch.float64, device=device))
        packed = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
        return names, packed

    def reduce(self, group=None, names: Iterable[str] | None = None, device=None) -> MetricsTracker:
        """Sum every metric over the ranks of ``group`` with one all_reduce.

        Every rank must hold the same names (or pass the same ``names``; a
        missing one counts as 0). On NCCL the packed tensor goes to the
        current CUDA device. Returns self (values become tensors on that device).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        if device is None and dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        names, packed = self.to_tensor(names, device=device)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        self._sums = {n: packed[i] for i, n in enumerate(names)}
        return self

    # ---------------------------------------------------------------- report

    def normalized(self) -> dict[str, float]:
        """Per-frame losses, top-10 accuracies and raw counts, as floats."""
        sums = {k: _to_float(v) for k, v in self._sums.items()}
        out: dict[str, float] = {}
        for name in sorted(sums):
            value = sums[name]
            if name.endswith("loss"):
                prefix = name[: -len("loss")]
                frames = sums.get(prefix + "frames", sums.get("frames", 0.0))
                out[name] = value / frames if frames > 0 else float("nan")
            elif name.endswith("top10_correct"):
                prefix = name[: -len("top10_correct")]
                frames = sums.get(prefix + "frames", sums.get("frames", 0.0))
                out[prefix + "top10_acc"] = value / frames if frames > 0 else float("nan")
            else:
                out[name] = value
        return out

    def __str__(self) -> str:
        norm = self.normalized()
        # Losses and accuracies first, counts after.
        rated = [k for k in norm if k.endswith("loss") or k.endswith("_acc")]
        counts = [k for k in norm if k not in rated]
        parts = [f"{k}={norm[k]:.4g}" for k in rated]
        parts += [f"{k}={_fmt_count(norm[k])}" for k in counts]
        return ", ".join(parts)

    def __repr__(self) -> str:
        return f"MetricsTracker({self})"


def _to_float(v: Number) -> float:
    return float(v.item()) if isinstance(v, Tensor) else float(v)


def _fmt_count(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.4g}"


# --------------------------------------------------------------------------
# TensorBoard


class TensorBoardLogger:
    """Scalars to TensorBoard from rank 0 only; a no-op elsewhere or when disabled.

    A write that fails (a full disk) is said once through the storage policy
    (valle.train.storage) and drops the writer; the next call opens a new events file,
    so the curves go on once there is room again."""

    def __init__(self, log_dir: str | os.PathLike, enabled: bool = True, rank: int | None = None,
                 storage: Storage | None = None) -> None:
        if rank is None:
            rank = _current_rank()
        self.enabled = bool(enabled) and rank == 0
        self.log_dir = Path(log_dir)
        self.storage = storage if storage is not None else Storage()
        self._writer = None
        if self.enabled:
            quiet_tensorboard_thread()
            self._open()

    def _open(self) -> bool:
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is heavy

        def open_writer() -> None:
            self._writer = SummaryWriter(log_dir=str(self.log_dir))

        return self.storage.write("tensorboard", self.log_dir, open_writer)

    def _use(self, work) -> None:
        """Run `work(writer)`; on a storage error drop the writer (its thread is dead)."""
        if not self.enabled or (self._writer is None and not self._open()):
            return
        if not self.storage.write("tensorboard", self.log_dir, lambda: work(self._writer)):
            self._drop()

    def _drop(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass  # already said

    def scalars(self, step: int, values: Mapping[str, Number | None], prefix: str = "") -> None:
        finite = {}
        for name, value in values.items():
            if value is None:
                continue
            v = _to_float(value)
            if math.isfinite(v):
                finite[prefix + name] = v
        if not finite:
            return

        def add(writer) -> None:
            for name, v in finite.items():
                writer.add_scalar(name, v, global_step=step)

        self._use(add)

    def flush(self) -> None:
        if self._writer is not None:
            self._use(lambda writer: writer.flush())

    def close(self) -> None:
        if self._writer is not None:
            writer = self._writer
            if not self.storage.write("tensorboard", self.log_dir, writer.close):
                self._drop()
            self._writer = None


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


# --------------------------------------------------------------------------
# Logging

_HANDLER_TAG = "_valle_setup_logging"


class LogFile(logging.FileHandler):
    """The log file. A write that fails (a full disk) is said once on stderr, not as a
    traceback per record; the console keeps every record, and the file takes them again
    once there is room (said too)."""

    failing = False

    def emit(self, record: logging.LogRecord) -> None:
        self._failed_now = False
        super().emit(record)
        if self.failing and not self._failed_now:
            self.failing = False
            warn_console(f"the log file {self.baseFilename} is written again")

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self._failed_now = True
        if not self.failing:
            self.failing = True
            warn_console(f"could not write the log file {self.baseFilename}: "
                         f"{storage_error(exc)}; the log goes to the console only until "
                         "there is room")


def setup_logging(
    log_dir: str | os.PathLike,
    rank: int = 0,
    world_size: int = 1,
    level: int | str = logging.INFO,
    prefix: str = "log-train",
) -> Path:
    """Log to ``<log_dir>/<prefix>-<timestamp>[-<rank>]`` and to the console.

    ``log_dir`` is ``<exp-dir>/log``. The format shows ``(rank/world_size)``.
    Calling it again replaces the handlers it added before. Returns the file path.
    """
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H-%M-%S")
    name = f"{prefix}-{stamp}" + (f"-{rank}" if world_size > 1 else "")
    path = log_dir / name
    fmt = logging.Formatter(
        f"%(asctime)s %(levelname)s [%(filename)s:%(lineno)d] ({rank}/{world_size}) %(message)s"
    )
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _HANDLER_TAG, False):
            root.removeHandler(h)
            h.close()
    file_handler = LogFile(path, mode="a", encoding="utf-8")
    console = logging.StreamHandler()
    for h in (file_handler, console):
        h.setFormatter(fmt)
        h.setLevel(level)
        setattr(h, _HANDLER_TAG, True)
        root.addHandler(h)
    root.setLevel(level)
    return path


# --------------------------------------------------------------------------
# Throughput


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h02m05s``; unknown -> ``?``."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


class ThroughputMeter:
    """Steps per second over a sliding window, and the ETA it implies."""

    def __init__(self, window: int = 50, clock=time.monotonic) -> None:
        self._clock = clock
        self._times: deque[tuple[float, int]] = deque(maxlen=max(2, window + 1))
        self._count = 0
        self._times.append((clock(), 0))

    def step(self, n: int = 1) -> None:
        """Record ``n`` completed steps now."""
        self._count += n
        self._times.append((self._clock(), self._count))

    @property
    def rate(self) -> float:
        """Steps per second over the window (0 before any step)."""
        (t0, c0), (t1, c1) = self._times[0], self._times[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 and c1 > c0 else 0.0

    def eta_seconds(self, done: int, total: int) -> float:
        r = self.rate
        return max(total - done, 0) / r if r > 0 else float("nan")

    def eta(self, done: int, total: int) -> str:
        return format_duration(self.eta_seconds(done, total))

    def __str__(self) -> str:
        return f"{self.rate:.2f} it/s"


# --------------------------------------------------------------------------
# Loss curve


def _read_tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points: dict[int, float] = {}
    event_dirs = sorted({p.parent for p in log_dir.rglob("events.out.tfevents.*")})
    for d in event_dirs:
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                points[int(ev.step)] = float(ev.value)
    return sorted(points.items())


def plot_loss_curve(
    source: str | os.PathLike | Iterable[tuple[int, float]],
    png_path: str | os.PathLike,
    tag: str = "train/loss",
    title: str = "training loss",
) -> Path:
    """Plot (step, loss) points, or the ``tag`` scalars of a TensorBoard
    directory, to ``png_path``. Raises ValueError when there is nothing to plot."""
    if isinstance(source, (str, os.PathLike)):
        points = _read_tensorboard_scalars(Path(source), tag)
    else:
        points = sorted((int(s), float(v)) for s, v in source)
    if not points:
        raise ValueError(f"plot_loss_curve: no points for {tag!r} in {source}")
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        ax.plot([s for s, _ in points], [v for _, v in points], linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(tag)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
    finally:
        plt.close(fig)
    return png_path

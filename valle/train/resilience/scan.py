"""The pre-training pessimistic scan (`--oom-check`).

Runs the batches most likely to run out of memory (longest audio, longest
text, and whatever lhotse's `find_pessimistic_batches` picks) exactly as
training runs them: autocast dtype, GradScaler-scaled backward, backward
reserve held, optimizer state materialised. The reference discussion's OOM
happened in the loss-scaling step the original scan skipped; this one runs it.

Prints criterion, batch size, peak memory and headroom. If a batch does not
fit, halves it until it does and names the flag to lower and a value that
would fit; every rank agrees (one all_reduce) and all stop together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from valle.train.batching import Batch, batch_size, frame_count, select_rows
from valle.train.config import TrainConfig
from valle.train.resilience.memory import MiB, free_memory

logger = logging.getLogger(__name__)


class BatchTooLargeError(RuntimeError):
    """A pessimistic batch does not fit; the message names the flag and a value."""


@dataclass
class ScanRow:
    criterion: str
    cuts: int
    frames: int
    text_tokens: int
    peak_bytes: int
    total_bytes: int
    fits: bool
    fitting_fraction: float = 1.0

    def line(self) -> str:
        if self.total_bytes:
            mem = (f"{self.peak_bytes / MiB:9.1f} MiB  {(self.total_bytes - self.peak_bytes) / MiB:9.1f} MiB")
        else:  # a CPU run without --memory-budget-gb: a peak, but no budget to compare with
            mem = f"{self.peak_bytes / MiB:9.1f} MiB  {'n/a':>13}"
        return (f"{self.criterion:<36} {self.cuts:>5} {self.frames:>7} {self.text_tokens:>7}  {mem}  "
                f"{'ok' if self.fits else 'OOM'}")


def scan_pessimistic_batches(stepper, batches: dict[str, Batch], cfg: TrainConfig) -> list[ScanRow]:
    device = stepper.device
    # The optimizer state is real by now (ResilientStep.materialize_state): it takes
    # its memory here as it will in training, no stand-in needed.
    stepper.materialize_state()
    meter = scan_meter(stepper)
    with meter.active(), stepper.phases.phase_scope("scan"):
        rows = [_try_batch(stepper, meter, name, batch) for name, batch in batches.items()]
    free_memory(device)
    header = (f"{'criterion':<36} {'cuts':>5} {'frames':>7} {'text':>7}  {'peak':>13}  "
              f"{'headroom':>13}  result")
    logger.info("pessimistic batches (%s, GradScaler %s, reserve %d MiB):\n%s\n%s", cfg.dtype,
                "on" if cfg.dtype == "float16" else "off", stepper.reserve.nbytes // MiB, header,
                "\n".join(r.line() for r in rows))
    failed = stepper.reduce_counts([float(not all(r.fits for r in rows))])[0]
    if failed > 0:
        advice = [_advice(r, cfg) for r in rows if not r.fits]
        raise BatchTooLargeError(
            "the pessimistic scan ran out of memory on "
            + (", ".join(advice) if advice else "another rank (see its log)")
            + " (or pass --oom-check false to train anyway: the resilient step will split such batches)")
    return rows


def scan_meter(stepper):
    """The run's memory meter (valle.train.build), or one made for this scan (callers
    that built a step by hand): on CPU it counts tensors only inside the scan."""
    meter = stepper.meter
    if meter is None:
        from valle.train.resilience.meter import build_meter, training_state_tensors

        meter = build_meter(stepper.device, 0.0)
        meter.track(training_state_tensors(stepper.model, stepper.optimizer))
        if stepper.device.type == "cuda":  # the scan's "headroom": the whole device, as before
            meter.budget_bytes = torch.cuda.get_device_properties(stepper.device).total_memory
    return meter


def _try_batch(stepper, meter, name: str, batch: Batch) -> ScanRow:
    total = meter.budget_bytes
    fraction, current = 1.0, batch
    while True:
        meter.reset_peak()
        ok = _fits(stepper, current)
        peak = meter.peak_bytes()
        if ok or batch_size(current) == 1:
            break
        fraction /= 2
        current = select_rows(batch, range(max(1, int(batch_size(batch) * fraction))))
    text = int(batch["text_tokens_lens"].sum())
    return ScanRow(name, batch_size(batch), frame_count(batch), text, peak, total,
                   fits=fraction == 1.0 and ok, fitting_fraction=fraction if ok else 0.0)


def _fits(stepper, batch: Batch) -> bool:
    """Whether the batch trains; a failure is retried once after memory was freed
    (a transient OOM is not a reason to tell the user to lower a flag)."""
    return any(stepper.guard.run(-1, lambda: stepper.trial(batch)) is None for _ in range(2))


def _advice(row: ScanRow, cfg: TrainConfig) -> str:
    flag = "--max-text-tokens" if "text" in row.criterion else "--max-duration"
    given = cfg.checkpoint_config().get(flag[2:].replace("-", "_"))
    try:
        current = float(given)
    except (TypeError, ValueError):  # "auto": the budget the data module derived
        current = None
    if row.fitting_fraction > 0 and current:
        # 10% margin: peak memory grows slightly faster than linearly with batch size.
        return (f"'{row.criterion}' ({row.cuts} cuts): lower {flag} from {current:g} to about "
                f"{current * row.fitting_fraction * 0.9:.0f}")
    if row.fitting_fraction > 0:
        return (f"'{row.criterion}' ({row.cuts} cuts): set {flag} to about "
                f"{row.fitting_fraction * 0.9:.0%} of the value it has now ({given}, printed at start)")
    return f"'{row.criterion}' ({row.cuts} cuts): even one cut does not fit; lower {flag} or the model size"

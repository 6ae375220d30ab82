"""Row-wise batch surgery: split into micro-batches, drop rows, move to a device.

A batch is the dict of docs/architecture.md: every tensor and list is indexed
by row first. Padding is trimmed after a split, so a micro-batch of short cuts
does not pay for the longest cut of the full batch (that is the point of
splitting after an OOM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from valle.codec.constants import NUM_AUDIO_TOKENS

Batch = dict[str, Any]

# Padding ids (masked by the lengths anyway; they only need to be valid ids): text pads
# with <pad>, audio codes with NUM_AUDIO_TOKENS (the codebooks' pad/EOS id).
TEXT_PAD = 1
AUDIO_PAD = NUM_AUDIO_TOKENS

# Padded sequence tensors and the length tensor that bounds each.
_PADDED = {
    "text_tokens": "text_tokens_lens",
    "audio_features": "audio_features_lens",
    "prompt_features": "prompt_features_lens",
}


def batch_size(batch: Batch) -> int:
    return len(batch["cut_ids"])


def select_rows(batch: Batch, rows: Sequence[int]) -> Batch:
    """The batch restricted to `rows` (in that order), with padding trimmed."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    out: Batch = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = value.index_select(0, index)
        elif isinstance(value, (list, tuple)):
            out[key] = [value[i] for i in rows]
        else:
            out[key] = value
    return trim_padding(out)


def trim_padding(batch: Batch) -> Batch:
    for key, lens_key in _PADDED.items():
        if key in batch and lens_key in batch and len(batch[lens_key]) > 0:
            longest = int(batch[lens_key].max())
            batch[key] = batch[key][:, :longest]
    return batch


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Split into `parts` contiguous micro-batches of near-equal size (fewer if rows run out)."""
    n = batch_size(batch)
    parts = max(1, min(parts, n))
    if parts == 1:
        return [batch]
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [select_rows(batch, range(lo, hi)) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def drop_cuts(batch: Batch, cut_ids: set[str]) -> tuple[Batch | None, list[str]]:
    """Remove rows whose cut id is in `cut_ids`; returns (batch or None if empty, dropped ids)."""
    keep = [i for i, c in enumerate(batch["cut_ids"]) if c not in cut_ids]
    dropped = [c for c in batch["cut_ids"] if c in cut_ids]
    if not dropped:
        return batch, []
    if not keep:
        return None, dropped
    return select_rows(batch, keep), dropped


def to_device(batch: Batch, device: torch.device) -> Batch:
    non_blocking = device.type == "cuda"
    return {k: (v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()}


def frame_count(batch: Batch | None) -> int:
    """Audio frames in the batch: the unit the gradient is normalised by."""
    if batch is None:
        return 0
    return int(batch["audio_features_lens"].sum())


def concat_batches(batches: list[Batch]) -> Batch:
    """One batch from several (for --accumulate-grad-steps): rows appended, re-padded."""
    if len(batches) == 1:
        return batches[0]
    out: Batch = {}
    for key, first in batches[0].items():
        values = [b[key] for b in batches]
        if isinstance(first, torch.Tensor) and first.dim() >= 2:
            longest = max(v.shape[1] for v in values)
            pad = _pad_value(key)
            values = [torch.nn.functional.pad(v, _pad_spec(v, longest), value=pad) for v in values]
            out[key] = torch.cat(values)
        elif isinstance(first, torch.Tensor):
            out[key] = torch.cat(values)
        elif isinstance(first, (list, tuple)):
            out[key] = [x for v in values for x in v]
        else:
            out[key] = first
    return out


def _pad_value(key: str) -> int:
    return AUDIO_PAD if key in ("audio_features", "prompt_features") else TEXT_PAD


def _pad_spec(tensor: torch.Tensor, longest: int) -> tuple[int, ...]:
    # F.pad pads from the last dimension backwards; dimension 1 is time.
    trailing = [0, 0] * (tensor.dim() - 2)
    return (*trailing, 0, longest - tensor.shape[1])

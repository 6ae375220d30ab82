"""Sampling constraint counting text tokens as well as audio duration, and a hard budget.

lhotse's samplers add a cut to a batch *before* asking the constraint whether the batch
is full (``close_to_exceeding`` predicts from the longest cut seen), so a constraint alone
cannot guarantee a bound. ``BudgetedSampler`` wraps the lhotse sampler and splits any
batch over budget, which makes "a batch never exceeds --max-text-tokens / --max-duration"
hold exactly. Costs are padded costs (batch size x longest item), as lhotse's
``TimeConstraint`` counts durations, so the sum of lengths is bounded too.
"""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from lhotse.dataset.sampling.base import TimeConstraint

from valle.data.collation import num_text_tokens

logger = logging.getLogger(__name__)

# lhotse pads the last round of batches with copies named "<id>_dup<k>" when fewer cuts than
# ranks are left. Training a cut twice would break the trainer's per-epoch accounting
# (trained + quarantined = drawn); a rank without data steps with None instead.
_DUPLICATE_RE = re.compile(r"_dup\d+$")


@dataclass
class TextTokenConstraint(TimeConstraint):
    """TimeConstraint (``max_duration``, ``quadratic_duration``) plus ``max_text_tokens``:
    the padded number of text tokens (bos/eos included via ``extra_tokens``)."""

    max_text_tokens: int | None = None
    extra_tokens: int = 2  # bos + eos added by the collater
    text_current: int = 0
    text_longest: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_text_tokens is not None and self.max_text_tokens <= 0:
            raise ValueError(f"--max-text-tokens must be > 0, got {self.max_text_tokens}")

    def text_length(self, cut) -> int:
        return num_text_tokens(cut) + self.extra_tokens

    def is_active(self) -> bool:
        return super().is_active() or self.max_text_tokens is not None

    def add(self, example) -> None:
        super().add(example)
        if self.max_text_tokens is not None:
            n = self.text_length(example)
            self.text_current += n
            self.text_longest = max(self.text_longest, n)

    def exceeded(self) -> bool:
        if super().exceeded():
            return True
        return self.max_text_tokens is not None and self.num_cuts * self.text_longest > self.max_text_tokens

    def close_to_exceeding(self) -> bool:
        if super().close_to_exceeding():
            return True
        if self.max_text_tokens is None:
            return False
        return (self.num_cuts + 1) * self.text_longest > self.max_text_tokens

    def reset(self) -> None:
        super().reset()
        self.text_current = 0
        self.text_longest = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        for key in ("max_text_tokens", "extra_tokens", "text_current", "text_longest"):
            setattr(self, key, state.pop(key))
        super().load_state_dict(state)

    def __add__(self, other: TextTokenConstraint) -> TextTokenConstraint:
        base = super().__add__(other)
        return TextTokenConstraint(
            **{k: getattr(base, k) for k in ("max_duration", "max_cuts", "current", "num_cuts",
                                              "longest_seen", "quadratic_duration")},
            max_text_tokens=self.max_text_tokens, extra_tokens=self.extra_tokens,
            text_current=self.text_current + other.text_current,
            text_longest=max(self.text_longest, other.text_longest),
        )

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TextTokenConstraint) and super().__eq__(other)
                and self.max_text_tokens == other.max_text_tokens)

    # --- hard budget --------------------------------------------------------
    def duration_cost(self, duration: float) -> float:
        return self._maybe_apply_quadratic_correction(duration)

    def fits(self, cuts: Sequence) -> bool:
        """Does this list of cuts respect every budget (padded costs)?"""
        if not cuts:
            return True
        longest_text = max(self.text_length(c) for c in cuts) if self.max_text_tokens is not None else 0
        return self.fits_sizes(len(cuts), max(c.duration for c in cuts), longest_text)

    def fits_sizes(self, num_cuts: int, longest_duration: float, longest_text: int) -> bool:
        """Does a batch of ``num_cuts`` cuts, the longest ``longest_duration`` seconds and
        ``longest_text`` text tokens (bos/eos included), respect every budget?"""
        if self.max_cuts is not None and num_cuts > self.max_cuts:
            return False
        if self.max_duration is not None:
            if num_cuts * self.duration_cost(longest_duration) > self.max_duration + 1e-9:
                return False
        if self.max_text_tokens is not None and num_cuts * longest_text > self.max_text_tokens:
            return False
        return True

    def single_fits(self, cut) -> bool:
        return self.fits([cut])

    def split(self, cuts: Sequence) -> list[list]:
        """Greedy split in order into sub-batches that fit (a cut over budget alone stays alone)."""
        out: list[list] = []
        current: list = []
        for cut in cuts:
            if current and not self.fits(current + [cut]):
                out.append(current)
                current = []
            current.append(cut)
        if current:
            out.append(current)
        return out


class BudgetedSampler:
    """Wraps a lhotse CutSampler: splits over-budget batches; can skip the first N batches
    of an epoch (resume). Yields CutSets. Deterministic given the wrapped sampler's seed."""

    def __init__(self, sampler, constraint: TextTokenConstraint) -> None:
        self.sampler = sampler
        self.constraint = constraint
        self.skip_batches = 0
        self.num_splits = 0
        self.num_duplicates_dropped = 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _sampled(self) -> Iterator:
        """The wrapped sampler's batches; lhotse reads --buffer-size cuts before its first,
        with the collector paused. Its iterator is taken once: lhotse's samplers restart
        when ``iter`` is called on them again."""
        with automatic_gc_paused():
            batches = iter(self.sampler)
            batch = next(batches, None)
        while batch is not None:
            yield batch
            batch = next(batches, None)

    def __iter__(self) -> Iterator:
        from lhotse import CutSet

        skip, self.skip_batches = self.skip_batches, 0
        index = 0
        for batch in self._sampled():
            cuts = [c for c in batch if not _DUPLICATE_RE.search(c.id)]
            self.num_duplicates_dropped += len(batch) - len(cuts)
            if not cuts:
                continue
            parts = self.constraint.split(cuts)
            if len(parts) > 1:
                self.num_splits += 1
                logger.debug("split an over-budget batch of %d cuts into %d", len(batch), len(parts))
            for part in parts:
                if index >= skip:
                    yield CutSet.from_cuts(part)
                index += 1


@contextmanager
def automatic_gc_paused() -> Iterator[None]:
    """Python's automatic garbage collection off for the block. Filling the sampler's buffer
    makes about 30 objects per cut that all stay alive, so each automatic full collection
    walks the growing buffer again: a third of the fill's CPU time at 40,000 cuts (docs/
    benchmarks.md, start-up). Cut objects hold no reference cycles, so refcounting frees all
    the fill discards and pausing the collector keeps no memory."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def bucket_bins(durations: Sequence[float], num_buckets: int, constraint) -> list[float]:
    """Duration bins for ``DynamicBucketingSampler(duration_bins=...)`` from a sample of the
    corpus's durations, as lhotse estimates them from cuts; ``[1e9]`` (one bucket) below
    two cuts, since lhotse refuses more buckets than cuts."""
    from types import SimpleNamespace

    from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets

    buckets = min(num_buckets, len(durations))
    if buckets < 2:
        return [1e9]
    return estimate_duration_buckets([SimpleNamespace(duration=d) for d in durations], buckets, constraint)

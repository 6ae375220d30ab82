"""Cuts that OOM even alone: written to `<exp-dir>/quarantine.jsonl`, skipped from then on.

One JSON object per line, appended (small appends are atomic on local file
systems, so ranks can share the file). Read back at start, so a restarted run
keeps skipping them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from valle.train.storage import Storage

logger = logging.getLogger(__name__)


class Quarantine:
    def __init__(self, path: str | Path | None, storage: Storage | None = None):
        self.path = Path(path) if path else None
        self.storage = storage if storage is not None else Storage()
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path is not None and self.path.exists():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        for line_no, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                self.entries[entry["cut_id"]] = entry
            except (json.JSONDecodeError, KeyError):
                # A line torn by a crash mid-write: keep going, say where.
                logger.warning("%s:%d: unreadable quarantine line skipped", self.path, line_no)
        if self.entries:
            logger.info("quarantine: %d cuts from %s will be skipped", len(self.entries), self.path)

    @property
    def cut_ids(self) -> set[str]:
        return set(self.entries)

    def __contains__(self, cut_id: str) -> bool:
        return cut_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, cut_id: str, *, reason: str, step: int, rank: int, **details: Any) -> None:
        if cut_id in self.entries:
            return
        entry = {"cut_id": cut_id, "reason": reason, "step": step, "rank": rank,
                 "time": time.time(), **details}
        self.entries[cut_id] = entry
        logger.warning("quarantined cut %s at step %d: %s", cut_id, step, reason)
        if self.path is not None:
            # A failed append is said; the entry still rides in every checkpoint's payload.
            self.storage.write("quarantine", self.path, lambda: self._append(entry))

    def _append(self, entry: dict[str, Any]) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def merge(self, entries: list[dict[str, Any]]) -> None:
        """Adopt entries from a checkpoint (without rewriting the file)."""
        for entry in entries:
            self.entries.setdefault(entry["cut_id"], entry)

    def state(self) -> list[dict[str, Any]]:
        return list(self.entries.values())


class OomNotDataError(RuntimeError):
    """Out-of-memory errors that the data does not explain: the GPU is the problem."""


@dataclass
class OomPolicy:
    """When a lone cut's OOM means the cut, and when OOMs mean the GPU.

    * A batch that fails is retried once as it is (memory was freed in between)
      before it is split finer: most OOMs are transient, and the same micro-batches
      give the same gradient bit for bit, in fp16 too.
    * A cut that fails alone is retried once (memory was freed in between): a
      transient failure (fragmentation, a spike) must not ban a healthy cut for
      good. Only its second failure in the same step quarantines it.
    * OOMs are not the data's fault when quarantines pile up
      (`max_quarantined` in this run) or when cuts no larger than ones already
      trained fail alone (`max_fitted_before`: a leak, another process on the
      GPU). Then the run stops with its own exit code rather than quarantining
      the whole corpus and exiting 0 having trained nothing.
    """

    max_quarantined: int = 100
    max_fitted_before: int = 3
    largest_frames: int = 0  # the largest single cut trained on this rank so far
    largest_text: int = 0
    quarantined_here: int = 0  # quarantined in this run (shared entries included)
    fitted_before: int = 0
    max_non_data_failures: int = 3
    non_data_failures: int = 0  # in this step, with no batch in flight
    _lone: set[str] = field(default_factory=set)
    _splits_failed: set[int] = field(default_factory=set)

    def begin_step(self) -> None:
        self._lone.clear()
        self._splits_failed.clear()
        self.non_data_failures = 0

    def retry_as_is(self, split: int) -> bool:
        """A batch failed at `split` micro-batches: True the first time in this step
        (retry unchanged after freeing memory), False after that (split finer)."""
        if split in self._splits_failed:
            return False
        self._splits_failed.add(split)
        return True

    def non_data_failure(self) -> bool:
        """Count a failure outside any batch's work; True once past the limit."""
        self.non_data_failures += 1
        return self.non_data_failures > self.max_non_data_failures

    def quarantine_now(self, cut_id: str) -> bool:
        """A lone failure of `cut_id`: True on its second one in this step."""
        if cut_id in self._lone:
            return True
        self._lone.add(cut_id)
        return False

    def note_trained(self, frames: list[int], text: list[int]) -> None:
        if frames:
            self.largest_frames = max(self.largest_frames, max(frames))
            self.largest_text = max(self.largest_text, max(text))

    def fitted_before_here(self, frames: int, text: int) -> bool:
        return frames <= self.largest_frames and text <= self.largest_text

    def note_quarantined(self, entries: list[dict[str, Any]]) -> None:
        self.quarantined_here += len(entries)
        self.fitted_before += sum(bool(e.get("fitted_before")) for e in entries)

    def verdict(self) -> str | None:
        """Why the run must stop (OOMs not tied to the data), or None."""
        if self.fitted_before > self.max_fitted_before:
            return (f"{self.fitted_before} cuts failed alone although larger cuts had trained "
                    f"before (limit --max-fitted-before-quarantines {self.max_fitted_before})")
        if self.quarantined_here > self.max_quarantined:
            return (f"{self.quarantined_here} cuts quarantined in this run (limit "
                    f"--max-quarantined-cuts {self.max_quarantined})")
        return None

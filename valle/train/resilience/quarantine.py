"""Cuts that OOM even alone: written to `<exp-dir>/quarantine.jsonl`, skipped from then on.

One JSON object per line, appended (small appends are atomic on local file
systems, so ranks can share the file). Read back at start, so a restarted run
keeps skipping them.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class Quarantine:
    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
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
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def merge(self, entries: list[dict[str, Any]]) -> None:
        """Adopt entries from a checkpoint (without rewriting the file)."""
        for entry in entries:
            self.entries.setdefault(entry["cut_id"], entry)

    def state(self) -> list[dict[str, Any]]:
        return list(self.entries.values())

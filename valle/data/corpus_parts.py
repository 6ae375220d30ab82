"""Writing one corpus part as the manifests bin/tokenizer.py reads, for recipes whose corpus
does not come as lhotse recordings + supervisions (Libriheavy's cuts, Emilia's JSONL rows).

    {out}/{prefix}_recordings_{part}.jsonl.gz    each recording once, in first-use order
    {out}/{prefix}_supervisions_{part}.jsonl.gz  one per utterance (start/duration in the recording)
    {out}/{prefix}_skipped_{part}.tsv            every item left out: id, reason, detail

All three appear together when the part is finished (written under temporary names, renamed
at the end), so a part interrupted half-way leaves no manifest that looks complete.
Streaming: at most the ids of the recordings written so far are held in memory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from valle.data import validation as V

logger = logging.getLogger(__name__)

# Reasons for items left out before tokenization (stable keys, as in valle.data.validation).
MISSING_AUDIO = "missing_audio"
LOW_DNSMOS = "low_dnsmos"


def part_manifest_paths(out_dir: Path, prefix: str, part: str) -> dict[str, Path]:
    out = Path(out_dir)
    return {"recordings": out / f"{prefix}_recordings_{part}.jsonl.gz",
            "supervisions": out / f"{prefix}_supervisions_{part}.jsonl.gz",
            "skipped": out / f"{prefix}_skipped_{part}.tsv"}


class PartManifestWriter:
    """Recordings and supervisions of one part, plus the report of what was skipped.
    Use as a context manager: leaving it by an exception discards the half-written files."""

    def __init__(self, out_dir: Path, prefix: str, part: str, shared_recordings: bool = True) -> None:
        """``shared_recordings``: several utterances may come from one recording (Libriheavy),
        so recording ids are remembered to write each once; False where every utterance is a
        recording of its own (Emilia's mp3s), so memory does not grow with the part."""
        from valle.data.recipe import _Writer

        self.part = part
        self.paths = part_manifest_paths(out_dir, prefix, part)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.recordings = _Writer(self.paths["recordings"])
        self.supervisions = _Writer(self.paths["supervisions"])
        self.report = V.ValidationReport()
        self.shared_recordings = shared_recordings
        self.recording_ids: set[str] = set()
        self.num_recordings = 0
        self.num_supervisions = 0
        self.seconds = 0.0

    def add_recording(self, recording: dict) -> None:
        """A recording dict (lhotse's ``Recording.to_dict()`` form), written the first time only."""
        if self.shared_recordings:
            if recording["id"] in self.recording_ids:
                return
            self.recording_ids.add(recording["id"])
        self.recordings.write(recording)
        self.num_recordings += 1

    def add_supervision(self, supervision: dict) -> None:
        self.supervisions.write(supervision)
        self.num_supervisions += 1
        self.seconds += float(supervision["duration"])

    def skip(self, item_id: str, reason: str, detail: str = "") -> None:
        self.report.add(item_id, reason, detail)

    def __enter__(self) -> PartManifestWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.recordings.discard()
            self.supervisions.discard()
            return
        self.report.checked = self.num_supervisions + len(self.report)
        self.report.write(self.paths["skipped"])
        self.recordings.finish()
        self.supervisions.finish()

    def summary(self) -> str:
        skipped = ", ".join(f"{reason} {n}" for reason, n in self.report.counts.items()) or "none"
        return (f"part {self.part}: {self.num_supervisions} utterances, {self.seconds / 3600:.3f} h, "
                f"{self.num_recordings} recordings -> {self.paths['supervisions'].parent}; "
                f"skipped: {skipped}" + (f" (listed in {self.paths['skipped']})" if len(self.report) else ""))

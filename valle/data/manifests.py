"""Reading lhotse manifests defensively: one cut per supervision, every bad item reported.

* A truncated or corrupt manifest stops with one line naming the file (``ManifestError``).
* Duplicate recording/supervision ids: the first is kept, each repeat is reported.
* A supervision whose recording is missing, a recording without supervisions, a segment
  outside its recording: reported, never silently dropped.
* A recording with several supervisions gives one cut per supervision (its time span).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

from valle.data import validation as V

logger = logging.getLogger(__name__)

# Tolerance for segments that end a little past their recording (rounding in manifests).
END_TOLERANCE_S = 0.025


class ManifestError(ValueError):
    """A manifest file that cannot be read (one line, naming the file)."""


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Items of a ``.jsonl``/``.jsonl.gz`` manifest; any read error names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"{path}: no such manifest")
    lineno = 0
    try:
        with _open_text(path) as f:
            for line in f:
                lineno += 1
                if line.strip():
                    yield json.loads(line)
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: truncated or corrupt after {lineno} good line(s) "
                            f"({type(e).__name__}: {e}); re-create it") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}:{lineno}: not a JSON line ({e}); re-create the manifest") from None


def _deserialize(path: Path, cls, report: V.ValidationReport) -> dict:
    """``id -> object`` for a recordings or supervisions manifest (first of duplicates kept)."""
    items: dict = {}
    for d in read_jsonl(path):
        item_id = d.get("id", "<no id>") if isinstance(d, dict) else "<not an object>"
        try:
            item = cls.from_dict(d)
        except Exception as e:  # lhotse raises TypeError/KeyError/ValueError on bad fields
            report.add(str(item_id), V.BAD_MANIFEST_ITEM, f"{path.name}: {type(e).__name__}: {e}"[:300])
            continue
        if item.id in items:
            report.add(item.id, V.DUPLICATE_ID, f"id repeated in {path.name} (the first is kept)")
            continue
        items[item.id] = item
    return items


class PartCuts:
    """The cuts of a part (one per supervision, in supervision order), streamed: recordings
    are indexed in memory, supervisions are read three times: a first pass finds repeated ids
    (8 bytes per supervision, freed after), a second checks them, reports problems to
    ``report`` and keeps only their count and a digest of their ids; iterating makes the cuts
    again, one at a time, so a part's cuts (or their ids) are never all in memory. Cut ids
    are supervision ids."""

    def __init__(self, rec_path: str | os.PathLike, sup_path: str | os.PathLike,
                 report: V.ValidationReport) -> None:
        import hashlib

        from lhotse import Recording

        self.rec_path, self.sup_path = Path(rec_path), Path(sup_path)
        self.recordings = _deserialize(self.rec_path, Recording, report)
        self.repeated_hashes = _repeated_id_hashes(self.sup_path)
        used: set[str] = set()
        digest, self.num_cuts = hashlib.sha1(), 0
        for cut in self._cuts(report, used):
            # the digest of "\n".join(ids), computed while streaming
            digest.update((("\n" if self.num_cuts else "") + cut.id).encode())
            self.num_cuts += 1
        self.ids_sha1 = digest.hexdigest()
        for rec_id in self.recordings.keys() - used:
            report.add(rec_id, V.NO_SUPERVISION, "recording without a supervision")

    def __len__(self) -> int:
        return self.num_cuts

    def __iter__(self) -> Iterator:
        return self._cuts(V.ValidationReport(), set())  # problems were reported by the first pass

    def _cuts(self, report: V.ValidationReport, used: set[str]) -> Iterator:
        from lhotse import SupervisionSegment
        from lhotse.cut import MonoCut
        from lhotse.utils import fastcopy

        seen: set[str] = set()  # only ids whose hash repeats: small
        for d in read_jsonl(self.sup_path):
            sup_id = str(d.get("id", "<no id>")) if isinstance(d, dict) else "<not an object>"
            try:
                sup = SupervisionSegment.from_dict(d)
            except Exception as e:  # lhotse raises TypeError/KeyError/ValueError on bad fields
                report.add(sup_id, V.BAD_MANIFEST_ITEM, f"{self.sup_path.name}: {type(e).__name__}: {e}"[:300])
                continue
            if hash(sup.id) in self.repeated_hashes:
                if sup.id in seen:
                    report.add(sup.id, V.DUPLICATE_ID, f"id repeated in {self.sup_path.name} (the first is kept)")
                    continue
                seen.add(sup.id)
            rec = self.recordings.get(sup.recording_id)
            if rec is None:
                report.add(sup.id, V.NO_RECORDING, f"recording {sup.recording_id!r} is not in {self.rec_path.name}")
                continue
            used.add(rec.id)
            if sup.start < 0 or sup.end > rec.duration + END_TOLERANCE_S:
                report.add(sup.id, V.BAD_SEGMENT, f"segment {sup.start:.2f}-{sup.end:.2f}s lies outside "
                                                  f"recording {rec.id} ({rec.duration:.2f}s)")
                continue
            # a supervision over several channels (a stereo file's, egs/custom) keeps them all:
            # its cut loads them, and bin/tokenizer.py tokenizes their mean
            duration = min(sup.duration, rec.duration - sup.start)
            yield MonoCut(id=sup.id, start=sup.start, duration=duration, channel=sup.channel, recording=rec,
                          supervisions=[fastcopy(sup, start=0.0, duration=duration)])


def _repeated_id_hashes(sup_path: Path) -> set[int]:
    """Hashes (this process's ``hash``) of the ids that occur more than once in a supervisions
    manifest: about 9 bytes per line while it runs (sorted in place), then only the repeats."""
    from array import array

    import numpy as np

    hashes = array("q", (hash(str(d.get("id", "<no id>")) if isinstance(d, dict) else "<not an object>")
                         for d in read_jsonl(sup_path)))
    if len(hashes) < 2:
        return set()
    view = np.frombuffer(hashes, dtype=np.int64)
    view.sort()
    repeated = {int(h) for h in view[1:][view[1:] == view[:-1]]}
    del view
    return repeated


def load_cuts(rec_path: str | os.PathLike, sup_path: str | os.PathLike,
              report: V.ValidationReport) -> PartCuts:
    """The cuts of a part (see ``PartCuts``); problems go to ``report``."""
    return PartCuts(rec_path, sup_path, report)


def supervision_text(sup) -> str:
    """The text to phonemize: ``custom["normalized_text"]`` when the corpus gives one (LJSpeech:
    "1839" is spoken "eighteen thirty-nine", which the normalised text spells out), else ``text``."""
    custom = sup.custom or {}
    text = custom.get("normalized_text") or sup.text or ""
    return text.strip()

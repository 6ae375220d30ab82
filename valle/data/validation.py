"""Input validation: one report line per bad item (cut id, reason), nothing crashes.

Used by bin/tokenizer.py (bad items are excluded from the tokenized cuts) and by the
datamodule (duration filters). Reasons are short stable keys; details say why.
"""

from __future__ import annotations

import json
import logging
import os
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from valle.data.scripts import (
    KANJI_READER_HINT,
    LATIN_SCRIPT_LANGUAGES,
    base_language,
    language_scripts,
    text_scripts,
)

logger = logging.getLogger(__name__)

# Reasons (stable keys: tests, reports and docs rely on them).
EMPTY_TEXT = "empty_text"
PHONEMIZE_FAILED = "phonemize_failed"
UNKNOWN_SYMBOLS = "unknown_symbols"
FOREIGN_SCRIPT = "foreign_script"
LANGUAGE_SWITCH = "language_switch"
TEXT_TOO_LONG = "text_too_long_for_audio"
UNREADABLE_AUDIO = "unreadable_audio"
ZERO_LENGTH_AUDIO = "zero_length_audio"
TOO_SHORT = "too_short"
TOO_LONG = "too_long"
NO_SUPERVISION = "no_supervision"
EXCEEDS_BATCH_BUDGET = "exceeds_batch_budget"
NO_RECORDING = "no_recording"
DUPLICATE_ID = "duplicate_id"
BAD_MANIFEST_ITEM = "bad_manifest_item"
BAD_SEGMENT = "segment_outside_recording"

# Phonemes (no word boundaries, no punctuation) per second of audio. Read speech runs at
# 10-18; 30 leaves room for fast speakers and tight trims while catching text that the
# audio cannot carry (spelled-out foreign characters, wrong transcripts).
DEFAULT_MAX_PHONES_PER_SECOND = 30.0


@dataclass
class ReportEntry:
    cut_id: str
    reason: str
    detail: str = ""


@dataclass
class ValidationReport:
    """Bad items found while preparing or loading data."""

    entries: list[ReportEntry] = field(default_factory=list)
    checked: int = 0

    def add(self, cut_id: str, reason: str, detail: str = "") -> None:
        self.entries.append(ReportEntry(cut_id, reason, detail))

    def extend(self, other: ValidationReport) -> None:
        self.entries.extend(other.entries)
        self.checked += other.checked

    @property
    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(e.reason for e in self.entries).items()))

    @property
    def bad_ids(self) -> set[str]:
        return {e.cut_id for e in self.entries}

    def __len__(self) -> int:
        return len(self.entries)

    def write(self, path: str | os.PathLike) -> None:
        """TSV (cut_id, reason, detail) or JSONL when the name ends with .jsonl; atomic."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            if path.suffix == ".jsonl":
                for e in self.entries:
                    f.write(json.dumps(asdict(e), ensure_ascii=False) + "\n")
            else:
                f.write("cut_id\treason\tdetail\n")
                for e in self.entries:
                    detail = e.detail.replace("\t", " ").replace("\n", " ")
                    f.write(f"{e.cut_id}\t{e.reason}\t{detail}\n")
        os.replace(tmp, path)

    @staticmethod
    def read(path: str | os.PathLike) -> ValidationReport:
        report = ValidationReport()
        path = Path(path)
        with open(path, encoding="utf-8") as f:
            if path.suffix == ".jsonl":
                for line in f:
                    report.entries.append(ReportEntry(**json.loads(line)))
            else:
                next(f, None)
                for line in f:
                    cut_id, reason, detail = (line.rstrip("\n").split("\t", 2) + [""])[:3]
                    report.add(cut_id, reason, detail)
        return report

    def summary(self) -> str:
        if not self.entries:
            return f"{self.checked} items checked, none bad"
        parts = ", ".join(f"{reason}: {n}" for reason, n in self.counts.items())
        return f"{self.checked} items checked, {len(self.entries)} bad ({parts})"


class NoCutsLeftError(ValueError):
    """The duration filters removed every cut."""


# ----------------------------------------------------------------------------- individual checks
def check_duration(duration: float, min_duration: float, max_duration: float) -> tuple[str, str] | None:
    if duration <= 0:
        return ZERO_LENGTH_AUDIO, f"duration {duration:.3f}s"
    if duration < min_duration:
        return TOO_SHORT, f"{duration:.2f}s < --filter-min-duration {min_duration:g}"
    if duration > max_duration:
        return TOO_LONG, f"{duration:.2f}s > --filter-max-duration {max_duration:g}"
    return None


@dataclass
class CutFilter:
    """The training filters, one implementation for both data sources: the duration bounds
    and a cut that fits a batch on its own. Picklable (it travels to DataLoader workers).
    ``problem`` names what is wrong (the manifest path records it in a report); calling the
    filter logs it (the Shar path streams, with no pass that could gather a report)."""

    min_duration: float
    max_duration: float
    constraint: Any  # valle.data.sampling.TextTokenConstraint: single_fits(cut), text_length(cut)
    budget_flags: str  # the flags that set the batch budget, named in the detail

    def problem(self, cut) -> tuple[str, str] | None:
        bad = check_duration(cut.duration, self.min_duration, self.max_duration)
        if bad is None and not self.constraint.single_fits(cut):
            bad = self._over_budget(cut.duration, self.constraint.text_length(cut))
        return bad

    def problem_of(self, duration: float, text_length: int) -> tuple[str, str] | None:
        """``problem`` of a cut known by its numbers (text tokens with bos/eos), as the
        extremes record and its sample hold them."""
        bad = check_duration(duration, self.min_duration, self.max_duration)
        if bad is None and not self.constraint.fits_sizes(1, duration, text_length):
            bad = self._over_budget(duration, text_length)
        return bad

    def _over_budget(self, duration: float, text_length: int) -> tuple[str, str]:
        return EXCEEDS_BATCH_BUDGET, f"{duration:.2f}s / {text_length} text tokens do not fit {self.budget_flags}"

    def __call__(self, cut) -> bool:
        bad = self.problem(cut)
        if bad is not None:
            logger.warning("cut %s removed: %s (%s)", cut.id, *bad)
        return bad is None

    def keeps(self, cut) -> bool:
        """The predicate without the log line (for cuts already reported)."""
        return self.problem(cut) is None


class ReportingFilter:
    """A ``CutFilter`` predicate that lists each cut it removes in ``report`` the first time it
    meets it (epochs meet them again): the removed cuts are reported as training streams the
    manifest, with no pass over it at start. Picklable."""

    def __init__(self, cut_filter: CutFilter, report: ValidationReport) -> None:
        self.cut_filter = cut_filter
        self.report = report
        self.reported: set[str] = set()

    def __call__(self, cut) -> bool:
        bad = self.cut_filter.problem(cut)
        if bad is None:
            return True
        if cut.id not in self.reported:
            self.reported.add(cut.id)
            self.report.add(cut.id, *bad)
        return False


def foreign_letters(text: str, language: str) -> list[str]:
    """Letters a Latin-script voice cannot read as words (CJK, Cyrillic, ...)."""
    if base_language(language) not in LATIN_SCRIPT_LANGUAGES:
        return []
    bad = []
    for ch in text:
        if ch.isalpha() and not unicodedata.name(ch, "").startswith("LATIN"):
            bad.append(ch)
    return bad


def _kanji_hint(text: str, language: str) -> str:
    """Why a Japanese text with kanji made the ja voice switch, where the reader is missing."""
    if base_language(language) != "ja" or "Han" not in text_scripts(text):
        return ""
    if "Han" in (language_scripts(language) or ()):
        return ""
    return f" (kanji: {KANJI_READER_HINT})"


def is_phone(symbol: str) -> bool:
    from valle.data.text import PUNCTUATION, WORD_SEP

    return symbol != WORD_SEP and symbol not in PUNCTUATION


def check_text_symbols(
    text: str,
    language: str,
    symbols: Sequence[str],
    switches: Sequence[str],
    duration: float,
    max_phones_per_second: float = DEFAULT_MAX_PHONES_PER_SECOND,
) -> tuple[str, str] | None:
    """Checks on phonemized text: empty output, foreign script, language switches, rate."""
    foreign = foreign_letters(text, language)
    if foreign:
        sample = "".join(dict.fromkeys(foreign))[:10]
        return FOREIGN_SCRIPT, f"{len(foreign)} letters the {language} voice cannot read ({sample!r})"
    if switches:
        return LANGUAGE_SWITCH, (f"espeak switched language to {sorted(set(switches))} under "
                                 f"{language}{_kanji_hint(text, language)}")
    phones = sum(1 for s in symbols if is_phone(s))
    if phones == 0:
        return EMPTY_TEXT, f"text {text[:40]!r} phonemizes to no phonemes"
    if duration > 0 and phones / duration > max_phones_per_second:
        return TEXT_TOO_LONG, (
            f"{phones} phonemes in {duration:.2f}s = {phones / duration:.1f}/s "
            f"> --max-phones-per-second {max_phones_per_second:g}"
        )
    return None


def check_known_symbols(symbols: Iterable[str], table) -> tuple[str, str] | None:
    missing = sorted({s for s in symbols if s not in table})
    if missing:
        return UNKNOWN_SYMBOLS, f"not in the symbol table: {missing[:10]}"
    return None


# ----------------------------------------------------------------------------- duration filters
def filter_by_duration(
    cuts: Iterable, min_duration: float, max_duration: float, report: ValidationReport
) -> Iterator:
    """Yield cuts within [min, max]; record every removed cut in ``report``. Lazy."""
    for cut in cuts:
        report.checked += 1
        bad = check_duration(cut.duration, min_duration, max_duration)
        if bad is None:
            yield cut
        else:
            report.add(cut.id, *bad)


def raise_if_nothing_left(
    kept: int, report: ValidationReport, min_duration: float, max_duration: float, what: str = "cuts"
) -> None:
    """Stop with a message naming the filter(s) that removed everything."""
    if kept > 0:
        return
    raise_nothing_left(report.counts, report.checked, min_duration, max_duration, what)


def raise_nothing_left(counts: dict[str, int], total: int, min_duration: float, max_duration: float,
                       what: str = "cuts") -> None:
    """The error of ``raise_if_nothing_left`` from counts per reason (``total`` checked)."""
    flags = {
        TOO_SHORT: f"--filter-min-duration {min_duration:g}",
        TOO_LONG: f"--filter-max-duration {max_duration:g}",
        ZERO_LENGTH_AUDIO: "the zero-duration check",
    }
    if total == 0:
        raise NoCutsLeftError(f"no {what} to filter: the manifest is empty")
    named = [(flags.get(r, r), n) for r, n in counts.items()]
    if len(named) == 1:
        flag, n = named[0]
        raise NoCutsLeftError(f"{flag} removed all {n} {what}")
    detail = ", ".join(f"{flag} removed {n}" for flag, n in named)
    raise NoCutsLeftError(f"the filters removed all {total} {what}: {detail}")

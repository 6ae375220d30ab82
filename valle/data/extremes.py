"""The extremes record: a bounded, mergeable summary of what tokenization saw in a part.

The trainer's pessimistic OOM scan needs the worst batches the sampler can form, and the
bucketing sampler needs duration bins from a sample of the corpus. Both used to come from a
pass over the whole manifest at every start (30 minutes on every rank at ~10M cuts). The
tokenizer sees every cut anyway, so it keeps this record and writes it next to the cuts file
(``extremes_path``); training reads it instead of the manifest.

What it keeps, per duration bin of ``BIN_SECONDS`` (so the trainer's own duration filters,
which it only knows at start, cut the record exactly where they cut the corpus):

* ``longest``: the ``k`` longest cuts (audio: single_longest_cut, largest_batch_cuts_duration);
* ``longest_text``: the ``k`` cuts with the most text tokens (single_longest_text);
* ``densest``: the ``k`` cuts with the most text tokens per second (largest_batch_text_tokens);
* ``shortest``: the ``k`` shortest cuts (max_num_cuts: the most cuts per batch);

as full lhotse cut dicts, plus a uniform sample of at most ``sample_size`` (duration, text
tokens) pairs for bucket boundaries: the cuts whose id hashes lowest (a bottom-k sample, so
the sample of merged records is the sample of the union), plus the count and total seconds.

Every choice is by a total order (value, then cut id), so ``merge`` gives the same record
whatever the order of the merges: chunks, parts and workers can be merged in any order.
Memory and file size are bounded by bins x 4 x k cuts plus the sample, not by the corpus.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERSION = 1
BIN_SECONDS = 0.5  # duration bin width: a training duration filter lands inside one bin
MAX_BINS = 480  # 240 s; longer cuts share the last bin
DEFAULT_K = 4  # cuts kept per criterion per bin
DEFAULT_SAMPLE_SIZE = 8192  # (duration, text tokens) pairs for bucket boundaries
EXTRA_TOKENS = 2  # bos + eos, as the collater and the sampler count them


def extremes_path(out_dir: Path, prefix: str, part: str) -> Path:
    """``{out_dir}/{prefix}_extremes_{part}.json``: written next to the part's cuts file (and
    into a Shar directory under the same name)."""
    return Path(out_dir) / f"{prefix}_extremes_{part}.json"


@dataclass(frozen=True)
class Entry:
    """One cut the record keeps: the numbers the criteria rank by, and the cut itself."""

    cut_id: str
    duration: float
    text_tokens: int
    cut: dict[str, Any]

    @property
    def text_rate(self) -> float:
        """Text tokens (bos/eos included) per second of audio."""
        return (self.text_tokens + EXTRA_TOKENS) / max(self.duration, 1e-3)


# Each criterion ranks entries by a key; the record keeps the k smallest keys per bin. The
# cut id ends every key, so ties break the same way in every merge order.
CRITERIA: dict[str, Callable[[Entry], tuple]] = {
    "longest": lambda e: (-e.duration, -e.text_tokens, e.cut_id),
    "longest_text": lambda e: (-e.text_tokens, -e.duration, e.cut_id),
    "densest": lambda e: (-e.text_rate, -e.duration, e.cut_id),
    "shortest": lambda e: (e.duration, -e.text_tokens, e.cut_id),
}


def duration_bin(duration: float) -> int:
    return min(MAX_BINS - 1, max(0, int(duration / BIN_SECONDS)))


def sample_key(cut_id: str) -> int:
    """A stable pseudo-random number per cut id (the same in every process and run)."""
    return int.from_bytes(hashlib.blake2b(cut_id.encode(), digest_size=8).digest(), "big")


@dataclass
class Bin:
    """The cuts kept for one duration bin: per criterion, the k best entries, sorted."""

    count: int = 0
    best: dict[str, list[Entry]] = field(default_factory=lambda: {name: [] for name in CRITERIA})

    def wants(self, name: str, entry: Entry, k: int) -> bool:
        kept = self.best[name]
        return len(kept) < k or CRITERIA[name](entry) < CRITERIA[name](kept[-1])

    def offer(self, name: str, entry: Entry, k: int) -> None:
        kept = self.best[name]
        if any(e.cut_id == entry.cut_id for e in kept):
            return
        kept.append(entry)
        kept.sort(key=CRITERIA[name])
        del kept[k:]


@dataclass
class Extremes:
    """See the module docstring. ``add`` takes a tokenized lhotse cut."""

    k: int = DEFAULT_K
    sample_size: int = DEFAULT_SAMPLE_SIZE
    count: int = 0
    microseconds: int = 0  # total audio; an integer, so sums do not depend on merge order
    bins: dict[int, Bin] = field(default_factory=dict)
    sample: list[tuple[int, float, int]] = field(default_factory=list)  # (key, duration, tokens)
    _sample_cutoff: tuple[int, float, int] | None = field(default=None, repr=False, compare=False)

    # ---- building ------------------------------------------------------------------------
    def add(self, cut) -> None:
        from valle.data.collation import num_text_tokens  # torch: not for add_dict's light callers

        self._add(cut.id, cut.duration, num_text_tokens(cut), cut.to_dict)

    def add_dict(self, cut: dict[str, Any]) -> None:
        """``add`` for a cut as its manifest line holds it (the recipe steps stream JSON, with
        neither lhotse nor torch): a line lhotse wrote is the ``to_dict`` of the cut it loads."""
        self._add(cut["id"], cut["duration"], _dict_text_tokens(cut), lambda: cut)

    def _add(self, cut_id: str, duration: float, tokens: int, to_dict: Callable[[], dict]) -> None:
        self.count += 1
        self.microseconds += round(duration * 1e6)
        self._add_sample((sample_key(cut_id), float(duration), tokens))
        probe = Entry(cut_id, float(duration), tokens, {})
        b = self.bins.setdefault(duration_bin(duration), Bin())
        b.count += 1
        wanted = [name for name in CRITERIA if b.wants(name, probe, self.k)]
        if wanted:  # the dict is made only for cuts that are kept
            entry = Entry(cut_id, float(duration), tokens, to_dict())
            for name in wanted:
                b.offer(name, entry, self.k)

    def _add_sample(self, item: tuple[int, float, int]) -> None:
        if self._sample_cutoff is not None and item >= self._sample_cutoff:
            return  # the sample is full of lower keys: this one can never enter
        self.sample.append(item)
        if len(self.sample) > 2 * self.sample_size:  # trim now and then, not at every add
            self._trim_sample()

    def _trim_sample(self) -> None:
        self.sample = sorted(set(self.sample))[: self.sample_size]
        self._sample_cutoff = self.sample[-1] if len(self.sample) == self.sample_size else None

    def merge(self, other: Extremes) -> Extremes:
        """Fold ``other`` into this record (in place; returns self). Order-independent."""
        if (self.k, self.sample_size) != (other.k, other.sample_size):
            raise ValueError(f"extremes records of different sizes cannot be merged: k {self.k} vs "
                             f"{other.k}, sample {self.sample_size} vs {other.sample_size}")
        self.count += other.count
        self.microseconds += other.microseconds
        for index, theirs in other.bins.items():
            mine = self.bins.setdefault(index, Bin())
            mine.count += theirs.count
            for name, entries in theirs.best.items():
                for entry in entries:
                    mine.offer(name, entry, self.k)
        self.sample += other.sample
        self._trim_sample()
        return self

    @classmethod
    def of(cls, cuts: Iterable, **sizes: int) -> Extremes:
        record = cls(**sizes)
        for cut in cuts:
            record.add(cut)
        return record

    # ---- reading -------------------------------------------------------------------------
    @property
    def seconds(self) -> float:
        return self.microseconds / 1e6

    def entries(self, name: str) -> list[Entry]:
        """Every entry kept for criterion ``name``, best first across bins."""
        out = [e for b in self.bins.values() for e in b.best[name]]
        return sorted(out, key=CRITERIA[name])

    def all_entries(self) -> list[Entry]:
        """Each kept cut once, in id order."""
        seen = {e.cut_id: e for b in self.bins.values() for es in b.best.values() for e in es}
        return [seen[i] for i in sorted(seen)]

    def sample_pairs(self) -> list[tuple[float, int]]:
        """The bounded sample as (duration, text tokens), in sample-key order."""
        self._trim_sample()
        return [(d, t) for _key, d, t in self.sample]

    # ---- files ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        self._trim_sample()
        cuts = {e.cut_id: e.cut for e in self.all_entries()}
        return {
            "version": VERSION, "k": self.k, "sample_size": self.sample_size,
            "bin_seconds": BIN_SECONDS, "count": self.count, "microseconds": self.microseconds,
            "bins": {str(i): {"count": b.count,
                              **{name: [e.cut_id for e in b.best[name]] for name in CRITERIA}}
                     for i, b in sorted(self.bins.items())},
            "cuts": cuts,
            "sample": [list(s) for s in self.sample],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Extremes:
        if data.get("version") != VERSION or data.get("bin_seconds") != BIN_SECONDS:
            raise ValueError(f"extremes record version {data.get('version')} / bins of "
                             f"{data.get('bin_seconds')} s: this build reads version {VERSION} "
                             f"with bins of {BIN_SECONDS} s (rewrite it: bin/tokenizer.py --extremes-only)")
        entries = {cut_id: Entry(cut_id, float(d["duration"]), _dict_text_tokens(d), d)
                   for cut_id, d in data["cuts"].items()}
        record = cls(k=int(data["k"]), sample_size=int(data["sample_size"]),
                     count=int(data["count"]), microseconds=int(data["microseconds"]))
        for index, d in data["bins"].items():
            b = record.bins[int(index)] = Bin(count=int(d["count"]))
            for name in CRITERIA:
                b.best[name] = sorted((entries[i] for i in d[name]), key=CRITERIA[name])
        record.sample = [(int(k), float(dur), int(t)) for k, dur, t in data["sample"]]
        record._trim_sample()
        return record

    def write(self, path: Path) -> None:
        """Atomic: a reader never sees half a record."""
        import os

        path = Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> Extremes:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{path}: not an extremes record ({e})") from None
        try:
            return cls.from_json(data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: not an extremes record (missing {e})") from None


def _dict_text_tokens(cut: dict[str, Any]) -> int:
    """num_text_tokens of a cut dict, as ``collation.num_text_tokens`` reads a cut."""
    custom = (cut.get("supervisions") or [{}])[0].get("custom") or {}
    if "num_text_tokens" in custom:
        return int(custom["num_text_tokens"])
    return len(custom["tokens"]["text"])

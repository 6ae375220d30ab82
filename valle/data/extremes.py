"""The extremes record: a bounded, mergeable summary of what tokenization saw in a part.

The trainer's pessimistic OOM scan needs the worst batches the sampler can form, and the
bucketing sampler needs duration bins from a sample of the corpus. Both used to come from a
pass over the whole manifest at every start (30 minutes on every rank at ~10M cuts). The
tokenizer sees every cut anyway, so it keeps this record and writes it next to the cuts file
(``extremes_path``); training reads it instead of the manifest.

A cut is two numbers here, its duration d and its text tokens t. Per duration bin of
``BIN_SECONDS`` (so the trainer's own duration filters, known only at start, cut the record
where they cut the corpus), the record keeps three Pareto frontiers, as full cut dicts:

* ``longest``: no other cut of the bin is at least as long with at most as much text
  (the longest cut, and for each shorter length the least text: long audio, packed);
* ``longest_text``: no other cut has at least as much text in at most as much audio
  (the longest text, and the densest text for each length of text);
* ``shortest``: no other cut is at most as long with at most as much text (the most cuts
  per batch).

Every score of a batch made of copies of one cut that grows with d and shrinks with t (or
the reverse, or shrinks with both) is highest on one of these frontiers, which is what the
pessimistic batches need (``valle.data.pessimistic``). A frontier is a function of the set of
cuts, so ``merge`` (the frontier of the union) gives the same record in any merge order:
chunks, parts and workers merge freely. Its size is the number of steps of a staircase: at
most the distinct text lengths in a bin, in practice a handful (about log n for n cuts).

Plus a uniform sample of at most ``sample_size`` (duration, text tokens) pairs for bucket
boundaries: the cuts whose id hashes lowest (a bottom-k sample, so the sample of merged
records is the sample of the union), and the count and total audio.
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
DEFAULT_SAMPLE_SIZE = 8192  # (duration, text tokens) pairs for bucket boundaries
EXTRA_TOKENS = 2  # bos + eos, as the collater and the sampler count them


def extremes_path(out_dir: Path, prefix: str, part: str) -> Path:
    """``{out_dir}/{prefix}_extremes_{part}.json``: written next to the part's cuts file (and
    into a Shar directory under the same name)."""
    return Path(out_dir) / f"{prefix}_extremes_{part}.json"


def extremes_path_of(cuts_path: Path) -> Path | None:
    """The record's path for a cuts file named ``{prefix}_cuts_{part}.jsonl.gz`` (None for
    another name: no trainer looks for its record). A record is written or rewritten with
    ``python -m valle.data.recipe extremes CUTS`` (one pass over the cuts file)."""
    name = Path(cuts_path).name
    if "_cuts_" not in name or not name.endswith(".jsonl.gz"):
        return None
    prefix, part = name[: -len(".jsonl.gz")].rsplit("_cuts_", 1)
    return extremes_path(Path(cuts_path).parent, prefix, part)


@dataclass(frozen=True)
class Entry:
    """One cut the record keeps: the numbers the frontiers are made of, and the cut itself."""

    cut_id: str
    duration: float
    text_tokens: int
    cut: dict[str, Any]


# Per frontier, the two numbers it maximises (a cut stays unless another is at least as good
# in both). The cut id breaks exact ties, so the frontier depends on the set of cuts only.
FRONTIERS: dict[str, Callable[[Entry], tuple[float, float]]] = {
    "longest": lambda e: (e.duration, -e.text_tokens),
    "longest_text": lambda e: (e.text_tokens, -e.duration),
    "shortest": lambda e: (-e.duration, -e.text_tokens),
}


def frontier(entries: Iterable[Entry], name: str) -> list[Entry]:
    """The Pareto frontier of ``entries`` under ``FRONTIERS[name]``, best first."""
    goal = FRONTIERS[name]
    out: list[Entry] = []
    for e in sorted(entries, key=lambda e: (-goal(e)[0], -goal(e)[1], e.cut_id)):
        if not out or goal(e)[1] > goal(out[-1])[1]:
            out.append(e)
    return out


def dominated(entry: Entry, kept: list[Entry], name: str) -> bool:
    """Is ``entry`` off the frontier ``kept`` (or an exact tie with a smaller cut id)?"""
    goal = FRONTIERS[name]
    g = goal(entry)
    for other in kept:
        o = goal(other)
        if o[0] >= g[0] and o[1] >= g[1] and (o != g or other.cut_id <= entry.cut_id):
            return True
    return False


def duration_bin(duration: float) -> int:
    return min(MAX_BINS - 1, max(0, int(duration / BIN_SECONDS)))


def bin_start(index: int) -> float:
    return index * BIN_SECONDS


def sample_key(cut_id: str) -> int:
    """A stable pseudo-random number per cut id (the same in every process and run)."""
    return int.from_bytes(hashlib.blake2b(cut_id.encode(), digest_size=8).digest(), "big")


@dataclass
class Bin:
    """The cuts kept for one duration bin: its frontiers, best first."""

    count: int = 0
    best: dict[str, list[Entry]] = field(default_factory=lambda: {name: [] for name in FRONTIERS})

    def offer(self, name: str, entry: Entry) -> None:
        if not dominated(entry, self.best[name], name):
            self.best[name] = frontier(self.best[name] + [entry], name)


@dataclass
class Extremes:
    """See the module docstring. ``add`` takes a tokenized lhotse cut."""

    sample_size: int = DEFAULT_SAMPLE_SIZE
    count: int = 0
    microseconds: int = 0  # total audio; an integer, so sums do not depend on merge order
    bins: dict[int, Bin] = field(default_factory=dict)
    sample: list[tuple[int, float, int]] = field(default_factory=list)  # (key, duration, tokens)
    _sample_cutoff: tuple[int, float, int] | None = field(default=None, repr=False, compare=False)

    # ---- building ------------------------------------------------------------------------
    def add(self, cut) -> None:
        """A tokenized lhotse cut."""
        # Imported here: collation needs torch, which the dict-only recipe steps do not load.
        from valle.data.collation import num_text_tokens

        self._add(cut.id, float(cut.duration), num_text_tokens(cut), cut.to_dict)

    def add_dict(self, cut: dict[str, Any]) -> None:
        """A tokenized cut as its manifest line's dict (the recipe steps read no lhotse)."""
        self._add(cut["id"], float(cut["duration"]), _dict_text_tokens(cut), lambda: cut)

    def _add(self, cut_id: str, duration: float, tokens: int, as_dict: Callable[[], dict]) -> None:
        self.count += 1
        self.microseconds += round(duration * 1e6)
        self._add_sample((sample_key(cut_id), duration, tokens))
        probe = Entry(cut_id, duration, tokens, {})
        b = self.bins.setdefault(duration_bin(duration), Bin())
        b.count += 1
        wanted = [name for name in FRONTIERS if not dominated(probe, b.best[name], name)]
        if wanted:  # the dict is made only for cuts that are kept
            entry = Entry(cut_id, duration, tokens, as_dict())
            for name in wanted:
                b.offer(name, entry)

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
        if self.sample_size != other.sample_size:
            raise ValueError(f"extremes records with samples of {self.sample_size} and "
                             f"{other.sample_size} cannot be merged")
        self.count += other.count
        self.microseconds += other.microseconds
        for index, theirs in other.bins.items():
            mine = self.bins.setdefault(index, Bin())
            mine.count += theirs.count
            for name, entries in theirs.best.items():
                for entry in entries:
                    mine.offer(name, entry)
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
        """The frontier ``name`` across bins, best first."""
        out = [e for b in self.bins.values() for e in b.best[name]]
        return frontier(out, name)

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
            "version": VERSION, "sample_size": self.sample_size,
            "bin_seconds": BIN_SECONDS, "count": self.count, "microseconds": self.microseconds,
            "bins": {str(i): {"count": b.count,
                              **{name: [e.cut_id for e in b.best[name]] for name in FRONTIERS}}
                     for i, b in sorted(self.bins.items())},
            "cuts": cuts,
            "sample": [list(s) for s in self.sample],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Extremes:
        if data.get("version") != VERSION or data.get("bin_seconds") != BIN_SECONDS:
            raise ValueError(f"extremes record version {data.get('version')} / bins of "
                             f"{data.get('bin_seconds')} s: this build reads version {VERSION} "
                             f"with bins of {BIN_SECONDS} s (rewrite it: python -m valle.data.recipe extremes CUTS)")
        entries = {cut_id: Entry(cut_id, float(d["duration"]), _dict_text_tokens(d), d)
                   for cut_id, d in data["cuts"].items()}
        record = cls(sample_size=int(data["sample_size"]),
                     count=int(data["count"]), microseconds=int(data["microseconds"]))
        for index, d in data["bins"].items():
            b = record.bins[int(index)] = Bin(count=int(d["count"]))
            for name in FRONTIERS:
                b.best[name] = frontier((entries[i] for i in d[name]), name)
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

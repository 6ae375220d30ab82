"""TtsDataModule: lazy tokenized manifests -> filtered cuts -> bucketing sampler -> batches.

Start-up reads no more of a part than its extremes record (``valle.data.extremes``, written
by bin/tokenizer.py next to the cuts file): the bucket bins come from its bounded sample, an
empty result is caught from its duration bins, the pessimistic batches from its worst cuts
(``valle.data.pessimistic``), and the cuts the filters remove are listed as training meets
them. A part without a record (tokenized by an older version) gets the old pass over its
manifest, with a warning saying how to write the record.

Mid-epoch resume: the state is (epoch, batches consumed by the trainer, world size, seed).
Restoring rebuilds the same sampler, sets the epoch and skips the consumed batches without
loading any features, so no cut is repeated or skipped (``valle.data.loader``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from valle.config_flags import add_flags, flag, from_namespace
from valle.data import validation as V
from valle.data.loader import ManifestLoader, ResumableLoader

logger = logging.getLogger(__name__)

# --max-text-tokens auto = ceil(TEXT_BUDGET_MARGIN x rate x --max-duration), rate = the
# corpus's 99th-percentile text tokens per second (bos/eos included) measured by
# bin/tokenizer.py ({dataset}_text_stats.json), else DEFAULT_TEXT_TOKENS_PER_SECOND
# (English read speech: ~12 phonemes/s + word boundaries and punctuation ~ 16/s; 25 covers
# fast speakers and short cuts whose bos/eos weigh more).
TEXT_BUDGET_MARGIN = 1.25
DEFAULT_TEXT_TOKENS_PER_SECOND = 25.0


def parse_max_duration(v: str) -> float | str:
    """Seconds of audio per batch, or ``auto`` (the trainer measures what fits in memory)."""
    if v.lower() == "auto":
        return "auto"
    try:
        seconds = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-duration: expected auto or seconds, got {v!r}") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"--max-duration must be > 0, got {v}")
    return seconds


def parse_max_text_tokens(v: str) -> int | str | None:
    """``auto`` (default), a positive int, or ``off``/``none``/``0`` (no text budget)."""
    if v.lower() == "auto":
        return "auto"
    if v.lower() in ("off", "none", "0"):
        return None
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-text-tokens: expected auto, off or an integer, got {v!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"--max-text-tokens must be >= 0, got {n}")
    return n


def text_tokens_rate(manifest_dir: Path, dataset: str) -> tuple[float, str]:
    """(text tokens per second, where it came from) for the --max-text-tokens default."""
    import json

    path = Path(manifest_dir) / f"{dataset}_text_stats.json"
    try:
        rate = float(json.loads(path.read_text())["total"]["text_tokens_per_second_p99"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_TEXT_TOKENS_PER_SECOND, f"the default {DEFAULT_TEXT_TOKENS_PER_SECOND:g}/s ({path} not found)"
    if rate <= 0:
        return DEFAULT_TEXT_TOKENS_PER_SECOND, f"the default {DEFAULT_TEXT_TOKENS_PER_SECOND:g}/s ({path} is empty)"
    return rate, f"p99 of {path.name}"


DATA_GROUP = "data"
DATA_GROUP_DESCRIPTIONS = {DATA_GROUP: "tokenized lhotse manifests and batching"}


def _data(default: Any, help: str | None = None, **spec: Any) -> Any:
    return flag(default, help, group=DATA_GROUP, **spec)


@dataclass
class DataConfig:
    """The corpus and batching flags (bin/trainer.py's data group), declared once here."""

    manifest_dir: Path = _data(Path("data/tokenized"))
    dataset: str = _data("libritts", "prefix of the cut files ({dataset}_cuts_train...)")
    train_part: str = _data("train")
    valid_part: str = _data("dev")
    text_tokens: Path | None = _data(
        None, "symbol table (default: {manifest-dir}/unique_text_tokens.k2symbols)")
    # "auto": the trainer measures the largest that fits (valle/train/autobatch.py), then a number
    max_duration: float | str = _data(
        40.0, "seconds of audio per batch (padded), or auto: the largest that fits the device's "
        "memory, measured before training (docs/oom.md)", parse=parse_max_duration)
    # "auto" until the data module resolves it (a number, or None: no text budget)
    max_text_tokens: int | str | None = _data(
        "auto", "padded text tokens per batch: auto (default: from --max-duration and the "
        "corpus's text tokens per second, see docs/data.md), N, or off",
        parse=parse_max_text_tokens)
    filter_min_duration: float = _data(0.0)
    filter_max_duration: float = _data(20.0)
    num_buckets: int = _data(10)
    quadratic_duration: float | None = _data(
        None, "effective duration d + d^2/q (15-40 for transformers)")
    shuffle: bool = _data(True, switch=True, negation="--no-shuffle")
    buffer_size: int = _data(40000)
    drop_last: bool = _data(False)
    num_workers: int = _data(2)
    max_prompt_duration: float = _data(
        3.0, "prompt seconds: --prefix-mode 4 cuts a neighbouring utterance to this")
    # the flag's comma-separated voices; the resolved list once the data module read them
    languages: str | list[str] | None = _data(
        None, "VALL-E X (--num-languages > 0): the espeak voices in language-id order, "
        "comma-separated (en-us,cmn); default: the voices bin/tokenizer.py "
        "recorded in {dataset}_text_stats.json, sorted. Saved in checkpoints", parse=str)
    shar_dir: str | None = _data(
        None, "train from Lhotse Shar shards in this directory (comma-separated for "
        "several), dealt per rank and per DataLoader worker; validation still "
        "reads {manifest-dir}/{dataset}_cuts_{valid-part}")


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, DataConfig, DATA_GROUP_DESCRIPTIONS)


def resolve_max_text_tokens(cfg: DataConfig) -> int | None:
    """Turn ``--max-text-tokens auto`` into a number (stored back into ``cfg``) and log it."""
    value = cfg.max_text_tokens
    if value == "auto":
        rate, source = text_tokens_rate(cfg.manifest_dir, cfg.dataset)
        value = math.ceil(TEXT_BUDGET_MARGIN * rate * cfg.max_duration)
        logger.info("--max-text-tokens %d = %g x %.1f text tokens/s (%s) x --max-duration %g",
                    value, TEXT_BUDGET_MARGIN, rate, source, cfg.max_duration)
    elif value is None:
        logger.warning("--max-text-tokens off: batches count audio seconds only (text that "
                       "phonemizes into long sequences is not bounded)")
    else:
        logger.info("--max-text-tokens %d", value)
    cfg.max_text_tokens = value
    return value


class TtsDataModule:
    """Builds train/valid loaders from ``{manifest_dir}/{dataset}_cuts_{train,dev}.jsonl.gz``.

    ``cfg``: the data flags (its ``max_text_tokens`` "auto" is resolved in place); ``seed``
    (the sampler's), ``num_languages`` and ``prefix_mode``: the run's and the model's."""

    def __init__(self, cfg: DataConfig, *, seed: int = 0, num_languages: int = 0,
                 prefix_mode: int = 0) -> None:
        self.cfg = cfg
        self.seed, self.num_languages, self.prefix_mode = seed, num_languages, int(prefix_mode)
        if cfg.max_duration == "auto":
            raise ValueError("--max-duration auto: the trainer chooses the number (bin/trainer.py); "
                             "here give seconds")
        if cfg.max_text_tokens == "auto":
            resolve_max_text_tokens(cfg)
        self.filter_report = V.ValidationReport()
        self._kept: dict[str, int] = {}  # cuts the filters kept, per part read with a pass
        self._extremes: dict[str, Any] = {}  # part -> its Extremes record, or None
        self._train_loader: ResumableLoader | None = None
        self._languages: list[str] | None = None  # resolved once by languages()

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> TtsDataModule:
        """From parsed flags: the data group's, and --seed, --num-languages, --prefix-mode
        where the parser has them."""
        return cls(from_namespace(DataConfig, args), seed=getattr(args, "seed", 0) or 0,
                   num_languages=getattr(args, "num_languages", 0) or 0,
                   prefix_mode=getattr(args, "prefix_mode", 0) or 0)

    # ---- helpers -----------------------------------------------------------
    def codec_identity(self) -> dict | None:
        """The corpus's codec record with the fitted state's sha256 (checkpoints keep it, so
        inference refuses a codec refitted since: valle/codec)."""
        from valle.codec import codec_identity

        return codec_identity(self.cfg.manifest_dir)

    def languages(self) -> list[str] | None:
        """VALL-E X: the espeak voices in language-id order (None without --num-languages)."""
        n = self.num_languages
        if n <= 0:
            return None
        if self._languages is not None:
            return self._languages
        from valle.data.languages import split_languages

        languages = split_languages(self.cfg.languages)
        if not languages:
            from valle.data.pipeline import text_stats_path

            stats = text_stats_path(self.cfg.manifest_dir, self.cfg.dataset)
            if not stats.is_file():
                raise FileNotFoundError(f"--num-languages {n}: no --languages and no {stats} to read "
                                        "them from (run bin/tokenizer.py, or pass --languages en-us,cmn)")
            recorded = json.loads(stats.read_text())["total"].get("languages", {})
            languages = sorted(v for v, d in recorded.items() if d.get("cuts", 0) > 0)
        if len(set(languages)) != len(languages):
            raise ValueError(f"--languages {','.join(languages)}: a language is listed twice")
        if not languages or len(languages) > n:
            raise ValueError(f"--num-languages {n} but {len(languages)} languages "
                             f"({','.join(languages)}): give --num-languages >= the number of languages")
        self._languages = languages
        return languages

    def text_tokens_path(self) -> Path:
        path = self.cfg.text_tokens or Path(self.cfg.manifest_dir) / "unique_text_tokens.k2symbols"
        if not Path(path).is_file():
            raise FileNotFoundError(f"--text-tokens {path}: no such symbol table (run bin/tokenizer.py)")
        return Path(path)

    def cuts_path(self, part: str) -> Path:
        path = Path(self.cfg.manifest_dir) / f"{self.cfg.dataset}_cuts_{part}.jsonl.gz"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such cut manifest (check --manifest-dir and --dataset)")
        return path

    def constraint(self):
        from valle.data.sampling import TextTokenConstraint

        return TextTokenConstraint(
            max_duration=self.cfg.max_duration,
            quadratic_duration=self.cfg.quadratic_duration,
            max_text_tokens=self.cfg.max_text_tokens,
        )

    def cut_filter(self) -> V.CutFilter:
        flags = f"--max-duration {self.cfg.max_duration:g} / --max-text-tokens {self.cfg.max_text_tokens}"
        return V.CutFilter(self.cfg.filter_min_duration, self.cfg.filter_max_duration, self.constraint(), flags)

    def extremes(self, part: str):
        """The part's extremes record, or None (none written, or older than the cuts file:
        the cuts changed since; said in a warning naming the command that writes it)."""
        if part in self._extremes:
            return self._extremes[part]
        from valle.data.extremes import Extremes, extremes_path

        path = extremes_path(self.cfg.manifest_dir, self.cfg.dataset, part)
        cuts = self.cuts_path(part)
        record = None
        if path.is_file() and path.stat().st_mtime >= cuts.stat().st_mtime:
            record = Extremes.read(path)
        else:
            why = "is older than the cuts file" if path.is_file() else "does not exist"
            logger.warning("%s %s (a corpus tokenized before bin/tokenizer.py wrote it, or cuts edited "
                           "since): start-up makes a pass over %s instead (slow for a large part); "
                           "write it once with: python -m valle.data.recipe extremes %s",
                           path, why, cuts.name, cuts)
        self._extremes[part] = record
        return record

    def load_cuts(self, part: str):
        """Lazy cuts of ``part`` filtered by duration and by the batch budget. Every removed cut
        is recorded in ``self.filter_report`` (written next to the checkpoints by the trainer)
        as the sampler meets it. An empty result stops here with the name of the filter, when
        the extremes record shows it (its duration bins: no pass), else as an empty epoch."""
        from lhotse import CutSet

        cuts = CutSet.from_jsonl_lazy(self.cuts_path(part))
        cut_filter = self.cut_filter()
        record = self.extremes(part)
        what = f"cuts of {self.cfg.dataset} {part}"
        if record is None:
            return cuts.filter(self._count_kept(part, cuts, cut_filter, what))
        if not any(cut_filter.problem_of(e.duration, e.text_tokens + cut_filter.constraint.extra_tokens) is None
                   for e in record.all_entries()):
            _raise_if_bins_all_removed(record, cut_filter, what)
        self.filter_report.checked += record.count
        return cuts.filter(V.ReportingFilter(cut_filter, self.filter_report))

    def _count_kept(self, part: str, cuts, cut_filter: V.CutFilter, what: str):
        """Without a record: a pass over the manifest counts and reports what the filters
        keep (the sampler's bucket count needs the number). Returns the predicate to apply."""
        report = V.ValidationReport()
        kept = 0
        for cut in cuts:
            report.checked += 1
            bad = cut_filter.problem(cut)
            if bad is None:
                kept += 1
            else:
                report.add(cut.id, *bad)
        if report.entries:
            logger.warning("%s: filters removed %d of %d cuts (%s)", part, len(report), report.checked,
                           report.counts)
        V.raise_if_nothing_left(kept, report, cut_filter.min_duration, cut_filter.max_duration, what=what)
        self.filter_report.extend(report)
        self._kept[part] = kept
        return cut_filter.keeps

    def bucketing(self, part: str, constraint) -> dict[str, Any]:
        """The sampler's bucket arguments: bins from the record's sample of the part (the
        cuts the filters keep), else lhotse's estimate from the manifest's first cuts."""
        record = self.extremes(part)
        if record is None:
            # lhotse refuses more buckets than cuts (a small dev set); one bucket below two cuts.
            buckets = min(self.cfg.num_buckets, self._kept[part])
            return {"num_buckets": buckets} if buckets >= 2 else {"duration_bins": [1e9]}
        return {"duration_bins": self._sample_bins(record, constraint)}

    def _sample_bins(self, record, constraint) -> list[float]:
        from valle.data.sampling import bucket_bins

        cut_filter = self.cut_filter()
        durations = [d for d, t in record.sample_pairs()
                     if cut_filter.problem_of(d, t + constraint.extra_tokens) is None]
        return bucket_bins(durations, self.cfg.num_buckets, constraint)

    def train_extremes(self):
        """The training data's extremes record: the train part's, or with --shar-dir the
        records in the Shar directories merged (read once); None without one."""
        if not self.cfg.shar_dir:
            return self.extremes(self.cfg.train_part)
        if "--shar-dir" not in self._extremes:
            from valle.data.shar import shar_extremes

            self._extremes["--shar-dir"] = shar_extremes(self.cfg.shar_dir)
        return self._extremes["--shar-dir"]

    def worst_batches(self) -> dict[str, tuple[float, list]] | None:
        """Per pessimistic-scan criterion, (score, cuts) of the worst batch the training data
        can form, from its extremes record (``valle.data.pessimistic``: no pass); None without
        a record, or when the filters keep none of its cuts."""
        record = self.train_extremes()
        if record is None:
            return None
        from valle.data.pessimistic import worst_batches

        return worst_batches(record, self.cut_filter()) or None

    def _loader(self, part: str, rank: int, world_size: int, shuffle: bool, drop_last: bool,
                prompts: bool) -> ManifestLoader:
        from lhotse.dataset import DynamicBucketingSampler

        from valle.data.collation import get_text_token_collater
        from valle.data.dataset import SpeechSynthesisDataset
        from valle.data.sampling import BudgetedSampler

        cuts = self.load_cuts(part)
        seed = self.seed
        constraint = self.constraint()
        sampler = DynamicBucketingSampler(
            cuts, constraint=constraint, **self.bucketing(part, constraint), shuffle=shuffle,
            drop_last=drop_last, buffer_size=self.cfg.buffer_size, seed=seed,
            world_size=world_size, rank=rank,
        )
        dataset = SpeechSynthesisDataset(
            get_text_token_collater(self.text_tokens_path()),
            prompt_cuts=cuts if prompts else None,
            max_prompt_duration=self.cfg.max_prompt_duration,
            languages=self.languages(),
        )
        return ManifestLoader(dataset, BudgetedSampler(sampler, constraint), self.cfg.num_workers,
                              world_size, rank, seed)

    def _shar_loader(self, rank: int, world_size: int):
        from valle.data.collation import get_text_token_collater
        from valle.data.dataset import SpeechSynthesisDataset
        from valle.data.shar import SharLoader, SharTrainSet, find_shards

        if self._prompts():
            raise ValueError("--prefix-mode 4 needs a cut manifest for its prompt index: "
                             "train it from --manifest-dir, not --shar-dir")
        shards = find_shards(self.cfg.shar_dir)
        seed = self.seed
        cut_filter = self.cut_filter()
        record = self.train_extremes()
        data = SharTrainSet(
            shards, SpeechSynthesisDataset(get_text_token_collater(self.text_tokens_path()),
                                           languages=self.languages()), cut_filter.constraint,
            rank, world_size, seed, self.cfg.shuffle, self.cfg.num_buckets, self.cfg.buffer_size,
            cut_filter, None if record is None else self._sample_bins(record, cut_filter.constraint),
        )
        logger.info("training from %d Shar shard(s) in %s; rank %d of %d reads every %d-th",
                    len(shards), self.cfg.shar_dir, rank, world_size,
                    world_size * max(1, self.cfg.num_workers))
        return SharLoader(data, self.cfg.num_workers, world_size, rank, seed)

    def scan_batches(self, rank: int, world_size: int):
        """(cut batches of this rank's first epoch, the dataset that collates them): the
        pessimistic-batch scan walks these without training."""
        if self.cfg.shar_dir:
            loader = self._shar_loader(rank, world_size)
            return loader.data.cut_batches(), loader.dataset
        scan = self._loader(self.cfg.train_part, rank, world_size, shuffle=False,
                            drop_last=False, prompts=self._prompts())
        return scan.sampler, scan.dataset

    def _prompts(self) -> bool:
        return self.prefix_mode == 4

    # ---- public API --------------------------------------------------------
    def train_dataloader(self, rank: int = 0, world_size: int = 1,
                         sampler_state: dict[str, Any] | None = None) -> ResumableLoader:
        if self.cfg.shar_dir:
            return self._resume(self._shar_loader(rank, world_size), sampler_state)
        loader = self._loader(self.cfg.train_part, rank, world_size,
                              shuffle=self.cfg.shuffle, drop_last=self.cfg.drop_last,
                              prompts=self._prompts())
        return self._resume(loader, sampler_state)

    def _resume(self, loader: ResumableLoader, sampler_state: dict[str, Any] | None) -> ResumableLoader:
        """``loader`` at ``sampler_state``'s position (refused when it was saved by another
        kind of loader mid-epoch, or another world size or seed); kept for ``sampler_state()``."""
        if sampler_state is not None:
            loader.load_state_dict(sampler_state)
        self._train_loader = loader
        return loader

    def valid_dataloader(self, rank: int = 0, world_size: int = 1) -> ManifestLoader:
        return self._loader(self.cfg.valid_part, rank, world_size, shuffle=False,
                            drop_last=False, prompts=self._prompts())

    def sampler_state(self) -> dict[str, Any] | None:
        return None if self._train_loader is None else self._train_loader.state_dict()


def _raise_if_bins_all_removed(record, cut_filter: V.CutFilter, what: str) -> None:
    """No recorded cut passes the filters: stop naming the filter when every duration bin
    lies wholly outside the duration bounds (each bin's recorded shortest and longest cuts
    are its true ones). Otherwise the record cannot tell, and training will."""
    counts: dict[str, int] = {}
    for b in record.bins.values():
        shortest, longest = b.best["shortest"][0].duration, b.best["longest"][0].duration
        if shortest > cut_filter.max_duration:
            counts[V.TOO_LONG] = counts.get(V.TOO_LONG, 0) + b.count
        elif longest < cut_filter.min_duration:
            counts[V.TOO_SHORT] = counts.get(V.TOO_SHORT, 0) + b.count
        else:
            return
    V.raise_nothing_left(dict(sorted(counts.items())), record.count, cut_filter.min_duration,
                         cut_filter.max_duration, what=what)

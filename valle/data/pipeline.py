"""Tokenize a corpus part: lhotse manifests -> phonemes + codec codes, in resumable chunks.

Per part, the cuts (one per supervision) are processed in chunks of ``chunk_size``:

1. text: phonemize (espeak voice from each supervision's language), cheap checks first;
2. audio: a DataLoader whose workers load and resample audio to the codec's rate, batches
   of about ``batch_duration`` seconds encoded on ``device``, codes written through a lhotse
   writer (``NumpyHdf5Writer``, one HDF5 file per chunk: exact int16, no file per cut);
3. the chunk's cuts, report lines and statistics are written atomically; a restart skips
   finished chunks, so a crash loses at most one chunk.

When every chunk is done the chunk files are joined into ``{prefix}_cuts_{part}.{suffix}``,
the bad-item report, statistics and extremes record (``valle.data.extremes``: what the
trainer's start-up reads instead of a pass over the manifest) are written, and the symbol
table and corpus text statistics shared by parallel jobs are merged under a file lock.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch

from valle.data import validation as V
from valle.data.extremes import Extremes, extremes_path
from valle.data.progress import Progress

logger = logging.getLogger("tokenizer")

TEXT_TOKENS_FILE = "unique_text_tokens.k2symbols"
RATE_BIN = 0.5  # tokens/s per histogram bin
RATE_BINS = 400  # up to 200 tokens/s; faster goes into the last bin
EXTRA_TOKENS = 2  # bos + eos, as the collater adds them


def text_stats_path(out_dir: Path, prefix: str) -> Path:
    return Path(out_dir) / f"{prefix}_text_stats.json"


# ----------------------------------------------------------------------------- options and stats
@dataclass
class Options:
    src_dir: Path
    output_dir: Path
    prefix: str
    suffix: str = "jsonl.gz"
    language: str = "en-us"
    text_tokens: Path | None = None
    num_workers: int = 1
    batch_duration: float = 60.0
    chunk_size: int = 2000
    filter_min_duration: float = 0.1
    filter_max_duration: float = 40.0
    max_phones_per_second: float = V.DEFAULT_MAX_PHONES_PER_SECOND
    log_interval: float = 30.0
    shar_dir: Path | None = None
    shar_shard_size: int = 1000


@dataclass
class Stats:
    """What a part holds (kept cuts): merged across chunks, parts and parallel jobs."""

    cuts: int = 0
    seconds: float = 0.0
    phones: int = 0
    text_tokens: int = 0
    rate_hist: list[int] = field(default_factory=lambda: [0] * RATE_BINS)
    languages: dict[str, dict[str, float]] = field(default_factory=dict)

    def add_cut(self, seconds: float, phones: int, tokens: int, voice: str) -> None:
        self.cuts += 1
        self.seconds += seconds
        self.phones += phones
        self.text_tokens += tokens
        rate = (tokens + EXTRA_TOKENS) / max(seconds, 1e-3)
        self.rate_hist[min(RATE_BINS - 1, int(rate / RATE_BIN))] += 1
        lang = self.languages.setdefault(voice, {"cuts": 0, "seconds": 0.0, "bad": 0})
        lang["cuts"] += 1
        lang["seconds"] += seconds

    def add_bad(self, voice: str) -> None:
        self.languages.setdefault(voice, {"cuts": 0, "seconds": 0.0, "bad": 0})["bad"] += 1

    def merge(self, other: Stats) -> None:
        self.cuts += other.cuts
        self.seconds += other.seconds
        self.phones += other.phones
        self.text_tokens += other.text_tokens
        self.rate_hist = [a + b for a, b in zip(self.rate_hist, other.rate_hist)]
        for voice, d in other.languages.items():
            mine = self.languages.setdefault(voice, {"cuts": 0, "seconds": 0.0, "bad": 0})
            for k, v in d.items():
                mine[k] = mine.get(k, 0) + v

    def rate_quantile(self, q: float) -> float:
        """Text tokens per second (bos/eos included) at quantile q, per cut (bin upper edge)."""
        total = sum(self.rate_hist)
        if total == 0:
            return 0.0
        need, seen = q * total, 0
        for i, n in enumerate(self.rate_hist):
            seen += n
            if seen >= need:
                return (i + 1) * RATE_BIN
        return RATE_BINS * RATE_BIN

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("cuts", "seconds", "phones", "text_tokens", "languages")}
        out["phones_per_second"] = self.phones / self.seconds if self.seconds else 0.0
        out["text_tokens_per_second"] = self.text_tokens / self.seconds if self.seconds else 0.0
        out["text_tokens_per_second_p99"] = self.rate_quantile(0.99)
        out["rate_hist"] = self.rate_hist
        return out

    @staticmethod
    def from_json(d: dict) -> Stats:
        return Stats(cuts=d["cuts"], seconds=d["seconds"], phones=d["phones"],
                     text_tokens=d["text_tokens"], rate_hist=list(d["rate_hist"]),
                     languages={k: dict(v) for k, v in d["languages"].items()})


def language_report(stats: Stats) -> list[str]:
    lines = []
    for voice, d in sorted(stats.languages.items()):
        lines.append(f"  {voice:<10} {int(d['cuts']):>8} cuts {d['seconds'] / 3600:>9.3f} h "
                     f"{int(d['bad']):>6} bad")
    return lines


# ----------------------------------------------------------------------------- shared files
def _lock(path: Path):
    from filelock import FileLock

    return FileLock(str(path) + ".lock")


def merge_symbols(table_path: Path, symbols: set[str]) -> int:
    """Add ``symbols`` to the shared table under a file lock (parallel jobs lose nothing).
    Returns the number of symbols added."""
    from valle.data.symbols import SymbolTable

    with _lock(table_path):
        table = SymbolTable.from_file(table_path) if table_path.is_file() else SymbolTable()
        before = len(table)
        for sym in sorted(symbols):
            table.add(sym)
        table.to_file(table_path)
        return len(table) - before


def merge_text_stats(path: Path, part: str, stats: Stats) -> None:
    """``{prefix}_text_stats.json``: per-part statistics (the trainer derives its default
    --max-text-tokens from them), updated under a file lock."""
    with _lock(path):
        data = json.loads(path.read_text()) if path.is_file() else {"parts": {}}
        data["parts"][part] = stats.to_json()
        total = Stats()
        for d in data["parts"].values():
            total.merge(Stats.from_json(d))
        data["total"] = {k: v for k, v in total.to_json().items() if k != "rate_hist"}
        _atomic_write(path, json.dumps(data, indent=1, ensure_ascii=False))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def chunk_extremes(meta: dict, chunk_cuts: Path) -> Extremes:
    """The chunk's extremes record; a chunk finished by an older version (no "extremes" in
    its meta) is read once more from its cuts file, metadata only."""
    if "extremes" in meta:
        return Extremes.from_json(meta["extremes"])
    from lhotse import CutSet

    return Extremes.of(CutSet.from_jsonl_lazy(chunk_cuts))


# ----------------------------------------------------------------------------- audio loading
class AudioLoadDataset(torch.utils.data.Dataset):
    """Item i: (i, mono float waveform at the codec's rate) or (i, None, reason, detail).
    Runs in DataLoader workers, so decoding and resampling overlap the encoder."""

    def __init__(self, cuts: list) -> None:
        self.cuts = cuts

    def __len__(self) -> int:
        return len(self.cuts)

    def __getitem__(self, i: int):
        cut = self.cuts[i]
        try:
            samples = cut.load_audio()
        except Exception as e:  # lhotse/soundfile raise many types on corrupt files
            return i, None, V.UNREADABLE_AUDIO, f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
        if samples.size == 0 or samples.shape[-1] == 0:
            return i, None, V.ZERO_LENGTH_AUDIO, "audio holds no samples"
        wav = torch.as_tensor(samples, dtype=torch.float32)
        return i, (wav.mean(dim=0) if wav.dim() == 2 else wav), None, None


def _first(batch):
    return batch


def duration_batches(cuts: list, batch_duration: float, window: int = 512) -> list[list[int]]:
    """Index batches of about ``batch_duration`` seconds, sorted by duration inside windows of
    ``window`` cuts (little padding: the encoder runs over it too)."""
    out: list[list[int]] = []
    for start in range(0, len(cuts), window):
        idx = sorted(range(start, min(len(cuts), start + window)), key=lambda i: cuts[i].duration)
        batch, total = [], 0.0
        for i in idx:
            if batch and total + cuts[i].duration > batch_duration:
                out.append(batch)
                batch, total = [], 0.0
            batch.append(i)
            total += cuts[i].duration
        if batch:
            out.append(batch)
    return out


# ----------------------------------------------------------------------------- one part
class PartTokenizer:
    def __init__(self, opts: Options, codec, text_tokenizer, fixed_table=None) -> None:
        self.opts = opts
        self.codec = codec
        self.text = text_tokenizer
        self.fixed_table = fixed_table

    def paths(self, part: str) -> dict[str, Path]:
        o, p, s = self.opts.output_dir, self.opts.prefix, self.opts.suffix
        return {
            "cuts": o / f"{p}_cuts_{part}.{s}",
            "report": o / f"{p}_bad_cuts_{part}.tsv",
            "stats": o / f"{p}_stats_{part}.json",
            "extremes": extremes_path(o, p, part),
            "chunks": o / f".{p}_chunks_{part}",
            "storage": o / f"{p}_{self.codec.name}_{part}",
        }

    # --- text ------------------------------------------------------------------
    def tokenize_text(self, cut, report: V.ValidationReport, stats: Stats, seen: set[str]):
        """The cut with its phonemes stored, or None (reported)."""
        from lhotse.utils import fastcopy

        from valle.data.languages import UnknownLanguageError, espeak_voice
        from valle.data.manifests import supervision_text
        from valle.data.text import TextTokenizationError

        o = self.opts
        sup = cut.supervisions[0]
        try:
            voice = espeak_voice(sup.language, o.language)
        except UnknownLanguageError as e:
            report.add(cut.id, V.PHONEMIZE_FAILED, str(e))
            stats.add_bad(str(sup.language))
            return None
        bad = V.check_duration(cut.duration, o.filter_min_duration, o.filter_max_duration)
        text = supervision_text(sup)
        if bad is None and not text:
            bad = (V.EMPTY_TEXT, "supervision text is empty")
        ph = None
        if bad is None:
            try:
                ph = self.text.phonemize_one(text, voice)
            except TextTokenizationError as e:
                bad = (V.PHONEMIZE_FAILED, str(e)[:300])
        if bad is None:
            bad = V.check_text_symbols(text, voice, ph.symbols, ph.language_switches, cut.duration,
                                       o.max_phones_per_second)
        if bad is None and self.fixed_table is not None:
            bad = V.check_known_symbols(ph.symbols, self.fixed_table)
        if bad:
            report.add(cut.id, *bad)
            stats.add_bad(voice)
            return None
        custom = dict(sup.custom or {})
        custom["tokens"] = {"text": ph.symbols}
        custom["num_text_tokens"] = len(ph.symbols)
        custom["espeak_voice"] = voice
        seen.update(ph.symbols)
        cut = fastcopy(cut, supervisions=[fastcopy(sup, custom=custom)])
        if cut.sampling_rate != self.codec.sample_rate:
            # The cut (not only the waveform) moves to the codec's rate, so its sample counts
            # agree with the audio lhotse loads and with the codes' 24 kHz features.
            cut = cut.resample(self.codec.sample_rate)
        return cut

    # --- audio -----------------------------------------------------------------
    def encode_chunk(self, cuts: list, storage_path: Path, report: V.ValidationReport,
                     progress: Progress) -> list:
        from lhotse import NumpyHdf5Writer

        from valle.data.codes import store_codes

        loader = torch.utils.data.DataLoader(
            AudioLoadDataset(cuts), batch_sampler=duration_batches(cuts, self.opts.batch_duration),
            num_workers=self.opts.num_workers, collate_fn=_first,
            prefetch_factor=4 if self.opts.num_workers > 0 else None,
        )
        done: dict[int, object] = {}
        storage_path.parent.mkdir(parents=True, exist_ok=True)
        with NumpyHdf5Writer(storage_path, mode="w") as writer:
            for batch in loader:
                ok = [(i, wav) for i, wav, _r, _d in batch if wav is not None]
                for i, wav, reason, detail in batch:
                    if wav is None:
                        report.add(cuts[i].id, reason, detail)
                codes = self.codec.encode_batch([wav for _i, wav in ok])
                for (i, _wav), c in zip(ok, codes):
                    done[i] = store_codes(cuts[i], c, writer, self.codec)
                progress.update(len(batch), sum(cuts[i].duration for i, _w in ok))
        return [done[i] for i in sorted(done)]  # manifest order

    # --- a chunk, a part ----------------------------------------------------------
    def run_chunk(self, index: int, cuts: list, paths: dict[str, Path], progress: Progress) -> dict:
        from lhotse import CutSet

        report, stats, seen = V.ValidationReport(), Stats(), set()
        good = []
        for cut in cuts:
            report.checked += 1
            c = self.tokenize_text(cut, report, stats, seen)
            if c is not None:
                good.append(c)
        progress.update(len(cuts) - len(good))
        encoded = self.encode_chunk(good, paths["storage"] / f"chunk-{index:06d}.h5", report, progress)
        kept = {c.id for c in encoded}
        for c in good:
            if c.id not in kept:  # audio failed after text passed: undo its counts
                stats.add_bad(c.supervisions[0].custom["espeak_voice"])
        for c in encoded:
            custom = c.supervisions[0].custom
            phones = sum(1 for s in custom["tokens"]["text"] if V.is_phone(s))
            stats.add_cut(c.duration, phones, custom["num_text_tokens"], custom["espeak_voice"])
        chunk_cuts = paths["chunks"] / f"{index:06d}.{self.opts.suffix}"
        tmp = chunk_cuts.with_name(".tmp." + chunk_cuts.name)
        CutSet.from_cuts(encoded).to_file(tmp)
        os.replace(tmp, chunk_cuts)
        meta = {"checked": report.checked, "bad": [[e.cut_id, e.reason, e.detail] for e in report.entries],
                "symbols": sorted(seen), "stats": stats.to_json(),
                "extremes": Extremes.of(encoded).to_json()}
        # The meta file is the chunk's "done" marker: written last.
        _atomic_write(paths["chunks"] / f"{index:06d}.json", json.dumps(meta, ensure_ascii=False))
        return meta

    @staticmethod
    def _check_plan(part: str, chunk_dir: Path, ids: list[str], size: int) -> None:
        """Finished chunks are reused only for the same cuts and chunk size; otherwise (the
        manifest or --chunk-size changed) they are discarded, and the log says so."""
        import hashlib

        digest = hashlib.sha1("\n".join(ids).encode()).hexdigest()
        plan = {"chunk_size": size, "num_cuts": len(ids), "cut_ids_sha1": digest}
        plan_path = chunk_dir / "plan.json"
        if plan_path.is_file() and json.loads(plan_path.read_text()) != plan:
            logger.warning("part %s: the cuts or --chunk-size changed since %s was started: "
                           "its finished chunks are discarded", part, chunk_dir)
            shutil.rmtree(chunk_dir)
        chunk_dir.mkdir(parents=True, exist_ok=True)
        if not plan_path.is_file():
            _atomic_write(plan_path, json.dumps(plan))

    def run(self, part: str, cuts, load_report: V.ValidationReport) -> tuple[V.ValidationReport, Stats]:
        from lhotse import CutSet

        paths = self.paths(part)
        size = max(1, self.opts.chunk_size)
        n_chunks = math.ceil(len(cuts) / size)
        ids = getattr(cuts, "ids", None) or [c.id for c in cuts]
        self._check_plan(part, paths["chunks"], ids, size)
        metas: dict[int, dict] = {}
        for i in range(n_chunks):
            meta_path = paths["chunks"] / f"{i:06d}.json"
            if meta_path.is_file():
                metas[i] = json.loads(meta_path.read_text(encoding="utf-8"))
        if metas:
            logger.info("part %s: resuming, %d of %d chunks already done", part, len(metas), n_chunks)
        progress = Progress(len(cuts), f"tokenize {part}", logger, self.opts.log_interval,
                            done=sum(min(size, len(cuts) - i * size) for i in metas))
        stream = iter(cuts)  # one chunk of cuts in memory at a time
        try:
            for i in range(n_chunks):
                chunk = list(islice(stream, size))
                if i not in metas:
                    metas[i] = self.run_chunk(i, chunk, paths, progress)
        finally:
            progress.close()
        # Join: the report (manifest problems first), statistics, the cuts file (last: it is
        # the "part done" marker), the shared symbol table and text statistics.
        report, stats, seen, extremes = V.ValidationReport(), Stats(), set(), Extremes()
        report.extend(load_report)
        for i in range(n_chunks):
            m = metas[i]
            report.checked += m["checked"]
            for cut_id, reason, detail in m["bad"]:
                report.add(cut_id, reason, detail)
            seen.update(m["symbols"])
            stats.merge(Stats.from_json(m["stats"]))
            extremes.merge(chunk_extremes(m, paths["chunks"] / f"{i:06d}.{self.opts.suffix}"))
        report.write(paths["report"])
        _atomic_write(paths["stats"], json.dumps(stats.to_json(), indent=1, ensure_ascii=False))
        extremes.write(paths["extremes"])
        if self.fixed_table is None:
            added = merge_symbols(self.opts.output_dir / TEXT_TOKENS_FILE, seen)
            logger.info("part %s: %d new symbols in %s", part, added, TEXT_TOKENS_FILE)
        merge_text_stats(text_stats_path(self.opts.output_dir, self.opts.prefix), part, stats)
        tmp = paths["cuts"].with_name(".tmp." + paths["cuts"].name)
        with CutSet.open_writer(tmp) as writer:
            for i in range(n_chunks):
                for cut in CutSet.from_jsonl_lazy(paths["chunks"] / f"{i:06d}.{self.opts.suffix}"):
                    writer.write(cut)
        os.replace(tmp, paths["cuts"])
        shutil.rmtree(paths["chunks"], ignore_errors=True)
        return report, stats


def export_shar(cuts_path: Path, shar_dir: Path, shard_size: int) -> list[str]:
    """Write cuts with their codes as Lhotse Shar shards (cuts.NNNNNN.jsonl.gz +
    features.NNNNNN.tar, numpy arrays: exact int16). Returns the shard files written."""
    from lhotse import CutSet

    shar_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    written = CutSet.from_jsonl_lazy(cuts_path).to_shar(
        shar_dir, fields={"features": "numpy"}, shard_size=shard_size, warn_unused_fields=False)
    n = len(written["cuts"])
    logger.info("Shar: %s -> %s, %d shard(s), %.1fs", cuts_path.name, shar_dir, n, time.time() - t0)
    return [str(p) for paths in written.values() for p in paths]

"""Tokenize a corpus part: lhotse manifests -> phonemes + codec codes, in resumable chunks.

Per part, the cuts (one per supervision) are processed in chunks of ``chunk_size``:

1. text: phonemize (espeak voice from each supervision's language), cheap checks first;
2. audio: a DataLoader whose workers load and resample audio to the codec's rate, batches
   of about ``batch_duration`` seconds encoded on ``device``, codes written through a lhotse
   writer (``NumpyHdf5Writer``, one HDF5 file per chunk: exact int16, no file per cut);
3. the chunk's cuts, report lines and statistics are written atomically; a restart skips
   finished chunks, so a crash loses at most one chunk. Every file of a chunk appears only
   complete (``publish``: written under a ``.tmp.`` name, fsynced, renamed), its meta last,
   and no process of a killed worker holds one (``valle.data.workers``): a relaunch may
   come at once.

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
from valle.data.sharding import Shard
from valle.data.workers import forget_cached_files, worker_init_fn
from valle.durable import fsync_dir, publish

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
    # vallex-bpe, a language the model gained: characters its table lacks, left out (counts)
    lacking: dict[str, int] = field(default_factory=dict)

    def add_lacking(self, lacking: dict[str, int]) -> None:
        for ch, n in lacking.items():
            self.lacking[ch] = self.lacking.get(ch, 0) + n

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
        self.add_lacking(other.lacking)

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
        out = {k: getattr(self, k) for k in ("cuts", "seconds", "phones", "text_tokens", "languages",
                                             "lacking")}
        out["phones_per_second"] = self.phones / self.seconds if self.seconds else 0.0
        out["text_tokens_per_second"] = self.text_tokens / self.seconds if self.seconds else 0.0
        out["text_tokens_per_second_p99"] = self.rate_quantile(0.99)
        out["rate_hist"] = self.rate_hist
        return out

    @staticmethod
    def from_json(d: dict) -> Stats:
        return Stats(cuts=d["cuts"], seconds=d["seconds"], phones=d["phones"],
                     text_tokens=d["text_tokens"], rate_hist=list(d["rate_hist"]),
                     languages={k: dict(v) for k, v in d["languages"].items()},
                     lacking=dict(d.get("lacking", {})))


def language_report(stats: Stats) -> list[str]:
    lines = []
    for voice, d in sorted(stats.languages.items()):
        lines.append(f"  {voice:<10} {int(d['cuts']):>8} cuts {d['seconds'] / 3600:>9.3f} h "
                     f"{int(d['bad']):>6} bad")
    if stats.lacking:  # a new language's characters the vallex-bpe table has no id for
        from collections import Counter

        from valle.data.vallex_text import describe_lacking

        lines.append(f"  left out, not in the vallex-bpe table ({sum(stats.lacking.values())} "
                     f"characters): {describe_lacking(Counter(stats.lacking))}")
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
    publish(tmp, path)


def partial_path(path: Path) -> Path:
    """Where ``path`` is written until it is complete (a name no reader looks for; the
    suffix is kept, lhotse's HDF5 writer would add its own)."""
    return path.with_name(".tmp." + path.name)


def _fsync_tree(directory: Path) -> None:
    """Every file under ``directory`` and the directories themselves on disk."""
    for p in sorted(directory.rglob("*"), reverse=True):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        else:
            fsync_dir(p)
    fsync_dir(directory)


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
        from valle.codec.audio import use_torch_resampling_in_lhotse

        use_torch_resampling_in_lhotse()  # the same audio with or without torchaudio
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
            "lock": o / f".{p}_join_{part}",  # workers agree on the plan and on who joins under it
            **({"shar": self.opts.shar_dir / part} if self.opts.shar_dir is not None else {}),
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
        if ph is not None and ph.lacking:  # reported with the part's stats, by name
            stats.add_lacking(ph.lacking)
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
        """Encode the chunk's audio into ``storage_path`` (an HDF5 file), which appears only
        complete: it is written under a temporary name and renamed (``publish``). The audio
        workers are forked before that file is opened, and die with this process: a killed
        worker leaves no process holding the file or its lock (valle.data.workers)."""
        from lhotse import NumpyHdf5Writer

        from valle.data.codes import store_codes

        loader = torch.utils.data.DataLoader(
            AudioLoadDataset(cuts), batch_sampler=duration_batches(cuts, self.opts.batch_duration),
            num_workers=self.opts.num_workers, collate_fn=_first,
            prefetch_factor=4 if self.opts.num_workers > 0 else None,
            worker_init_fn=worker_init_fn() if self.opts.num_workers > 0 else None,
        )
        done: dict[int, object] = {}
        storage_path.parent.mkdir(parents=True, exist_ok=True)
        batches = iter(loader)  # forks the workers now, while no file of the chunk is open
        tmp = partial_path(storage_path)
        # A killed run's partial file: unlinked, not truncated, so that a process of that run
        # still holding it (and HDF5's lock on it) has no say over the new one.
        tmp.unlink(missing_ok=True)
        try:
            with NumpyHdf5Writer(tmp, mode="w") as writer:
                for batch in batches:
                    ok = [(i, wav) for i, wav, _r, _d in batch if wav is not None]
                    for i, wav, reason, detail in batch:
                        if wav is None:
                            report.add(cuts[i].id, reason, detail)
                    codes = self.codec.encode_batch([wav for _i, wav in ok])
                    for (i, _wav), c in zip(ok, codes):
                        done[i] = store_codes(cuts[i], c, writer, self.codec, storage_path=storage_path)
                    progress.update(len(batch), sum(cuts[i].duration for i, _w in ok))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            del batches  # shuts the workers down
        publish(tmp, storage_path)
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
        tmp = partial_path(chunk_cuts)
        CutSet.from_cuts(encoded).to_file(tmp)
        publish(tmp, chunk_cuts)
        meta = {"checked": report.checked, "bad": [[e.cut_id, e.reason, e.detail] for e in report.entries],
                "symbols": sorted(seen), "stats": stats.to_json(),
                "extremes": Extremes.of(encoded).to_json()}
        if self.opts.shar_dir is not None:
            meta["shar_shards"] = self.write_shar_chunk(shar_staging(paths["shar"]), index, encoded)
        # The meta file is the chunk's "done" marker: written last.
        _atomic_write(paths["chunks"] / f"{index:06d}.json", json.dumps(meta, ensure_ascii=False))
        return meta

    def _check_plan(self, part: str, paths: dict[str, Path], plan: dict) -> None:
        """Finished chunks are reused only for the same cuts and chunk size; otherwise (the
        manifest or --chunk-size changed) they are discarded, and the log says so. Under the
        part's lock: workers starting together agree on one plan."""
        chunk_dir, plan_path = paths["chunks"], paths["chunks"] / "plan.json"
        if plan_path.is_file() and json.loads(plan_path.read_text()) != plan:
            logger.warning("part %s: the cuts or --chunk-size changed since %s was started: "
                           "its finished chunks are discarded", part, chunk_dir)
            shutil.rmtree(chunk_dir)
            if "shar" in paths:
                shutil.rmtree(shar_staging(paths["shar"]), ignore_errors=True)
        chunk_dir.mkdir(parents=True, exist_ok=True)
        if not plan_path.is_file():
            _atomic_write(plan_path, json.dumps(plan))

    @staticmethod
    def _meta_path(paths: dict[str, Path], index: int) -> Path:
        return paths["chunks"] / f"{index:06d}.json"

    def _read_meta(self, paths: dict[str, Path], index: int) -> dict:
        return json.loads(self._meta_path(paths, index).read_text(encoding="utf-8"))

    def run(self, part: str, cuts, load_report: V.ValidationReport,
            shard: Shard | None = None) -> tuple[V.ValidationReport, Stats] | None:
        """Tokenize this worker's chunks of the part; the worker that finds every chunk done
        joins the part. Returns the part's report and statistics when this call joined it,
        None when other workers' chunks are still missing (the last to finish joins) or
        another worker joined it already."""
        shard = shard or Shard()
        paths = self.paths(part)
        plan = streaming_plan(cuts, max(1, self.opts.chunk_size))
        size, n_chunks = plan["chunk_size"], math.ceil(plan["num_cuts"] / plan["chunk_size"])
        self.opts.output_dir.mkdir(parents=True, exist_ok=True)
        with _lock(paths["lock"]):
            if paths["cuts"].is_file():
                logger.info("part %s: joined by another worker already", part)
                return None
            self._check_plan(part, paths, plan)
        mine = [i for i in range(n_chunks) if shard.owns(i)]
        # chunk numbers only: the metas (with their extremes records) are read one at a time
        done = {i for i in mine if self._meta_path(paths, i).is_file()}
        if done:
            logger.info("part %s: resuming, %d of %d chunks already done", part, len(done), len(mine))
        my_cuts = sum(min(size, plan["num_cuts"] - i * size) for i in mine)
        progress = Progress(my_cuts, f"tokenize {part}" + ("" if shard.alone else f" [{shard.index}/{shard.count}]"),
                            logger, self.opts.log_interval,
                            done=sum(min(size, plan["num_cuts"] - i * size) for i in done))
        stream = iter(cuts)  # one chunk of cuts in memory at a time
        try:
            for i in range(n_chunks):
                if i in done or not shard.owns(i):
                    for _ in islice(stream, size):  # another worker's chunk, or done: skip it
                        pass
                    continue
                self.run_chunk(i, list(islice(stream, size)), paths, progress)
                done.add(i)
        finally:
            progress.close()
        with _lock(paths["lock"]):
            if paths["cuts"].is_file():
                return None
            missing = [i for i in range(n_chunks) if not self._meta_path(paths, i).is_file()]
            if missing:
                logger.info("part %s: %s done; %d of %d chunks still with other workers (the last "
                            "to finish joins the part)", part, shard.describe(), len(missing), n_chunks)
                return None
            return self.join(part, n_chunks, load_report)

    def join(self, part: str, n_chunks: int, load_report: V.ValidationReport) -> tuple[V.ValidationReport, Stats]:
        """Every chunk is done: the report (manifest problems first), statistics, the extremes
        record (every chunk's, merged), Shar shards numbered in chunk order (and the extremes
        record in --shar-dir, beside the part's shard dir), the shared symbol table and text
        statistics, and last the cuts file (the "part done" marker). Chunk order alone decides
        the output: the same whichever worker joins and whatever order the chunks finished in.
        Chunk metas are read one at a time, so memory does not grow with the part."""
        from lhotse import CutSet

        paths = self.paths(part)
        report, stats, seen, extremes = V.ValidationReport(), Stats(), set(), Extremes()
        shar_shards: list[int] = []
        report.extend(load_report)
        for i in range(n_chunks):
            m = self._read_meta(paths, i)
            shar_shards.append(m.get("shar_shards", 0))
            report.checked += m["checked"]
            for cut_id, reason, detail in m["bad"]:
                report.add(cut_id, reason, detail)
            seen.update(m["symbols"])
            stats.merge(Stats.from_json(m["stats"]))
            extremes.merge(chunk_extremes(m, paths["chunks"] / f"{i:06d}.{self.opts.suffix}"))
        report.write(paths["report"])
        _atomic_write(paths["stats"], json.dumps(stats.to_json(), indent=1, ensure_ascii=False))
        if self.fixed_table is None:
            added = merge_symbols(self.opts.output_dir / TEXT_TOKENS_FILE, seen)
            logger.info("part %s: %d new symbols in %s", part, added, TEXT_TOKENS_FILE)
        merge_text_stats(text_stats_path(self.opts.output_dir, self.opts.prefix), part, stats)
        if "shar" in paths:
            join_shar_chunks(shar_staging(paths["shar"]), paths["shar"], shar_shards)
            # beside the part's shards, for the same reason as the staging dir
            extremes.write(extremes_path(self.opts.shar_dir, self.opts.prefix, part))
        tmp = partial_path(paths["cuts"])
        with CutSet.open_writer(tmp) as writer:
            for i in range(n_chunks):
                for cut in CutSet.from_jsonl_lazy(paths["chunks"] / f"{i:06d}.{self.opts.suffix}"):
                    writer.write(cut)
        publish(tmp, paths["cuts"])
        # Partial chunk files of killed runs whose chunks were then redone by a worker of
        # another --num-shards (which cleans its own chunk numbers only) or discarded.
        for leftover in paths["storage"].glob(partial_path(Path("chunk-*.h5")).name):
            leftover.unlink(missing_ok=True)
        # After the cuts file: the trainer takes a record older than its cuts for a stale one.
        extremes.write(paths["extremes"])
        shutil.rmtree(paths["chunks"], ignore_errors=True)
        return report, stats

    # --- Shar, written by the workers ----------------------------------------------
    def write_shar_chunk(self, staging: Path, index: int, cuts: list) -> int:
        """The chunk's cuts with their codes as Shar shards in a staging folder of its own
        (renamed into place atomically); the join numbers them. Returns the shard count."""
        from lhotse import CutSet

        if not cuts:
            return 0
        final = staging / f"{index:06d}"
        tmp = final.with_name(f".tmp.{index:06d}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        tmp.mkdir(parents=True)
        written = CutSet.from_cuts(cuts).to_shar(tmp, fields={"features": "numpy"},
                                                 shard_size=self.opts.shar_shard_size, warn_unused_fields=False)
        forget_cached_files()  # the chunk's HDF5 file, read for the shards: not for the next workers
        _fsync_tree(tmp)  # on disk before the chunk's meta says it is done
        os.replace(tmp, final)
        fsync_dir(staging)
        return len(written["cuts"])


def shar_staging(shar_part_dir: Path) -> Path:
    """Where workers leave each chunk's Shar shards until the join numbers them: beside the
    part's Shar dir, not in it (lhotse's ``from_shar(in_dir=...)`` takes every entry there
    for a field)."""
    return shar_part_dir.with_name(f".{shar_part_dir.name}_chunks")


def streaming_plan(cuts, chunk_size: int) -> dict:
    """What a part's chunks are made of: the cut count and a digest of the ids in order,
    without a list of them (a ``PartCuts`` has them from its checking pass; anything else
    is streamed once)."""
    import hashlib

    if hasattr(cuts, "ids_sha1"):
        return {"chunk_size": chunk_size, "num_cuts": len(cuts), "cut_ids_sha1": cuts.ids_sha1}
    digest, n = hashlib.sha1(), 0
    for cut in cuts:
        digest.update((("\n" if n else "") + cut.id).encode())
        n += 1
    return {"chunk_size": chunk_size, "num_cuts": n, "cut_ids_sha1": digest.hexdigest()}


def join_shar_chunks(staging: Path, shar_dir: Path, shards_per_chunk: list[int]) -> int:
    """Move each chunk's Shar shards to ``shar_dir``, numbered in chunk order (a rename each,
    no data read). Idempotent: a join that died half-way is finished by the next. Returns
    the number of shards."""
    shar_dir.mkdir(parents=True, exist_ok=True)
    n = 0
    for chunk, count in enumerate(shards_per_chunk):
        for j in range(count):
            for kind, ext in (("cuts", "jsonl.gz"), ("features", "tar")):
                src = staging / f"{chunk:06d}" / f"{kind}.{j:06d}.{ext}"
                dst = shar_dir / f"{kind}.{n:06d}.{ext}"
                if src.is_file():
                    os.replace(src, dst)
                elif not dst.is_file():
                    raise FileNotFoundError(f"Shar join: {src} is missing (and {dst} was not made): "
                                            f"delete {staging.parent} and tokenize the part again")
            n += 1
    shutil.rmtree(staging, ignore_errors=True)
    logger.info("Shar: %d shard(s) in %s", n, shar_dir)
    return n


def export_shar(cuts_path: Path, shar_dir: Path, shard_size: int) -> list[str]:
    """Write cuts with their codes as Lhotse Shar shards (cuts.NNNNNN.jsonl.gz +
    features.NNNNNN.tar, numpy arrays: exact int16). Returns the shard files written."""
    from lhotse import CutSet

    shar_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    written = CutSet.from_jsonl_lazy(cuts_path).to_shar(
        shar_dir, fields={"features": "numpy"}, shard_size=shard_size, warn_unused_fields=False)
    forget_cached_files()  # lhotse keeps every HDF5 file it read open: one per chunk of the part
    n = len(written["cuts"])
    logger.info("Shar: %s -> %s, %d shard(s), %.1fs", cuts_path.name, shar_dir, n, time.time() - t0)
    return [str(p) for paths in written.values() for p in paths]

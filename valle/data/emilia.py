"""Emilia (egs/emilia): its JSONL rows and mp3 files -> the manifests bin/tokenizer.py reads.

Emilia (amphion/Emilia-Dataset, about 101,000 hours in six languages) unpacks, as lhotse's
emilia recipe reads it, into one folder per language under ``raw/``::

    {corpus}/raw/EN/EN_B00000.jsonl                                        one row per utterance
    {corpus}/raw/EN/EN_B00000/EN_B00000_S00000/mp3/EN_B00000_S00000_W000000.mp3

    {"id": "EN_B00000_S00000_W000000", "wav": "EN_B00000/EN_B00000_S00000/mp3/EN_B00000_S00000_W000000.mp3",
     "text": " Hello there.", "duration": 3.2, "speaker": "EN_B00000_S00000", "language": "en",
     "dnsmos": 3.35}

``wav`` is relative to the language's folder. Every row is an utterance of its own mp3.

    python -m valle.data.emilia prepare --corpus-dir D --output-dir O [--languages "en zh de fr ja ko"]
        [--min-dnsmos 0] [--num-jobs 4]
    python -m valle.data.emilia interleave OUT IN [IN ...]   the languages' train cuts, evenly mixed

writes, per language (the part is its lower-case code), ``emilia_{recordings,supervisions}_{lang}
.jsonl.gz`` (the supervision keeps the row's language, speaker and ``custom["dnsmos"]``) and
``emilia_skipped_{lang}.tsv``: rows whose mp3 is missing or unreadable, rows below
--min-dnsmos, malformed rows and ids repeated in a file, each with its reason. Unlike lhotse's recipe,
which drops missing files without a word and keeps every cut in memory, rows stream through
in windows (the mp3 headers are read by --num-jobs threads).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

from valle.data import validation as V
from valle.data.corpus_parts import LOW_DNSMOS, MISSING_AUDIO, PartManifestWriter
from valle.data.manifests import ManifestError, read_jsonl

logger = logging.getLogger("emilia")

PREFIX = "emilia"
LANGUAGES = ("en", "zh", "de", "fr", "ja", "ko")
# The espeak voice each language is phonemized in (bin/tokenizer.py maps the rows' codes to
# these itself; listed for egs/emilia/run.sh's --languages and the docs). Mandarin goes
# through pypinyin by default (egs/emilia/prepare.sh --zh-text-extractor).
VOICES = {"en": "en-us", "zh": "cmn", "de": "de", "fr": "fr-fr", "ja": "ja", "ko": "ko"}
ROW_FIELDS = ("id", "wav", "text", "speaker", "language", "dnsmos")
WINDOW = 512  # rows whose mp3 headers are read at once


def language_dir(corpus_dir: Path, lang: str) -> Path:
    return Path(corpus_dir) / "raw" / lang.upper()


def check_languages(languages: list[str]) -> None:
    unknown = [x for x in languages if x not in LANGUAGES]
    if unknown:
        raise ManifestError(f"unknown Emilia language(s) {unknown} (known: {' '.join(LANGUAGES)})")


def rows(lang_dir: Path) -> Iterator[tuple[str, dict]]:
    """(where, row) for every row of the language's JSONL files, in file-name order."""
    files = sorted(lang_dir.glob("*.jsonl"))
    if not files:
        raise ManifestError(f"{lang_dir}: no *.jsonl files (is --corpus-dir Emilia's root, holding raw/?)")
    for path in files:
        for lineno, row in enumerate(read_jsonl(path), start=1):
            yield f"{path.name}:{lineno}", row


def row_problem(row, min_dnsmos: float) -> tuple[str, str] | None:
    """Why a row cannot be used before its audio is opened, or None."""
    if not isinstance(row, dict):
        return V.BAD_MANIFEST_ITEM, "not a JSON object"
    missing = [k for k in ROW_FIELDS if k not in row]
    if missing:
        return V.BAD_MANIFEST_ITEM, f"no {', '.join(missing)}"
    try:
        score = float(row["dnsmos"])
    except (TypeError, ValueError):
        return V.BAD_MANIFEST_ITEM, f"dnsmos {row['dnsmos']!r} is not a number"
    if score < min_dnsmos:
        return LOW_DNSMOS, f"DNSMOS {score:.3f} < --min-dnsmos {min_dnsmos:g}"
    return None


def probe(path: Path):
    """The mp3's lhotse Recording (header only), or (reason, detail)."""
    from lhotse import Recording

    if not path.is_file():
        return MISSING_AUDIO, f"no file {path}"
    try:
        return Recording.from_file(path, recording_id=path.stem)
    except Exception as e:  # soundfile/audioread raise many types on corrupt files
        return V.UNREADABLE_AUDIO, f"{path}: {type(e).__name__}: {e}".replace("\n", " ")[:300]


def supervision_of(row: dict, recording) -> dict:
    return {"id": row["id"], "recording_id": recording.id, "start": 0.0, "duration": recording.duration,
            "channel": 0, "text": str(row["text"]).strip(), "language": row["language"],
            "speaker": row["speaker"], "custom": {"dnsmos": float(row["dnsmos"])}}


def prepare_language(corpus_dir: Path, output_dir: Path, lang: str, min_dnsmos: float = 0.0,
                     num_jobs: int = 4) -> PartManifestWriter:
    """One language's manifests (see the module's docstring); returns the finished writer."""
    from tqdm import tqdm

    lang_dir = language_dir(corpus_dir, lang)
    if not lang_dir.is_dir():
        raise ManifestError(f"{lang_dir}: no such directory (--corpus-dir must hold raw/{lang.upper()})")
    stream = rows(lang_dir)
    # Repeated ids are looked for within each JSONL file: Emilia's ids carry their file's name
    # (EN_B00000_S00000_W000000 is in EN_B00000.jsonl), so memory stays that of one file.
    seen: set[str] = set()
    seen_file = None
    with PartManifestWriter(output_dir, PREFIX, lang, shared_recordings=False) as writer, \
            ThreadPoolExecutor(max(1, num_jobs)) as pool, \
            tqdm(desc=f"emilia {lang}", unit="row", disable=None) as bar:
        while window := list(islice(stream, WINDOW)):
            usable = []
            for where, row in window:
                if where.split(":")[0] != seen_file:
                    seen_file = where.split(":")[0]
                    seen.clear()
                row_id = str(row.get("id", f"<{where}>")) if isinstance(row, dict) else f"<{where}>"
                bad = row_problem(row, min_dnsmos)
                if bad is None and row_id in seen:
                    bad = V.DUPLICATE_ID, f"{where}: id seen before (the first is kept)"
                if bad is not None:
                    writer.skip(row_id, bad[0], bad[1] if bad[0] == LOW_DNSMOS else f"{where}: {bad[1]}")
                    continue
                seen.add(row_id)
                usable.append(row)
            recordings = pool.map(probe, [lang_dir / row["wav"] for row in usable])
            for row, rec in zip(usable, recordings):
                if isinstance(rec, tuple):
                    writer.skip(row["id"], *rec)
                    continue
                writer.add_recording(rec.to_dict())
                writer.add_supervision(supervision_of(row, rec))
            bar.update(len(window))
    print(f"emilia prepare: {writer.summary()}")
    return writer


def count_lines(path: Path) -> int:
    return sum(1 for _ in read_jsonl(path))


def interleave(output: Path, inputs: list[Path]) -> list[int]:
    """Join the languages' train cuts so that every stretch of the output holds them in
    proportion to their sizes (deterministic; streaming, one cut per input in memory). The
    trainer shuffles a lazy manifest inside a buffer of --buffer-size cuts: concatenated,
    the first hours of training would see English only. The output's extremes record is made
    in the same pass. Returns the inputs' cut counts."""
    import heapq

    from valle.data.recipe import RecordOnTheWay, _Writer

    counts = [count_lines(p) for p in inputs]
    streams = [iter(read_jsonl(p)) for p in inputs]
    # Input i's k-th cut goes at position (k + 0.5) / n_i of the output; the heap merges them.
    heap = [(0.5 / n, i, 0) for i, n in enumerate(counts) if n]
    heapq.heapify(heap)
    record = RecordOnTheWay(output)
    writer = _Writer(output)
    try:
        while heap:
            _, i, k = heapq.heappop(heap)
            cut = next(streams[i])
            writer.write(cut)
            record.add(cut, inputs[i])
            if k + 1 < counts[i]:
                heapq.heappush(heap, ((k + 1.5) / counts[i], i, k + 1))
    except BaseException:
        writer.discard()
        raise
    writer.finish()
    record.save("interleave")
    print(f"interleave: {sum(counts)} cuts from {len(inputs)} manifest(s) ({', '.join(map(str, counts))}) -> {output}")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m valle.data.emilia", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("prepare", help="recordings + supervisions manifests for bin/tokenizer.py")
    r.add_argument("--corpus-dir", type=Path, required=True, help="Emilia's root (holds raw/EN, raw/ZH, ...)")
    r.add_argument("--output-dir", type=Path, required=True)
    r.add_argument("--languages", default=" ".join(LANGUAGES))
    r.add_argument("--min-dnsmos", type=float, default=0.0,
                   help="leave out rows whose DNSMOS score is below this (0: keep all)")
    r.add_argument("--num-jobs", type=int, default=4, help="threads reading mp3 headers")
    m = sub.add_parser("interleave", help="join cut manifests, each spread evenly over the output")
    m.add_argument("output", type=Path)
    m.add_argument("inputs", type=Path, nargs="+")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "interleave":
            interleave(args.output, args.inputs)
            return 0
        languages = args.languages.split()
        check_languages(languages)
        for lang in languages:
            prepare_language(args.corpus_dir, args.output_dir, lang, args.min_dnsmos, args.num_jobs)
    except ManifestError as e:
        print(f"{p.prog} {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

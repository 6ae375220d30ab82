#!/usr/bin/env python3
"""Tokenize lhotse manifests: phonemes (espeak) + EnCodec codes (lhotse features).

Input : {src-dir}/{prefix}_recordings_{part}.{suffix} and {prefix}_supervisions_{part}.{suffix}
Output: {output-dir}/{prefix}_cuts_{part}.{suffix}      tokenized cuts (codes as features,
                                                          phonemes in supervisions[0].custom)
        {output-dir}/{prefix}_bad_cuts_{part}.tsv        one line per excluded cut (id, reason)
        {output-dir}/unique_text_tokens.k2symbols         symbol table (k2 format)

Restartable: a part whose cuts file exists is skipped; outputs are written to a
temporary file and renamed when the part is complete.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# Runs as a script from a checkout without installation, too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from valle.data import validation as V  # noqa: E402

logger = logging.getLogger("tokenizer")

TEXT_TOKENS_FILE = "unique_text_tokens.k2symbols"
LANGUAGE_NAMES = {"english": "en-us", "en": "en-us", "chinese": "cmn", "zh": "cmn", "mandarin": "cmn"}


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src-dir", type=Path, default=Path("data/manifests"))
    p.add_argument("--output-dir", type=Path, default=Path("data/tokenized"))
    p.add_argument("--prefix", default="libritts")
    p.add_argument("--dataset-parts", default="dev-clean test-clean", help="space-separated parts")
    p.add_argument("--suffix", default="jsonl.gz")
    p.add_argument("--text-extractor", default="espeak", choices=["espeak"])
    p.add_argument("--language", default="en-us", help="espeak voice when a supervision has no language")
    p.add_argument("--audio-extractor", default="Encodec", choices=["Encodec"])
    p.add_argument("--encodec-checkpoint", default=None, help="EnCodec 24 kHz state dict (never downloaded)")
    p.add_argument(
        "--allow-random-encodec", action="store_true",
        help="use a randomly initialised EnCodec when no checkpoint is found (tests/demos: audio is noise)",
    )
    p.add_argument("--text-tokens", type=Path, default=None,
                   help="a fixed symbol table: symbols outside it are reported, not added")
    p.add_argument("--num-jobs", type=int, default=1, help="parallel EnCodec worker processes")
    p.add_argument("--batch-duration", type=float, default=60.0, help="seconds of audio per EnCodec batch")
    p.add_argument("--filter-min-duration", type=float, default=0.1)
    p.add_argument("--filter-max-duration", type=float, default=40.0)
    p.add_argument("--max-phones-per-second", type=float, default=V.DEFAULT_MAX_PHONES_PER_SECOND)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of random EnCodec weights")
    return p


def espeak_language(sup_language: str | None, default: str) -> str:
    if not sup_language:
        return default
    return LANGUAGE_NAMES.get(sup_language.strip().lower(), sup_language.strip().lower())


# ----------------------------------------------------------------------------- audio workers
@dataclass
class AudioJobConfig:
    device: str
    checkpoint: str | None
    allow_random: bool
    seed: int
    storage_dir: str
    threads: int


_worker: dict = {}


def _init_worker(cfg: AudioJobConfig) -> None:
    import torch
    from lhotse import NumpyFilesWriter

    from valle.data.audio import AudioTokenizer

    torch.set_num_threads(cfg.threads)
    _worker["tokenizer"] = AudioTokenizer(cfg.device, cfg.checkpoint, cfg.allow_random, cfg.seed)
    _worker["storage"] = NumpyFilesWriter(cfg.storage_dir)


def _encode_batch(cut_dicts: list[dict]) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """Load + encode one batch; return tokenized cut dicts and (id, reason, detail) for bad ones."""
    from lhotse.serialization import deserialize_item

    from valle.data.audio import encode_cut_batch, to_mono_24k

    cuts, wavs, bad = [], [], []
    for d in cut_dicts:
        cut = deserialize_item(d)
        try:
            samples = cut.load_audio()
        except Exception as e:  # lhotse/soundfile raise many types on corrupt files
            bad.append((cut.id, V.UNREADABLE_AUDIO, f"{type(e).__name__}: {e}"[:300]))
            continue
        if samples.size == 0 or samples.shape[-1] == 0:
            bad.append((cut.id, V.ZERO_LENGTH_AUDIO, "audio holds no samples"))
            continue
        cuts.append(cut)
        wavs.append(to_mono_24k(samples, cut.sampling_rate))
    done = encode_cut_batch(cuts, _worker["tokenizer"], _worker["storage"], wavs) if cuts else []
    return [c.to_dict() for c in done], bad


# ----------------------------------------------------------------------------- per part
def load_part_cuts(args, part: str):
    from lhotse import CutSet, RecordingSet, SupervisionSet

    src = args.src_dir
    rec_path = src / f"{args.prefix}_recordings_{part}.{args.suffix}"
    sup_path = src / f"{args.prefix}_supervisions_{part}.{args.suffix}"
    for path in (rec_path, sup_path):
        if not path.is_file():
            raise FileNotFoundError(f"part {part!r}: missing manifest {path} (check --src-dir/--prefix/--suffix)")
    recordings = RecordingSet.from_file(rec_path)
    supervisions = SupervisionSet.from_file(sup_path)
    cuts = CutSet.from_manifests(recordings=recordings, supervisions=supervisions)
    return cuts


def tokenize_text(args, cuts, report: V.ValidationReport, table):
    """Cheap checks first (durations, text) so bad items never reach EnCodec. Returns good cuts
    with phonemes stored on supervisions[0].custom and the set of symbols seen."""
    from lhotse.utils import fastcopy

    from valle.data.text import TextTokenizationError, TextTokenizer

    tokenizer = TextTokenizer(language=args.language)
    good, seen = [], set()
    for cut in cuts:
        report.checked += 1
        if not cut.supervisions:
            report.add(cut.id, V.NO_SUPERVISION, "recording without a supervision")
            continue
        bad = V.check_duration(cut.duration, args.filter_min_duration, args.filter_max_duration)
        if bad:
            report.add(cut.id, *bad)
            continue
        if len(cut.supervisions) > 1:
            # One utterance per cut: TTS needs the text of exactly this audio.
            cut = cut.trim_to_supervisions(keep_overlapping=False)[0]  # noqa: PLW2901
        sup = cut.supervisions[0]
        text = (sup.text or "").strip()
        if not text:
            report.add(cut.id, V.EMPTY_TEXT, "supervision text is empty")
            continue
        language = espeak_language(sup.language, args.language)
        try:
            ph = tokenizer.phonemize_one(text, language)
        except TextTokenizationError as e:
            report.add(cut.id, V.PHONEMIZE_FAILED, str(e)[:300])
            continue
        bad = V.check_text_symbols(text, language, ph.symbols, ph.language_switches, cut.duration,
                                   args.max_phones_per_second)
        if bad is None and table is not None:
            bad = V.check_known_symbols(ph.symbols, table)
        if bad:
            report.add(cut.id, *bad)
            continue
        custom = dict(sup.custom or {})
        custom["tokens"] = {"text": ph.symbols}
        custom["num_text_tokens"] = len(ph.symbols)
        sup = fastcopy(sup, custom=custom)
        good.append(fastcopy(cut, supervisions=[sup]))
        seen.update(ph.symbols)
    return good, seen


def batches_by_duration(cuts, batch_duration: float, window: int = 512):
    """Batches of about ``batch_duration`` seconds. Cuts are sorted by duration within windows
    of ``window`` cuts so a batch pads little (EnCodec runs over the padding too) while the
    output keeps roughly the manifest's order."""
    for start in range(0, len(cuts), window):
        yield from _batches(sorted(cuts[start : start + window], key=lambda c: c.duration), batch_duration)


def _batches(cuts, batch_duration: float):
    batch, total = [], 0.0
    for cut in cuts:
        if batch and total + cut.duration > batch_duration:
            yield batch
            batch, total = [], 0.0
        batch.append(cut)
        total += cut.duration
    if batch:
        yield batch


def tokenize_part(args, part: str) -> V.ValidationReport | None:
    from lhotse import CutSet
    from tqdm import tqdm

    from valle.data.symbols import SymbolTable

    out_dir = args.output_dir
    out_path = out_dir / f"{args.prefix}_cuts_{part}.{args.suffix}"
    report_path = out_dir / f"{args.prefix}_bad_cuts_{part}.tsv"
    if out_path.is_file():
        logger.info("part %s: %s exists, skipping (delete it to redo)", part, out_path)
        return None
    t0 = time.time()
    cuts = load_part_cuts(args, part)
    report = V.ValidationReport()
    fixed_table = SymbolTable.from_file(args.text_tokens) if args.text_tokens else None
    good, seen = tokenize_text(args, cuts, report, fixed_table)
    logger.info("part %s: text done, %d cuts pass, %d excluded so far", part, len(good), len(report))

    storage_dir = out_dir / f"{args.prefix}_encodec_{part}"
    jobs = max(1, args.num_jobs)
    cfg = AudioJobConfig(args.device, args.encodec_checkpoint, args.allow_random_encodec, args.seed,
                         str(storage_dir), max(1, (os.cpu_count() or 1) // jobs))
    batches = [[c.to_dict() for c in b] for b in batches_by_duration(good, args.batch_duration)]
    tmp_path = out_dir / f".{args.prefix}_cuts_{part}.tmp.{args.suffix}"
    n_ok = 0
    with CutSet.open_writer(tmp_path) as writer:
        progress = tqdm(total=len(good), desc=f"encodec {part}", unit="cut", disable=None)
        if jobs == 1:
            _init_worker(cfg)
            results = map(_encode_batch, batches)
            pool = None
        else:
            import multiprocessing as mp

            pool = ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"),
                                       initializer=_init_worker, initargs=(cfg,))
            results = pool.map(_encode_batch, batches)  # ordered: output is deterministic
        try:
            from lhotse.serialization import deserialize_item

            for done, bad in results:
                for d in done:
                    writer.write(deserialize_item(d))
                for cut_id, reason, detail in bad:
                    report.add(cut_id, reason, detail)
                n_ok += len(done)
                progress.update(len(done) + len(bad))
        finally:
            progress.close()
            if pool is not None:
                pool.shutdown()

    if fixed_table is None:
        table_path = out_dir / TEXT_TOKENS_FILE
        table = SymbolTable.from_file(table_path) if table_path.is_file() else SymbolTable()
        for sym in sorted(seen):
            table.add(sym)
        table.to_file(table_path)
    report.write(report_path)
    # The cuts file is the "part done" marker: rename it last.
    os.replace(tmp_path, out_path)
    logger.info("part %s: %d cuts tokenized, %s; %.1fs -> %s (bad items: %s)",
                part, n_ok, report.summary(), time.time() - t0, out_path, report_path)
    return report


def main(argv: list[str] | None = None) -> int:
    args = get_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    parts = args.dataset_parts.split()
    totals = V.ValidationReport()
    for part in parts:
        report = tokenize_part(args, part)
        if report is not None:
            totals.extend(report)
            print(f"[{part}] {report.summary()}")
    print(f"tokenizer: {len(parts)} part(s); {totals.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

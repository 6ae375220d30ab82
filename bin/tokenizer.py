#!/usr/bin/env python3
"""Tokenize lhotse manifests: phonemes (espeak) + EnCodec codes (lhotse features).

Input : {src-dir}/{prefix}_recordings_{part}.{suffix} and {prefix}_supervisions_{part}.{suffix}
Output: {output-dir}/{prefix}_cuts_{part}.{suffix}      one cut per supervision, codes as
                                                          features, phonemes in supervisions[0].custom
        {output-dir}/{prefix}_{codec}_{part}/chunk-*.h5  the codes (NumpyHdf5Writer, int16)
        {output-dir}/{prefix}_bad_cuts_{part}.tsv        one line per excluded item (id, reason)
        {output-dir}/{prefix}_stats_{part}.json          hours, phonemes/s, per-language counts
        {output-dir}/{prefix}_text_stats.json            the same per part (--max-text-tokens default)
        {output-dir}/unique_text_tokens.k2symbols         symbol table (k2 format, merged under a lock)

Restartable: a part whose cuts file exists is skipped; inside a part, finished chunks
(--chunk-size cuts) are kept, so a crash loses at most one chunk, and a relaunch may come at
once (a killed worker leaves no process holding its chunk). Parts may run as parallel jobs
into the same --output-dir.

Many workers on one part: `torchrun --nnodes N --nproc-per-node G bin/tokenizer.py ...` (each
on cuda:LOCAL_RANK), a SLURM job array, or --num-shards N --shard-index K per process. Worker
K of N takes chunks K, K+N, K+2N, ...; the last to finish joins the part, so the output reads
exactly like one process's (docs/data.md, "Tokenizing on many GPUs").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

# Runs as a script from a checkout without installation, too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from valle.args import str2bool  # noqa: E402
from valle.data import validation as V  # noqa: E402

logger = logging.getLogger("tokenizer")

TEXT_TOKENS_FILE = "unique_text_tokens.k2symbols"


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bin/tokenizer.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src-dir", type=Path, default=Path("data/manifests"))
    p.add_argument("--output-dir", type=Path, default=Path("data/tokenized"))
    p.add_argument("--prefix", default="libritts")
    p.add_argument("--dataset-parts", default="dev-clean test-clean", help="space-separated parts")
    p.add_argument("--suffix", default="jsonl.gz")
    p.add_argument("--text-extractor", default="espeak", choices=["espeak", "pypinyin", "vallex-bpe"],
                   help="pypinyin: Mandarin characters -> pinyin initials/finals with tones; "
                        "vallex-bpe: Plachtaa/VALL-E-X's phonemes (en, zh, ja), with --text-tokens "
                        "from `python -m valle.data.vallex_text symbols` (docs/inference.md)")
    p.add_argument("--language", default="en-us",
                   help="espeak voice for supervisions without a language (names, ISO 639-1/3 work too)")
    p.add_argument("--audio-extractor", default="Encodec", choices=["Encodec"])
    p.add_argument("--codec", default="encodec", choices=["encodec", "mel-rvq", "auto"],
                   help="mel-rvq: the offline codec fitted on the corpus ({output-dir}/mel_rvq.pt, "
                        "python -m valle.codec fit); auto: encodec where its weights are present")
    p.add_argument("--encodec-checkpoint", default=None,
                   help="EnCodec 24 kHz state dict (default: the torch hub cache, downloaded with a "
                        "hash check when missing and the network is there)")
    p.add_argument("--download-encodec", type=str2bool, default=True,
                   help="fetch the official weights into the hub cache when missing")
    p.add_argument("--allow-random-encodec", action="store_true",
                   help="use a randomly initialised EnCodec when no weights are found (tests/demos: noise)")
    p.add_argument("--text-tokens", type=Path, default=None,
                   help="a fixed symbol table: symbols outside it are reported, not added")
    p.add_argument("--num-jobs", type=int, default=2,
                   help="DataLoader workers that load and resample audio (0: in the main process)")
    p.add_argument("--batch-duration", type=float, default=0.0,
                   help="seconds of audio per encoder batch (0: 20 on CPU, 300 on a GPU)")
    p.add_argument("--chunk-size", type=int, default=2000, help="cuts per resumable chunk")
    p.add_argument("--filter-min-duration", type=float, default=0.1)
    p.add_argument("--filter-max-duration", type=float, default=40.0)
    p.add_argument("--max-phones-per-second", type=float, default=V.DEFAULT_MAX_PHONES_PER_SECOND)
    p.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: all cores)")
    p.add_argument("--log-interval", type=float, default=30.0, help="seconds between progress log lines")
    p.add_argument("--shar-dir", type=Path, default=None,
                   help="also export each finished part as Lhotse Shar shards into SHAR_DIR/<part>")
    p.add_argument("--shar-shard-size", type=int, default=1000, help="cuts per Shar shard")
    p.add_argument("--seed", type=int, default=0, help="seed of random EnCodec weights")
    p.add_argument("--num-shards", type=int, default=None,
                   help="workers sharing each part, one process each (default: torchrun's WORLD_SIZE, "
                        "a SLURM array's task count, else 1); worker K takes chunks K, K+N, ...")
    p.add_argument("--shard-index", type=int, default=None, help="this worker's number K in [0, --num-shards)")
    return p


def options(args) -> object:
    from valle.data.pipeline import Options

    return Options(
        src_dir=args.src_dir, output_dir=args.output_dir, prefix=args.prefix, suffix=args.suffix,
        language=args.language, text_tokens=args.text_tokens, num_workers=max(0, args.num_jobs),
        batch_duration=args.batch_duration, chunk_size=args.chunk_size,
        filter_min_duration=args.filter_min_duration, filter_max_duration=args.filter_max_duration,
        max_phones_per_second=args.max_phones_per_second, log_interval=args.log_interval,
        shar_dir=args.shar_dir, shar_shard_size=args.shar_shard_size,
    )


def keep_freed_memory() -> None:
    """glibc hands every large freed buffer back to the OS and maps it again on the next op;
    for EnCodec on CPU that churn was 40-50% of the CPU time (system time). Raise the mmap
    and trim thresholds so buffers are reused. Linux/glibc only; elsewhere a no-op."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def manifest_paths(args, part: str) -> tuple[Path, Path]:
    src = args.src_dir
    return (src / f"{args.prefix}_recordings_{part}.{args.suffix}",
            src / f"{args.prefix}_supervisions_{part}.{args.suffix}")


def sources_path(args, part: str) -> Path:
    """Where a part records which manifests it was tokenized from."""
    return args.output_dir / f"{args.prefix}_sources_{part}.json"


def manifests_fingerprint(args, part: str) -> dict[str, str]:
    """sha256 of each source manifest's content (decompressed: gzip headers carry a time)."""
    import gzip
    import hashlib
    import zlib

    from valle.data.manifests import ManifestError

    out = {}
    for path in manifest_paths(args, part):
        opener = gzip.open if path.name.endswith(".gz") else open
        digest = hashlib.sha256()
        try:
            with opener(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        except (EOFError, OSError, zlib.error) as e:
            raise ManifestError(f"{path}: truncated or corrupt ({type(e).__name__}: {e}); "
                                "re-create the manifest") from None
        out[path.name] = digest.hexdigest()
    return out


def check_sources(args, part: str, what: str) -> None:
    """A part's outputs (finished cuts, or chunks to resume) must come from the manifests there
    now: a corpus re-made with other audio or text would otherwise train on stale tokens."""
    from valle.data.manifests import ManifestError

    record = sources_path(args, part)
    if not record.is_file():
        return  # tokenized before sources were recorded: nothing to compare
    if json.loads(record.read_text(encoding="utf-8")) != manifests_fingerprint(args, part):
        raise ManifestError(
            f"part {part!r}: {what} in {args.output_dir} came from other manifests than "
            f"{args.src_dir} holds now (the corpus changed since it was tokenized): delete "
            f"{args.output_dir}/{args.prefix}_*_{part}* (and .{args.prefix}_chunks_{part} if there) "
            f"to tokenize the part again; for the mel-rvq codec also mel_rvq.pt, to refit it")


def write_sources(args, part: str) -> None:
    """Atomically: parallel workers write the same record, and read it on resume."""
    record = sources_path(args, part)
    tmp = record.with_name(f".{record.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifests_fingerprint(args, part), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, record)


def worker_device(device, requested: str, local_rank: int):
    """A worker launched with a LOCAL_RANK uses its own GPU: ``auto`` and ``cuda`` become
    ``cuda:LOCAL_RANK``; an explicit ``cuda:N`` or ``cpu`` is kept."""
    import torch

    if device.type == "cuda" and requested in ("auto", "cuda") and local_rank:
        return torch.device("cuda", local_rank)
    return device


def run(args) -> int:
    import torch

    from valle.codec import resolve_codec_name
    from valle.codec.encodec import AudioTokenizer, resolve_device, resolve_encodec_weights
    from valle.data.languages import espeak_voice
    from valle.data.manifests import ManifestError, load_cuts
    from valle.data.pipeline import PartTokenizer, language_report
    from valle.data.sharding import resolve_shard
    from valle.data.symbols import SymbolTable
    from valle.data.text import TextTokenizer

    opts = options(args)
    parts = args.dataset_parts.split()
    # Everything that can fail for the whole run is checked before any work: the default
    # voice, the symbol table, every manifest's presence, the codec weights.
    shard = resolve_shard(args.num_shards, args.shard_index)
    default_voice = espeak_voice(args.language, "en-us")
    fixed_table = SymbolTable.from_file(args.text_tokens) if args.text_tokens else None
    todo = []
    for part in parts:
        done = (args.output_dir / f"{args.prefix}_cuts_{part}.{args.suffix}").is_file()
        for path in manifest_paths(args, part):
            if not path.is_file() and not done:
                raise ManifestError(f"part {part!r}: missing manifest {path} (check --src-dir/--prefix/--suffix)")
        resuming = (args.output_dir / f".{args.prefix}_chunks_{part}").is_dir()
        if (done or resuming) and all(path.is_file() for path in manifest_paths(args, part)):
            check_sources(args, part, "its cuts" if done else "its finished chunks")
        if done:
            logger.info("part %s: its cuts file exists, skipping (delete it to redo)", part)
            continue
        todo.append(part)
    device = worker_device(resolve_device(args.device), args.device, shard.local_rank)
    if not shard.alone:
        logger.info("%s: chunks %d, %d+%d, ... of each part", shard.describe(), shard.index, shard.index,
                    shard.count)
    args.codec = resolve_codec_name(args.codec, args.encodec_checkpoint)  # auto: encodec if its weights are here
    if todo and args.codec == "mel-rvq":
        from valle.codec import make_audio_tokenizer

        codec = make_audio_tokenizer("mel-rvq", args.output_dir, device="cpu")
    elif todo:
        weights = resolve_encodec_weights(args.encodec_checkpoint, args.allow_random_encodec,
                                          args.download_encodec)
        if device.type == "cpu":
            torch.set_num_threads(args.threads or torch.get_num_threads())
            keep_freed_memory()
        if not opts.batch_duration:
            opts.batch_duration = 20.0 if device.type == "cpu" else 300.0
        logger.info("device %s, %d CPU threads, %d audio workers", device, torch.get_num_threads(),
                    opts.num_workers)
        codec = AudioTokenizer(device, weights, allow_random_weights=weights is None, seed=args.seed,
                               download=False)
    if todo:
        runner = PartTokenizer(opts, codec, TextTokenizer(default_voice, backend=args.text_extractor),
                               fixed_table)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if todo:  # which codec made the codes: inference finds it through the checkpoint's manifest dir
        from valle.codec import write_codec_record

        write_codec_record(args.output_dir, codec)
    totals = V.ValidationReport()
    for part in todo:
        t0 = time.time()
        rec_path, sup_path = manifest_paths(args, part)
        load_report = V.ValidationReport()
        cuts = load_cuts(rec_path, sup_path, load_report)
        write_sources(args, part)
        logger.info("part %s: %d cuts (one per supervision) from %s; %d manifest problems",
                    part, len(cuts), rec_path.parent, len(load_report))
        result = runner.run(part, cuts, load_report, shard)
        if result is None:  # other workers' chunks are still running, or one joined the part
            print(f"[{part}] {shard.describe()}: its chunks are done; the last worker to finish joins the part")
            continue
        report, stats = result
        totals.extend(report)
        paths = runner.paths(part)
        elapsed = time.time() - t0
        print(f"[{part}] {stats.cuts} cuts, {stats.seconds / 3600:.3f} h, "
              f"{stats.phones / max(stats.seconds, 1e-9):.1f} phonemes/s; {report.summary()}; "
              f"{elapsed:.1f}s ({stats.seconds / max(elapsed, 1e-9):.1f}x real time) -> {paths['cuts']}")
        print(f"[{part}] per language (espeak voice):")
        for line in language_report(stats):
            print(f"[{part}] {line}")
        if report.entries:
            print(f"[{part}] bad items listed in {paths['report']}")
        if args.shar_dir is not None:
            print(f"[{part}] Lhotse Shar shards in {args.shar_dir / part}")
    print(f"tokenizer: {len(parts)} part(s), {len(todo)} tokenized; {totals.summary()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from valle.codec.encodec import EncodecWeightsError
    from valle.data.languages import UnknownLanguageError
    from valle.data.manifests import ManifestError
    from valle.data.sharding import ShardError

    args = get_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (ManifestError, EncodecWeightsError, UnknownLanguageError, ShardError, FileNotFoundError,
            ValueError) as e:
        # Bad input for the whole run: one line naming the file or flag, no traceback.
        print(f"bin/tokenizer.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

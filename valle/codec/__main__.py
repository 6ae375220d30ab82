"""python -m valle.codec fit: fit the mel-rvq codec on a training corpus.

    python -m valle.codec fit --recordings data/manifests/tiny_recordings_train.jsonl.gz \
        --output-dir data/tokenized

writes ``{output-dir}/mel_rvq.pt`` (what ``bin/tokenizer.py --codec mel-rvq`` loads) and
``{output-dir}/audio_codec.json``. Fit on the training part only: held-out audio must not
shape the codebooks.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

logger = logging.getLogger("valle.codec")


def iter_manifest_audio(paths: Sequence[Path], limit: int | None = None) -> Iterator:
    """24 kHz mono waveforms of every recording (or cut) in lhotse manifests; progress logged."""
    from lhotse import load_manifest_lazy

    from valle.codec.audio import to_mono_24k, use_torch_resampling_in_lhotse

    use_torch_resampling_in_lhotse()

    n, t0 = 0, time.time()
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"manifest {path}: no such file")
        for item in load_manifest_lazy(path):
            try:
                samples = item.load_audio()
            except Exception as e:  # the message names the item; fitting on a partial corpus is wrong
                raise RuntimeError(f"{path}: cannot load audio of {item.id}: {e}") from e
            sr = getattr(item, "sampling_rate", None)
            yield to_mono_24k(samples, sr)
            n += 1
            if n % 200 == 0:
                logger.info("read %d utterances (%.1f/s)", n, n / max(1e-6, time.time() - t0))
            if limit and n >= limit:
                return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m valle.codec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit mel-rvq codebooks on training audio")
    f.add_argument("--recordings", type=Path, nargs="*", default=[], help="lhotse recording manifests")
    f.add_argument("--cuts", type=Path, nargs="*", default=[], help="lhotse cut manifests")
    f.add_argument("--output-dir", type=Path, required=True, help="the tokenized manifest dir")
    f.add_argument("--iterations", type=int, default=12)
    f.add_argument("--max-frames", type=int, default=200_000)
    f.add_argument("--limit", type=int, default=None, help="fit on the first N utterances only")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--first-codebook-size", type=int, default=1024,
                   help="codes in use in codebook 0 (what the AR predicts); fewer learn faster")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from valle.codec import write_codec_record
    from valle.codec.mel_rvq import STATE_FILE, FitConfig, MelRvqCodec

    paths = list(args.recordings) + list(args.cuts)
    if not paths:
        p.error("fit: give --recordings or --cuts")
    if not 1 <= args.first_codebook_size <= 1024:
        p.error("--first-codebook-size must be in [1, 1024]")
    cfg = FitConfig(iterations=args.iterations, max_frames=args.max_frames, seed=args.seed,
                    first_codebook_size=args.first_codebook_size)
    try:
        codec = MelRvqCodec.fit(iter_manifest_audio(paths, args.limit), cfg)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = codec.save(args.output_dir / STATE_FILE)
    write_codec_record(args.output_dir, codec)
    logger.info("mel-rvq codec fitted on %s -> %s", codec.info, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

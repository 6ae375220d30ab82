"""EnCodec 24 kHz encode (and decode) throughput: valle's own model against the encodec package,
same weights, same audio, interleaved repeats (a shared machine's drift hits both alike).

    python scripts/bench_codec.py [--threads 2] [--clips 4] [--seconds 5] [--repeats 7]

Prints a markdown table: seconds of audio per wall second (median over repeats) for each, and
ours/package. The package is the reference extra (pip install .[ref]); without it only our
model is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import codec_reference as ref  # noqa: E402
from valle.codec.encodec_model import EncodecNet  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the cores used)")
    p.add_argument("--clips", type=int, default=4, help="clips per batch")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds per clip")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats of each, interleaved")
    return p.parse_args(argv)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    wav = ref.signal(args.seconds, seed=0, batch=args.clips)
    audio_s = args.clips * args.seconds
    ours = EncodecNet()
    ref.fill_seeded(ours)
    ours.eval().fold_weight_norm()
    try:
        package = ref.encodec_package_model()
        package.set_target_bandwidth(6.0)
    except ImportError:
        package = None
    with torch.inference_mode():
        codes = ours.encode(wav)
        if package is not None:  # the same codes, or the comparison means nothing
            assert torch.equal(codes, ref.encodec_package_codes(package, wav, 6.0)), "codes differ"
        jobs = {"valle": (lambda: ours.encode(wav), lambda: ours.decode(codes))}
        if package is not None:
            jobs["encodec 0.1.1"] = (lambda: package.encode(wav), lambda: package.decode([(codes, None)]))
        for enc, dec in jobs.values():  # warm-up
            enc(), dec()
        times = {name: ([], []) for name in jobs}
        for _ in range(args.repeats):
            for name, (enc, dec) in jobs.items():
                times[name][0].append(_timed(enc))
                times[name][1].append(_timed(dec))
    print(f"EnCodec 24 kHz, 6 kbps; {args.clips} clips x {args.seconds:g} s; {args.threads} threads; "
          f"torch {torch.__version__}; median of {args.repeats} interleaved repeats")
    print()
    print("| model | encode (audio s / s) | decode (audio s / s) |")
    print("|---|---|---|")
    speed = {}
    for name, (enc, dec) in times.items():
        speed[name] = (audio_s / statistics.median(enc), audio_s / statistics.median(dec))
        print(f"| {name} | {speed[name][0]:.1f} | {speed[name][1]:.1f} |")
    if package is not None:
        (oe, od), (pe, pd) = speed["valle"], speed["encodec 0.1.1"]
        print(f"| valle / encodec | {oe / pe:.2f}x | {od / pd:.2f}x |")


if __name__ == "__main__":
    main()

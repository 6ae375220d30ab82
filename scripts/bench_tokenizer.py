#!/usr/bin/env python
"""Tokenization throughput: x real time per CPU core (phonemes + codes + writes).

Makes an LJSpeech-layout corpus of tones (22.05 kHz, so resampling is paid too),
prepares its manifests with lhotse, then runs bin/tokenizer.py on one CPU thread
with a randomly initialised EnCodec (the same cost as the real weights) and
reports seconds of audio per CPU second of the tokenizer process.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["The cat sat down on the warm mat by the door.", "Rain fell softly on the tin roof all day.",
         "Where did you leave the keys this morning?", "We walked home together after the game."]


def make_corpus(root: Path, n: int, seconds: float, sr: int = 22050) -> Path:
    corpus = root / "LJSpeech-1.1"
    (corpus / "wavs").mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        t = np.arange(int(seconds * sr)) / sr
        x = 0.3 * np.sin(2 * np.pi * (120 + 7 * i) * t) + 0.05 * rng.standard_normal(t.size)
        utt = f"LJ001-{i + 1:04d}"
        sf.write(corpus / "wavs" / f"{utt}.wav", x.astype(np.float32), sr, subtype="PCM_16")
        text = TEXTS[i % len(TEXTS)]
        lines.append(f"{utt}|{text}|{text}")
    (corpus / "metadata.csv").write_text("\n".join(lines) + "\n")
    return corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cuts", type=int, default=40)
    p.add_argument("--seconds", type=float, default=6.0)
    args = p.parse_args()
    from lhotse.recipes import prepare_ljspeech

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = make_corpus(root, args.cuts, args.seconds)
        manifests = root / "manifests"
        prepare_ljspeech(corpus, manifests)
        cmd = [sys.executable, str(ROOT / "bin" / "tokenizer.py"), "--src-dir", str(manifests),
               "--output-dir", str(root / "out"), "--prefix", "ljspeech", "--dataset-parts", "all",
               "--num-jobs", "0", "--threads", "1", "--device", "cpu", "--allow-random-encodec"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    audio = args.cuts * args.seconds
    print(f"{args.cuts} cuts x {args.seconds:.0f} s at 22.05 kHz, EnCodec (random weights) on one CPU "
          "thread, start-up included\n")
    print("| audio | tokenizer CPU time | wall | x real time per CPU core |\n|---|---|---|---|")
    print(f"| {audio:.0f} s | {cpu:.1f} s | {wall:.1f} s | {audio / cpu:.1f}x |")


if __name__ == "__main__":
    main()

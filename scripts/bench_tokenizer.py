#!/usr/bin/env python
"""Tokenization throughput: x real time per CPU core (phonemes + codes + writes).

Makes an LJSpeech-layout corpus of tones (22.05 kHz, so resampling is paid too),
prepares its manifests with lhotse, then runs bin/tokenizer.py on one CPU thread
with a randomly initialised EnCodec (the same cost as the real weights) and
reports seconds of audio per CPU second of the tokenizer process.

Then the same corpus with 1 and with 2 workers on one part (`--num-shards 2 --shard-index K`,
two processes at once, as a SLURM array or torchrun starts them; each one CPU thread): wall
time from launch to the joined part, and the ratio. Two workers need two free cores to
approach 2x; on a loaded machine the ratio says so.
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


def tokenizer_cmd(manifests: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "bin" / "tokenizer.py"), "--src-dir", str(manifests),
            "--output-dir", str(out), "--prefix", "ljspeech", "--dataset-parts", "all",
            "--num-jobs", "0", "--threads", "1", "--device", "cpu", "--allow-random-encodec", *extra]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run_workers(manifests: Path, out: Path, workers: int, chunk_size: int) -> tuple[float, float]:
    """(wall, CPU) seconds for ``workers`` processes to tokenize the part together (launch to
    join; CPU summed over the workers)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    procs = [subprocess.Popen(tokenizer_cmd(manifests, out, "--chunk-size", str(chunk_size),
                                            "--num-shards", str(workers), "--shard-index", str(k)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
             for k in range(workers)]
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"bench_tokenizer: a worker exited {proc.returncode}")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if not (out / "ljspeech_cuts_all.jsonl.gz").is_file():
        raise SystemExit("bench_tokenizer: the workers did not join the part")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cuts", type=int, default=40)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--chunk-size", type=int, default=5, help="cuts per chunk in the workers comparison")
    args = p.parse_args()
    from lhotse.recipes import prepare_ljspeech

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = make_corpus(root, args.cuts, args.seconds)
        manifests = root / "manifests"
        prepare_ljspeech(corpus, manifests)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(tokenizer_cmd(manifests, root / "out"), check=True, capture_output=True, env=ENV)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls = {n: run_workers(manifests, root / f"out{n}", n, args.chunk_size) for n in (1, 2)}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    audio = args.cuts * args.seconds
    print(f"{args.cuts} cuts x {args.seconds:.0f} s at 22.05 kHz, EnCodec (random weights) on one CPU "
          "thread, start-up included\n")
    print("| audio | tokenizer CPU time | wall | x real time per CPU core |\n|---|---|---|---|")
    print(f"| {audio:.0f} s | {cpu:.1f} s | {wall:.1f} s | {audio / cpu:.1f}x |")
    print(f"\nWorkers on one part (--num-shards N, --chunk-size {args.chunk_size}, one thread each, "
          f"{os.cpu_count()} CPU cores here), launch to joined part:\n")
    print("| workers | wall | x real time | throughput vs 1 worker | CPU, all workers | CPU vs 1 worker |\n"
          "|---|---|---|---|---|---|")
    for n, (w, c) in walls.items():
        print(f"| {n} | {w:.1f} s | {audio / w:.1f}x | {walls[1][0] / w:.2f}x | {c:.1f} s | {c / walls[1][1]:.2f}x |")


if __name__ == "__main__":
    main()

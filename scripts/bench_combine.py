"""`python -m valle.data.recipe combine` against corpus size: wall time and peak RSS.

combine checks every cut id against all others. It used to keep them in a Python set (about
100 bytes an id: ~1 GB at Libriheavy large's 10M cuts); it now keeps them in an on-disk
SQLite table, so its memory should not grow with the corpus. Each size: two parts of
synthetic tokenized cut lines (Libriheavy-like ids, a supervision with num_text_tokens),
combined into ``x_cuts_train.jsonl.gz`` (so the extremes record is made too); beside it, the
peak RSS of a process that only reads the same ids into a set (what the old check held).

    python scripts/bench_combine.py [--sizes 100000,400000]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMBINE = """
import resource, sys
from valle.data import recipe
assert recipe.main(["combine", *sys.argv[1:]]) == 0
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
SET_OF_IDS = """
import gzip, json, resource, sys
ids = set()
for path in sys.argv[1:]:
    with gzip.open(path, "rt") as f:
        for line in f:
            ids.add(json.loads(line)["id"])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_part(path: Path, part: int, n: int, rng: random.Random) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for k in range(n):
            cut_id = f"large/{part}/{k % 997:04d}/book_{k // 997}/utt_{k:08d}"
            d = round(rng.uniform(1.0, 30.0), 2)
            sup = {"id": cut_id, "recording_id": cut_id, "start": 0.0, "duration": d, "channel": 0,
                   "text": "x" * 120, "custom": {"num_text_tokens": int(d * rng.uniform(8, 20))}}
            f.write(json.dumps({"id": cut_id, "start": 0.0, "duration": d, "channel": 0,
                                "supervisions": [sup], "type": "MonoCut"}) + "\n")


def measure(size: int, tmp: Path) -> tuple[float, float, float]:
    rng = random.Random(size)
    parts = [tmp / f"x_cuts_p{i}.jsonl.gz" for i in range(2)]
    for i, path in enumerate(parts):
        write_part(path, i, size // 2, rng)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", COMBINE, str(tmp / "x_cuts_train.jsonl.gz"), *map(str, parts)],
                         cwd=ROOT, check=True, capture_output=True, text=True, timeout=3600,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    combine_mb = int(out.stdout.split()[-1]) / 1024
    out = subprocess.run([sys.executable, "-c", SET_OF_IDS, *map(str, parts)], check=True,
                         capture_output=True, text=True, timeout=3600)
    return seconds, combine_mb, int(out.stdout) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100000,400000", help="cuts per run, comma-separated")
    args = p.parse_args()
    print("| cuts | combine s | combine peak RSS MB | a set of the ids, peak RSS MB |")
    print("|---:|---:|---:|---:|")
    for size in sorted(int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            seconds, combine_mb, set_mb = measure(size, Path(tmp))
        print(f"| {size:,} | {seconds:.1f} | {combine_mb:.0f} | {set_mb:.0f} |", flush=True)


if __name__ == "__main__":
    main()

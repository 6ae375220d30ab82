#!/usr/bin/env python3
"""Start-up time and peak memory against corpus size (`make bench`).

The egs/tiny corpus (24 utterances) is replicated to N cuts: the training part's manifest
is written lazily, each copy with a unique id, every copy sharing the original's codes
(the same HDF5 file), with the extremes record bin/tokenizer.py would have written
(``{prefix}_extremes_{part}.json``); the symbol table, codec record, text statistics and
dev part are the original's. Then ``bin/trainer.py --max-steps 2`` runs on one CPU rank
with the trainer's default flags (the pessimistic scan included) except a tiny model, and
the table gives, per N, the wall time from launch to exit, the CPU time of the trainer and
its DataLoader workers (what a shared machine's load does not inflate), and the trainer
process's peak RSS (``ru_maxrss``). The sizes run interleaved, ``--repeats`` times each, in
one invocation; each column is the median, and the ratios are to the smallest size.

    python scripts/bench_startup.py [--sizes 10000,100000,1000000] [--repeats 3] [--data-dir DIR]

``--data-dir`` keeps the corpus and its replicas for the next run (default: a temporary
directory, removed at the end). ``--no-extremes`` leaves the records out, which is how a
corpus tokenized before them looks (the trainer then falls back to a pass).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ["--decoder-dim", "32", "--nhead", "2", "--num-decoder-layers", "1", "--device", "cpu",
         "--tensorboard", "false"]
PREFIX, PART = "tiny", "train"


def build_tiny(data_dir: Path) -> Path:
    """egs/tiny/prepare.sh's tokenized corpus (made once per --data-dir)."""
    tokenized = data_dir / "tiny" / "tokenized"
    if not (tokenized / f"{PREFIX}_cuts_{PART}.jsonl.gz").is_file():
        subprocess.run(["bash", str(ROOT / "egs/tiny/prepare.sh"), "--python", sys.executable,
                        "--data-dir", str(data_dir / "tiny"), "--limit", "24"],
                       cwd=ROOT, check=True, capture_output=True, timeout=900)
    return tokenized


def replicate(tokenized: Path, out: Path, num_cuts: int, extremes: bool) -> Path:
    """``out`` holds the corpus with its training part replicated to ``num_cuts`` cuts."""
    from valle.data.extremes import Extremes, extremes_path

    done = out / ".done"
    if done.is_file() and json.loads(done.read_text()) == {"cuts": num_cuts, "extremes": extremes}:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in tokenized.iterdir():
        if f.name not in (f"{PREFIX}_cuts_{PART}.jsonl.gz", extremes_path(tokenized, PREFIX, PART).name):
            (out / f.name).symlink_to(f.resolve())
    with gzip.open(tokenized / f"{PREFIX}_cuts_{PART}.jsonl.gz", "rt") as f:
        base = [json.loads(line) for line in f]
    record = Extremes()
    with gzip.open(out / f"{PREFIX}_cuts_{PART}.jsonl.gz", "wt", compresslevel=1) as f:
        for i in range(num_cuts):
            d = dict(base[i % len(base)])
            d["id"] = f"{d['id']}-r{i // len(base):07d}"
            d["supervisions"] = [dict(d["supervisions"][0], id=d["id"])]
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
            if extremes:
                record.add_dict(d)
    if extremes:
        record.write(extremes_path(out, PREFIX, PART))
    done.write_text(json.dumps({"cuts": num_cuts, "extremes": extremes}))
    return out


def run_trainer(manifest_dir: Path, exp_dir: Path) -> tuple[float, float, float]:
    """(wall seconds from launch to exit, CPU seconds, peak RSS of the trainer in MB)."""
    shutil.rmtree(exp_dir, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "bin/trainer.py"), "--manifest-dir", str(manifest_dir),
           "--dataset", PREFIX, "--exp-dir", str(exp_dir), "--max-steps", "2", *MODEL]
    t0 = time.perf_counter()
    with open(exp_dir.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _pid, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        tail = exp_dir.with_suffix(".log").read_text()[-3000:]
        raise RuntimeError(f"trainer failed on {manifest_dir}:\n{tail}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,100000,1000000", help="cuts in the training part, comma-separated")
    p.add_argument("--data-dir", type=Path, default=None, help="keep the corpora here (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=3, help="runs per size (interleaved); medians reported")
    p.add_argument("--no-extremes", action="store_true", help="no extremes records (the fallback pass)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="bench_startup_"))
    try:
        tokenized = build_tiny(data_dir)
        dirs = {}
        for n in sizes:
            t0 = time.perf_counter()
            dirs[n] = replicate(tokenized, data_dir / f"cuts-{n}", n, not args.no_extremes)
            print(f"# {n} cuts: corpus ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        runs: dict[int, list[tuple[float, float, float]]] = {n: [] for n in sizes}
        for repeat in range(args.repeats):
            for n in sizes:
                runs[n].append(run_trainer(dirs[n], data_dir / f"exp-{n}"))
                print(f"# {n} cuts, run {repeat + 1}: {runs[n][-1][0]:.1f}s wall, "
                      f"{runs[n][-1][1]:.1f}s CPU, {runs[n][-1][2]:.0f} MB", file=sys.stderr)
        med = {n: [statistics.median(r[i] for r in runs[n]) for i in range(3)] for n in sizes}
        base = med[sizes[0]]
        print("| cuts | launch to end of 2 steps, wall (s) | CPU (s) | peak RSS (MB) | wall ratio | "
              "CPU ratio | RSS ratio |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n in sizes:
            wall, cpu, rss = med[n]
            print(f"| {n:,} | {wall:.1f} | {cpu:.1f} | {rss:.0f} | {wall / base[0]:.2f} | "
                  f"{cpu / base[1]:.2f} | {rss / base[2]:.2f} |")
    finally:
        if args.data_dir is None:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

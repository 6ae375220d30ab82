#!/usr/bin/env python3
"""Start-up time and peak memory against corpus size (`make bench`).

The egs/tiny corpus (24 utterances) is replicated to N cuts: the training part's manifest
is written lazily, each copy with a unique id, every copy sharing the original's codes
(the same HDF5 file), with the extremes record bin/tokenizer.py would have written
(``{prefix}_extremes_{part}.json``); the symbol table, codec record, text statistics and
dev part are the original's. Then ``bin/trainer.py --max-steps 2`` runs on one CPU rank
with the trainer's default flags (the pessimistic scan included) except a tiny model, and
the table gives, per N, the wall time from launch to exit and the trainer process's peak
RSS (``ru_maxrss``: DataLoader workers are other processes). The sizes run one after the
other in one invocation; the last columns are the ratios to the smallest size.

    python scripts/bench_startup.py [--sizes 10000,100000,1000000] [--data-dir DIR]

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

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


class DictCut:
    """A cut dict seen as the extremes record reads a cut (no lhotse object per copy)."""

    def __init__(self, d: dict) -> None:
        self.d = d
        self.id, self.duration = d["id"], d["duration"]
        self.supervisions = [SimpleNamespace(custom=d["supervisions"][0]["custom"])]

    def to_dict(self) -> dict:
        return self.d


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
                record.add(DictCut(d))
    if extremes:
        record.write(extremes_path(out, PREFIX, PART))
    done.write_text(json.dumps({"cuts": num_cuts, "extremes": extremes}))
    return out


def run_trainer(manifest_dir: Path, exp_dir: Path) -> tuple[float, float, str]:
    """(seconds from launch to exit, peak RSS of the trainer process in MB, log tail)."""
    shutil.rmtree(exp_dir, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "bin/trainer.py"), "--manifest-dir", str(manifest_dir),
           "--dataset", PREFIX, "--exp-dir", str(exp_dir), "--max-steps", "2", *MODEL]
    t0 = time.perf_counter()
    with open(exp_dir.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _pid, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    tail = exp_dir.with_suffix(".log").read_text()[-3000:]
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"trainer failed on {manifest_dir}:\n{tail}")
    return seconds, usage.ru_maxrss / 1024, tail


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,100000,1000000", help="cuts in the training part, comma-separated")
    p.add_argument("--data-dir", type=Path, default=None, help="keep the corpora here (default: a temp dir)")
    p.add_argument("--no-extremes", action="store_true", help="no extremes records (the fallback pass)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="bench_startup_"))
    try:
        tokenized = build_tiny(data_dir)
        rows = []
        for n in sizes:
            t0 = time.perf_counter()
            manifest_dir = replicate(tokenized, data_dir / f"cuts-{n}", n, not args.no_extremes)
            made = time.perf_counter() - t0
            seconds, rss, _tail = run_trainer(manifest_dir, data_dir / f"exp-{n}")
            rows.append((n, seconds, rss))
            print(f"# {n} cuts: replicated in {made:.1f}s, trained 2 steps in {seconds:.1f}s", file=sys.stderr)
        base_s, base_rss = rows[0][1], rows[0][2]
        print(f"{'cuts':>9}  {'launch to 2 steps (s)':>21}  {'peak RSS (MB)':>13}  {'time ratio':>10}  {'RSS ratio':>9}")
        for n, seconds, rss in rows:
            print(f"{n:>9}  {seconds:>21.1f}  {rss:>13.0f}  {seconds / base_s:>10.2f}  {rss / base_rss:>9.2f}")
    finally:
        if args.data_dir is None:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Quality against training time: held-out PER and speaker similarity after each AR epoch.

Trains the demo's model (egs/tiny/run.sh stages 1-2: AR, then NAR from the AR's best
checkpoint) on the demo's corpus, then scores every AR epoch checkpoint with the final NAR
spliced in (stage 2 trains only NAR weights, so its checkpoint holds the best AR's weights;
swapping in another epoch's AR weights gives the full model as it stood after that epoch).
Each point synthesises the held-out sentences in held-out voices with bin/infer.py and scores
them with bin/evaluate.py, exactly as `make demo` does.

The answer to "how many minutes of training on this machine until the model speaks": the AR
minutes to a held-out PER within 2x of the ground-truth ceiling, or the best PER reached.

    python scripts/bench_quality.py [--ar-epochs N] [--nar-epochs N] [--num-items 16] [--exp DIR --reuse]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "egs" / "tiny"
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
EPOCH_END = re.compile(r"epoch (\d+) summary")
VALID = re.compile(r"validation at step \d+: loss ([0-9.]+)")


def run(cmd: list[str], log: Path, may_fail: bool = False) -> None:
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, cwd=TINY, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0 and not may_fail:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}; see {log}")


def _time(line: str) -> float | None:
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def epoch_times(stage_dir: Path) -> dict[int, tuple[float, float | None]]:
    """{epoch: (minutes of training since the run's first log line, last validation loss)}
    from rank 0's training log."""
    logs = sorted((stage_dir / "log").glob("log-train-*-0"))
    if not logs:
        sys.exit(f"no rank-0 training log under {stage_dir / 'log'}")
    out, start, valid = {}, None, None
    for line in logs[-1].read_text(encoding="utf-8").splitlines():
        t = _time(line)
        if t is not None and start is None:
            start = t
        if m := VALID.search(line):
            valid = float(m.group(1))
        if (m := EPOCH_END.search(line)) and t is not None:
            out[int(m.group(1))] = ((t - start) / 60.0, valid)
    return out


def splice(ar_checkpoint: Path, full_checkpoint: Path, out: Path) -> None:
    """The full checkpoint with the AR weights (``ar_*``) of another checkpoint."""
    full = torch.load(full_checkpoint, map_location="cpu", weights_only=False)
    ar = torch.load(ar_checkpoint, map_location="cpu", weights_only=False)
    for key in ("model", "model_avg"):
        if key in full and key in ar and full[key] is not None and ar[key] is not None:
            for name, value in ar[key].items():
                if name.startswith("ar_"):
                    full[key][name] = value
    keep = {k: full[k] for k in ("format", "model", "model_avg", "config", "step", "epoch", "train_stage")
            if k in full}
    torch.save(keep, out)


def demo_decode_flags() -> list[str]:
    """The demo's decoding flags: the ``decode=(...)`` line of egs/tiny/run.sh."""
    m = re.search(r"^decode=\((.*)\)$", (TINY / "run.sh").read_text(), flags=re.M)
    if m is None:
        sys.exit("egs/tiny/run.sh has no decode=(...) line")
    return shlex.split(m.group(1))


def score(checkpoint: Path, exp: Path, data: str, name: str, log: Path, references: bool) -> dict:
    """bin/infer.py then bin/evaluate.py on the held-out items, decoded as the demo decodes;
    the evaluation summary (with the ground-truth figures when ``references``)."""
    out = exp / "bench" / name
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    run([py, str(ROOT / "bin/infer.py"), "--checkpoint", str(checkpoint), "--device", "cpu",
         "--tsv", str(exp / "bench" / "infer.tsv"), "--output-dir", str(out), *demo_decode_flags(),
         "--batch-size", "8", "--allow-random-encodec"], log,
        may_fail=True)  # items with no audio are scored as silence below
    run([py, str(ROOT / "bin/evaluate.py"), "--tsv", str(exp / "bench" / "items.tsv"), "--output-dir",
         str(out), "--checkpoint", str(checkpoint), "--manifest-dir", data, "--output-json",
         str(out / "eval.json"), "--allow-random-encodec", "--missing-as-empty",
         *([] if references else ["--no-references"])], log)
    return json.loads((out / "eval.json").read_text())["summary"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ar-epochs", type=int, default=None, help="default: the demo's (egs/tiny/run.sh)")
    p.add_argument("--nar-epochs", type=int, default=None, help="default: the demo's")
    p.add_argument("--num-items", type=int, default=16, help="held-out items scored per point")
    p.add_argument("--exp", default="exp/bench-quality", help="under egs/tiny")
    p.add_argument("--reuse", action="store_true", help="score an existing --exp without training")
    p.add_argument("--every", type=int, default=1, help="score every Nth AR epoch (and the last)")
    p.add_argument("--data", default="data/tiny/tokenized",
                   help="under egs/tiny: the tokenized corpus --exp was trained on (run.sh --data); "
                        "its held-out split and phoneme judge score the points")  # fmt: skip
    args = p.parse_args()
    exp = TINY / args.exp
    data = args.data
    exp.mkdir(parents=True, exist_ok=True)
    log = exp / "bench-quality.log"
    started = time.time()
    if not (TINY / data / "judge.pt").is_file():
        run(["bash", "run.sh", "--stage", "0", "--stop-stage", "0", "--data", data, "--python", sys.executable], log)
    if not args.reuse:
        stages = ["--exp", args.exp, "--data", data, "--python", sys.executable]
        stages += ["--ar-epochs", str(args.ar_epochs)] if args.ar_epochs else []
        stages += ["--nar-epochs", str(args.nar_epochs)] if args.nar_epochs else []
        run(["bash", "run.sh", "--stage", "1", "--stop-stage", "2", *stages], log)
    (exp / "bench").mkdir(exist_ok=True)
    run([sys.executable, "local/test_items.py", "--cuts", f"{data}/tiny_cuts_test.jsonl.gz", "--num-items",
         str(args.num_items), "--infer-tsv", str(exp / "bench" / "infer.tsv"), "--eval-tsv",
         str(exp / "bench" / "items.tsv")], log)

    nar_best = exp / "nar" / "best-valid-loss.pt"
    ar_times = epoch_times(exp / "ar")
    nar_minutes = max((m for m, _ in epoch_times(exp / "nar").values()), default=float("nan"))
    rows, ceiling = [], None
    last_epoch = max(ar_times, default=0)
    for epoch, (minutes, valid) in sorted(ar_times.items()):
        ckpt = exp / "ar" / f"epoch-{epoch}.pt"
        if (epoch % args.every and epoch != last_epoch) or not ckpt.is_file():
            continue
        spliced = exp / "bench" / f"ar-epoch-{epoch}.pt"
        splice(ckpt, nar_best, spliced)
        summary = score(spliced, exp, data, f"ar-epoch-{epoch}", log, references=ceiling is None)
        spliced.unlink()
        ceiling = ceiling or summary.get("ground_truth", {})
        out = summary["output"]
        rows.append((epoch, minutes, valid, out["per"], out["similarity"], out["duration_ratio"]))
        print(f"AR epoch {epoch}: {minutes:.1f} min, PER {out['per']:.3f}", file=sys.stderr, flush=True)

    ref_per = (ceiling or {}).get("per", float("nan"))
    ref_sim = (ceiling or {}).get("similarity", float("nan"))
    print(f"decoding: {' '.join(demo_decode_flags())} (egs/tiny/run.sh)")
    print(f"demo corpus (egs/tiny, held-out sentences in held-out voices), {args.num_items} items per point; "
          f"NAR trained {nar_minutes:.1f} min after the AR; 2 ranks, 1 thread each (run.sh); "
          f"bench wall time {(time.time() - started) / 60:.1f} min\n")
    print("| AR epoch | AR training minutes | AR valid loss | held-out PER | speaker sim | duration ratio |")
    print("|---|---|---|---|---|---|")
    for epoch, minutes, valid, per, sim, dur in rows:
        print(f"| {epoch} | {minutes:.1f} | {valid if valid is not None else float('nan'):.3f} | {per:.3f} | "
              f"{sim:.3f} | {dur:.2f} |")
    print(f"| ground truth (ceiling) | | | {ref_per:.3f} | {ref_sim:.3f} | 1.00 |\n")
    reached = [r for r in rows if r[3] <= 2 * ref_per]
    if reached:
        print(f"held-out PER within 2x of the ceiling ({2 * ref_per:.3f}) after {reached[0][1]:.1f} AR "
              f"minutes (epoch {reached[0][0]}) + {nar_minutes:.1f} NAR minutes")
    elif rows:
        best = min(rows, key=lambda r: r[3])
        print(f"held-out PER within 2x of the ceiling ({2 * ref_per:.3f}): not reached in this budget; best "
              f"{best[3]:.3f} after {best[1]:.1f} AR minutes (epoch {best[0]})")


if __name__ == "__main__":
    main()

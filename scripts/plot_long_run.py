"""The learning curve of a long egs/tiny run as a PNG: held-out PER and speaker similarity against
AR steps and AR wall minutes (the trainer's 4 held-out samples every 400 steps, and the 16-item
points of scripts/bench_quality.py and run.sh's final evaluation), with the AR validation loss.

    python scripts/plot_long_run.py --exp egs/tiny/exp/long20k --points "9280:0.57,18560:0.55" \
        --out docs/figures/long-run.png
"""

from __future__ import annotations

import argparse
from pathlib import Path


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float, float]]:
    """(step, value, wall time) of one TensorBoard scalar."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", type=Path, required=True, help="run.sh's --exp (holds ar/ and nar/)")
    p.add_argument("--points", default="", help="STEP:PER,... held-out PER on 16 items at AR steps")
    p.add_argument("--ceiling", type=float, default=None, help="ground truth's PER (a dashed 2x line)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from matplotlib.figure import Figure

    tb = args.exp / "ar" / "tensorboard" / "stage1"
    per = scalars(tb / "samples", "valid_samples/per")
    sim = scalars(tb / "samples", "valid_samples/similarity")
    loss = scalars(tb, "valid/ar_loss")
    start = min(per[0][2], loss[0][2])  # the first of either: the AR run's start, near enough
    fig = Figure(figsize=(9, 3.4), dpi=100)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot([s for s, _, _ in per], [v for _, v, _ in per], ".-", lw=0.8, label="PER, 4 held-out samples")
    ax1.plot([s for s, _, _ in sim], [v for _, v, _ in sim], ".-", lw=0.8, label="speaker similarity (4)")
    points = [tuple(map(float, x.split(":"))) for x in args.points.split(",") if x]
    if points:
        ax1.plot(*zip(*points), "o", ms=7, color="k", label="PER, 16 held-out items")
    if args.ceiling:
        ax1.axhline(2 * args.ceiling, ls="--", color="gray", label="2x ground truth's PER")
    ax1.set_xlabel("AR steps")
    ax1.legend(fontsize=7)
    ax1.set_ylim(0, 1.1)
    ax2.plot([(w - start) / 60 for _, _, w in per], [v for _, v, _ in per], ".-", lw=0.8, label="PER (4)")
    twin = ax2.twinx()
    twin.plot([(w - start) / 60 for _, _, w in loss], [v for _, v, _ in loss], color="tab:red", lw=0.8)
    twin.set_ylabel("AR validation loss", color="tab:red")
    ax2.set_xlabel("AR wall minutes (2 shared cores)")
    ax2.set_ylabel("held-out PER")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(args.out))


if __name__ == "__main__":
    main()

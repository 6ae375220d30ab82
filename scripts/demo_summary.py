#!/usr/bin/env python3
"""The demo's last word: the wavs, held-out PER and speaker similarity beside their ceilings,
the TensorBoard directory, a loss-curve PNG (training and validation loss per stage), the OOM story,
and how to listen (TensorBoard's samples of training, bin/serve.py)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STAGES = (("ar", "stage1", "AR (stage 1)"), ("nar", "stage2", "NAR (stage 2)"))

# Held-out PER on the 16 items (scripts/bench_quality.py) against the AR steps of the demo's model
# and decoding, measured on the 2 cores: (AR steps, PER, the run). docs/evaluation.md, "The long
# run", holds the same numbers with their wall times; update both together.
MEASURED_CURVE = (
    (2930, 0.648, "make demo"),
    (19680, 0.541, "make demo-long"),
)
FURTHER = "make demo-long"


def curve_line(ar_steps: int | None) -> str:
    """Where a run of ``ar_steps`` AR steps stands on the measured curve, and what goes further."""
    points = ", ".join(f"{per:.2f} at {steps} steps ({run})" for steps, per, run in MEASURED_CURVE)
    where = f"this AR trained {ar_steps} steps" if ar_steps else "AR steps unknown"
    return f"{where}; measured held-out PER on 16 items: {points}; further: {FURTHER}"


def stage_dirs(exp: Path) -> list[tuple[str, Path]]:
    """(label, tensorboard dir) per stage: exp/{ar,nar}/tensorboard/stageN, or exp/tensorboard/stageN."""
    out = []
    for sub, stage, label in STAGES:
        for d in (exp / sub / "tensorboard" / stage, exp / "tensorboard" / stage):
            if d.is_dir():
                out.append((label, d))
                break
    return out


def plot(exp: Path, evaluation: dict | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from valle.train.metrics import _read_tensorboard_scalars

    stages = stage_dirs(exp)
    fig, axes = plt.subplots(1, max(1, len(stages)), figsize=(6 * max(1, len(stages)), 4), squeeze=False)
    for ax, (label, d) in zip(axes[0], stages):
        for tag, style in (("train/loss", "-"), ("valid/loss", "o-")):
            pts = _read_tensorboard_scalars(d, tag)
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], style, label=tag.split("/")[0], markersize=3)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.set_ylabel("loss per frame")
        ax.legend()
    if evaluation and stages:
        o = evaluation["summary"]["output"]
        ref = evaluation["summary"].get("ground_truth", {})
        axes[0][-1].text(0.02, 0.02, f"held-out PER {o['per']:.2f} (ground truth {ref.get('per', math.nan):.2f})",
                         transform=axes[0][-1].transAxes, fontsize=9)
    png = exp / "loss-curve.png"
    fig.suptitle("tiny demo: training and validation loss")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return png


def sample_lines(exp: Path) -> list[str]:
    """What the trainer's held-out samples (valle/train/samples.py) said, per stage."""
    from valle.train.metrics import _read_tensorboard_scalars

    lines = []
    for label, d in stage_dirs(exp):
        passes = _read_tensorboard_scalars(d / "samples", "valid_samples/wall_seconds")
        if not passes:
            continue
        per = dict(_read_tensorboard_scalars(d / "samples", "valid_samples/per"))
        first, last = passes[0][0], passes[-1][0]
        trend = f"; held-out PER {fmt(per.get(first))} at step {first} -> {fmt(per.get(last))} at step {last}" if per else ""
        lines.append(f"{label}: {len(passes)} sampling pass{'es' if len(passes) > 1 else ''}{trend}")
    return lines


def fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--exp-dir", type=Path, required=True)
    args = parser.parse_args()
    exp = args.exp_dir.resolve()
    eval_path = exp / "eval.json"
    evaluation = json.loads(eval_path.read_text()) if eval_path.is_file() else None
    png = plot(exp, evaluation)

    wavs = sorted((exp / "infer").glob("*.wav"))
    events = [json.loads(line) for f in sorted(exp.rglob("oom/events-rank*.jsonl"))
              for line in f.read_text().splitlines()]
    epochs = sorted(exp.rglob("epoch-*-summary-rank0.json"))
    last = json.loads(epochs[-1].read_text()) if epochs else {}
    ar_summary = exp / "ar" / "summary-rank0.json"
    ar_steps = json.loads(ar_summary.read_text()).get("steps") if ar_summary.is_file() else None
    print("\n==================== demo summary ====================")
    print(f"wavs:             {len(wavs)} in {exp / 'infer'}")
    for w in wavs:
        print(f"                  {w.name}")
    if evaluation:
        s = evaluation["summary"]
        o, gt, rs = s["output"], s.get("ground_truth", {}), s.get("codec_resynthesis", {})
        meta = evaluation["meta"]
        print(f"held-out PER:     {fmt(o['per'])}   (ceilings: ground truth {fmt(gt.get('per'))}, "
              f"{meta.get('codec')} resynthesis {fmt(rs.get('per'))}; unintelligible ~1.0)")
        print(f"speaker sim:      {fmt(o['similarity'])}   (ceilings: ground truth {fmt(gt.get('similarity'))}, "
              f"resynthesis {fmt(rs.get('similarity'))}; {meta.get('speaker_model')})")
        print(f"duration ratio:   {fmt(o['duration_ratio'])} of the text at the prompt's rate, "
              f"{fmt(o['duration_ratio_ref'])} of the ground truth; {o['hit_length_cap']:.0%} hit the length cap; "
              f"{o.get('missing_output', 0)} gave no audio")
        print(f"evaluation:       {eval_path}")
    else:
        print("evaluation:       none (stage 4 did not run)")
    print(f"on the curve:     {curve_line(ar_steps)} (docs/evaluation.md, 'The long run')")
    print(f"TensorBoard:      tensorboard --logdir {exp}   (listen: AUDIO and IMAGES tabs, runs "
          "*/samples: held-out items as training went)")
    for line in sample_lines(exp):
        print(f"samples:          {line}")
    print(f"listen:           python {ROOT / 'bin' / 'serve.py'} --exp-dir {exp}   (a page: any text, "
          "any prompt, any checkpoint)")
    print(f"loss curve:       {png}")
    for e in events:
        print(f"OOM recovered:    {e['phase']} on rank {e['rank']} at step {e['step']} "
              f"({'injected' if e['injected'] else 'real'}), {len(e['cut_ids'])} cuts retried split")
    if last:
        print(f"last epoch:       cuts drawn {last['cuts_drawn']} = trained {last['cuts_trained']} + "
              f"quarantined {last['cuts_quarantined']} + skipped {last['cuts_skipped']}")
    if evaluation and evaluation["meta"].get("codec") == "encodec":
        print("EnCodec: with RANDOM weights (no checkpoint found) the wavs are noise-like.")
    print("======================================================")
    if not wavs:
        sys.exit(1)


if __name__ == "__main__":
    main()

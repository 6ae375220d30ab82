#!/usr/bin/env python3
"""The demo's last word: the wav, the TensorBoard directory, a loss-curve PNG, the OOM story."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--exp-dir", type=Path, required=True)
    args = parser.parse_args()
    exp = args.exp_dir.resolve()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from valle.train.metrics import _read_tensorboard_scalars

    fig, ax = plt.subplots(figsize=(7, 4))
    for stage, label in (("stage1", "AR (stage 1)"), ("stage2", "NAR (stage 2)")):
        points = _read_tensorboard_scalars(exp / "tensorboard" / stage, "train/loss")
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss per frame")
    ax.set_title("tiny demo: training loss")
    ax.legend()
    png = exp / "loss-curve.png"
    fig.tight_layout()
    fig.savefig(png, dpi=100)

    wavs = sorted((exp / "infer").glob("*.wav"))
    events = [json.loads(line) for f in sorted((exp / "oom").glob("events-rank*.jsonl"))
              for line in f.read_text().splitlines()]
    epochs = sorted(exp.glob("epoch-*-summary-rank0.json"))
    last = json.loads(epochs[-1].read_text()) if epochs else {}
    print("\n==================== demo summary ====================")
    print(f"wav:              {wavs[0] if wavs else 'none written'}")
    print(f"TensorBoard:      tensorboard --logdir {exp / 'tensorboard'}")
    print(f"loss curve:       {png}")
    for e in events:
        print(f"OOM recovered:    {e['phase']} on rank {e['rank']} at step {e['step']} "
              f"({'injected' if e['injected'] else 'real'}), {len(e['cut_ids'])} cuts retried split")
    if last:
        print(f"last epoch:       cuts drawn {last['cuts_drawn']} = trained {last['cuts_trained']} + "
              f"quarantined {last['cuts_quarantined']} + skipped {last['cuts_skipped']}")
    print("EnCodec ran with RANDOM weights unless a checkpoint was found: the wav is noise-like.")
    print("======================================================")
    if not wavs:
        sys.exit(1)


if __name__ == "__main__":
    main()

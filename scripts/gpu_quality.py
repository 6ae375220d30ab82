#!/usr/bin/env python3
"""The two ends of scripts/gpu_quality.sh (the demo's recipe trained on a GPU for a fixed time).

pack (on the GPU machine; torch only): each model's final checkpoint, weights and metadata
only, split into files under 15 MB (``{name}_nar_{i}.pt``, part 0 with the metadata and the
step of the AR weights it holds), and AR-only snapshots along its run (``{name}_ar_snaps.pt``:
{step: AR weights}), so that everything fits what may come back from that machine (8 files,
16 MiB each, 64 MiB in all).

score (here, on CPU): reassembles them, splices each snapshot's AR weights into its model's
final checkpoint (stage 2 trains only NAR weights, so that is the model as it stood after that
many AR steps, as scripts/bench_quality.py does per epoch), and scores every checkpoint as
`make demo` does: bin/infer.py with the demo's decoding on held-out sentences in held-out
voices, then bin/evaluate.py (PER by the demo's judge, speaker similarity) beside the
ground-truth ceiling.

    python scripts/gpu_quality.py pack EXP OUT [--snapshots A]
    python scripts/gpu_quality.py score DIR [DIR ...] [--num-items 16] [--data data/tiny/tokenized]

EXP: the run's folder (``EXP/{name}/ar``, ``EXP/{name}/nar``). DIR: folders holding the returned
files (several when they came back from more than one call).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

META = ("format", "config", "step", "epoch", "train_stage")
PART = re.compile(r"^(?P<name>[A-Za-z0-9]+)_nar_(?P<part>\d+)\.pt$")
SNAPS = re.compile(r"^(?P<name>[A-Za-z0-9]+)_ar_snaps\.pt$")
# AR steps to snapshot: the CPU demo's AR step count (egs/tiny/run.sh), then doublings.
SNAPSHOT_STEPS = (1820, 3640, 7280, 14560)
RETURN_LIMIT = 64 * 2**20  # bytes that may come back from the GPU machine in all


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def split_checkpoint(ckpt: dict, ar_step: int | None, limit: float = 15e6) -> list[dict]:
    """The weights in parts of at most ``limit`` bytes each (a single larger tensor gets a part
    of its own); part 0 also holds the metadata and ``ar_step``."""
    parts = [{**{k: ckpt[k] for k in META if k in ckpt}, "ar_step": ar_step, "model": {}}]
    size = 0
    for name, tensor in ckpt["model"].items():
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > limit and parts[-1]["model"]:
            parts.append({"model": {}})
            size = 0
        parts[-1]["model"][name] = tensor
        size += nbytes
    return parts


def join_parts(parts: list[dict]) -> dict:
    ckpt = {**parts[0], "model": dict(parts[0]["model"])}
    for part in parts[1:]:
        ckpt["model"].update(part["model"])
    return ckpt


def pick_snapshots(steps: list[int], wanted: tuple[int, ...] = SNAPSHOT_STEPS) -> list[int]:
    """The saved steps nearest each wanted step, for those the run got near (within 20%)."""
    if not steps:
        return []
    return sorted({min(steps, key=lambda s: abs(s - w)) for w in wanted if w <= max(steps) * 1.2})


def pack(exp: Path, out: Path, snapshot_models: set[str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for model_dir in sorted(p for p in exp.iterdir() if (p / "nar" / "best-valid-loss.pt").is_file()):
        name = model_dir.name
        ar_step = _load(model_dir / "ar" / "best-valid-loss.pt")["step"]
        parts = split_checkpoint(_load(model_dir / "nar" / "best-valid-loss.pt"), ar_step)
        for i, part in enumerate(parts):
            written.append(out / f"{name}_nar_{i}.pt")
            torch.save(part, written[-1])
        print(f"{name}: AR step {ar_step}, NAR step {parts[0]['step']}, {len(parts)} file(s)")
        if name not in snapshot_models:
            continue
        steps = sorted(int(p.stem.split("-")[1]) for p in (model_dir / "ar").glob("checkpoint-*.pt"))
        snaps = {}
        for step in pick_snapshots(steps):
            weights = _load(model_dir / "ar" / f"checkpoint-{step}.pt")["model"]
            snaps[step] = {k: v for k, v in weights.items() if k.startswith("ar_")}
        if snaps:
            written.append(out / f"{name}_ar_snaps.pt")
            torch.save(snaps, written[-1])
            print(f"{name}: AR snapshots at steps {list(snaps)} of {steps[-1]}")
    total = sum(p.stat().st_size for p in written)
    if total > RETURN_LIMIT:  # say it here: on the other side the files would just be missing
        print(f"warning: {total / 2**20:.0f} MiB packed, more than the {RETURN_LIMIT // 2**20} MiB that may "
              f"come back; snapshot fewer models", file=sys.stderr)
    return written


def gather(dirs: list[Path]) -> tuple[dict[str, dict], dict[str, dict[int, dict]]]:
    """{name: full checkpoint}, {name: {AR step: AR weights}} from the returned files."""
    parts: dict[str, dict[int, Path]] = {}
    snaps: dict[str, dict[int, dict]] = {}
    for folder in dirs:
        for path in sorted(folder.glob("*.pt")):
            if m := PART.match(path.name):
                parts.setdefault(m["name"], {})[int(m["part"])] = path
            elif m := SNAPS.match(path.name):
                snaps.setdefault(m["name"], {}).update(_load(path))
    full = {}
    for name, files in parts.items():
        missing = sorted(set(range(max(files) + 1)) - set(files))
        if missing:
            raise SystemExit(f"{name}: {', '.join(f'{name}_nar_{i}.pt' for i in missing)} did not come back")
        full[name] = join_parts([_load(files[i]) for i in range(max(files) + 1)])
    return full, snaps


def score_all(dirs: list[Path], num_items: int, data: str, exp_name: str) -> None:
    from bench_quality import TINY, demo_decode_flags, run, score

    exp = TINY / exp_name
    (exp / "bench").mkdir(parents=True, exist_ok=True)
    log = exp / "score.log"
    full, snaps = gather([d.resolve() for d in dirs])
    if not full:
        raise SystemExit(f"no NAME_nar_0.pt under {', '.join(map(str, dirs))}")
    run([sys.executable, "local/test_items.py", "--cuts", f"{data}/tiny_cuts_test.jsonl.gz", "--num-items",
         str(num_items), "--infer-tsv", str(exp / "bench" / "infer.tsv"), "--eval-tsv",
         str(exp / "bench" / "items.tsv")], log)
    rows, ceiling = [], None
    for name, ckpt in sorted(full.items()):
        cfg = ckpt.get("config", {})
        model = f"d={cfg.get('decoder_dim')} x {cfg.get('num_decoder_layers')} layers, {cfg.get('dtype')}"
        final_ar = ckpt.get("ar_step")
        points = [(step, {**ckpt["model"], **ar}) for step, ar in sorted(snaps.get(name, {}).items())
                  if step != final_ar]
        points.append((final_ar if final_ar is not None else "best", ckpt["model"]))
        for ar_step, weights in points:
            path = exp / "bench" / f"{name}-ar{ar_step}.pt"
            torch.save({**ckpt, "model": weights}, path)
            summary = score(path, exp, data, f"{name}-ar{ar_step}", log, references=ceiling is None)
            path.unlink()
            ceiling = ceiling or summary.get("ground_truth", {})
            out = summary["output"]
            rows.append((name, model, ar_step, ckpt.get("step"), out["per"], out["similarity"],
                         out["duration_ratio"]))
            print(f"{name} AR step {ar_step}: PER {out['per']:.3f}", file=sys.stderr, flush=True)

    print(f"decoding: {' '.join(demo_decode_flags())} (egs/tiny/run.sh); {num_items} held-out items "
          f"(held-out sentences, held-out voices); judge from {data}\n")
    print("| model | AR steps | NAR steps | held-out PER | speaker sim | duration ratio |")
    print("|---|---|---|---|---|---|")
    for name, model, ar_step, nar_step, per, sim, dur in rows:
        print(f"| {name}: {model} | {ar_step} | {nar_step} | {per:.3f} | {sim:.3f} | {dur:.2f} |")
    print(f"| ground truth (ceiling) | | | {(ceiling or {}).get('per', float('nan')):.3f} | "
          f"{(ceiling or {}).get('similarity', float('nan')):.3f} | 1.00 |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="on the GPU machine: the run's checkpoints into returnable files")
    pk.add_argument("exp", type=Path)
    pk.add_argument("out", type=Path)
    pk.add_argument("--snapshots", default="A", help="comma-separated models whose AR snapshots to return")
    sc = sub.add_parser("score", help="here: reassemble and score what came back")
    sc.add_argument("dirs", nargs="+", type=Path)
    sc.add_argument("--num-items", type=int, default=16, help="held-out items scored per checkpoint")
    sc.add_argument("--data", default="data/tiny/tokenized", help="the judge's manifest dir (under egs/tiny)")
    sc.add_argument("--exp", default="exp/gpu-quality-score", help="under egs/tiny")
    args = p.parse_args()
    if args.command == "pack":
        pack(args.exp, args.out, set(filter(None, args.snapshots.split(","))))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        score_all(args.dirs, args.num_items, args.data, args.exp)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Train VALL-E / VALL-F.

One process:   python bin/trainer.py --model-name valle --manifest-dir data/tokenized ...
Many GPUs:     torchrun --nproc_per_node=8 bin/trainer.py ...
No corpus:     python bin/trainer.py --synthetic-data 256 --device cpu ...

See docs/training.md and docs/oom.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build_parser() -> argparse.ArgumentParser:
    from valle.models import add_model_arguments
    from valle.train.config import add_training_arguments

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    add_training_arguments(parser)
    add_data_arguments(parser)
    return parser


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Corpus flags come from the lhotse data module when lhotse is installed."""
    try:
        from valle.data.datamodule import TtsDataModule
    except ImportError:  # torch-only environment (GPU checks): synthetic data only
        parser.add_argument("--manifest-dir", type=Path, default=None)
        parser.add_argument("--text-tokens", type=Path, default=None)
        parser.add_argument("--max-duration", type=float, default=40.0)
        parser.add_argument("--max-text-tokens", type=int, default=0)
        return
    TtsDataModule.add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    from valle.train.config import config_from_args
    from valle.train.loop import main_from_config

    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return main_from_config(cfg)


if __name__ == "__main__":
    sys.exit(main())

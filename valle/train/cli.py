"""The trainer's argument parser (bin/trainer.py is a thin wrapper around it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from valle.train.config import TrainConfig, add_training_arguments, config_from_args


def build_parser() -> argparse.ArgumentParser:
    from valle.models import add_model_arguments

    parser = argparse.ArgumentParser(
        prog="bin/trainer.py",
        description="Train VALL-E / VALL-F. One process: python bin/trainer.py ...; "
                    "many: torchrun --nproc_per_node=N bin/trainer.py ...",
    )
    add_model_arguments(parser)
    add_training_arguments(parser)
    add_data_arguments(parser)
    return parser


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Corpus flags come from the lhotse data module when lhotse is installed."""
    try:
        from valle.data.datamodule import TtsDataModule
    except ImportError:  # torch-only environment (GPU checks): synthetic data only
        g = parser.add_argument_group("data (lhotse not installed: only --synthetic-data works)")
        g.add_argument("--manifest-dir", type=Path, default=None)
        g.add_argument("--text-tokens", type=Path, default=None)
        g.add_argument("--max-duration", type=float, default=40.0)
        g.add_argument("--max-text-tokens", type=int, default=0)
        return
    TtsDataModule.add_arguments(parser)


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    return config_from_args(build_parser().parse_args(argv))

"""The trainer's argument parser (bin/trainer.py is a thin wrapper around it)."""

from __future__ import annotations

import argparse

from valle.train.config import TrainConfig, add_training_arguments, config_from_args


def build_parser() -> argparse.ArgumentParser:
    from valle.data.datamodule import TtsDataModule  # its flags need no lhotse: torch alone
    from valle.models import add_model_arguments

    parser = argparse.ArgumentParser(
        prog="bin/trainer.py",
        description="Train VALL-E / VALL-F. One process: python bin/trainer.py ...; "
                    "many: torchrun --nproc_per_node=N bin/trainer.py ...",
    )
    add_model_arguments(parser)
    add_training_arguments(parser)
    TtsDataModule.add_arguments(parser)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    return config_from_args(build_parser().parse_args(argv))

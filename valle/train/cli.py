"""The trainer's argument parser (bin/trainer.py is a thin wrapper around it). Its flags are
generated from the config tree (valle/train/config.py): nothing is declared here."""

from __future__ import annotations

import argparse

from valle.train.config import TrainConfig, add_trainer_flags, config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bin/trainer.py",
        description="Train VALL-E / VALL-F. One process: python bin/trainer.py ...; "
                    "many: torchrun --nproc_per_node=N bin/trainer.py ...",
    )
    add_trainer_flags(parser)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    return config_from_args(build_parser().parse_args(argv))

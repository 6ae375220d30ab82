"""Argument helpers shared by every CLI: one boolean parser, one dtype table.

Every `--flag true|false` in bin/ and valle/ parses through `str2bool`, so the
same words work everywhere (`--drop-last on` and `--tensorboard on` alike).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

TRUE_WORDS = ("1", "true", "t", "yes", "y", "on")
FALSE_WORDS = ("0", "false", "f", "no", "n", "off")

# --dtype NAME -> torch dtype; float32 means "no autocast" to the trainer.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES = tuple(DTYPES)


def str2bool(value: Any) -> bool:
    """Parse a boolean flag value; raises argparse's error for anything else."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(
        f"expected a boolean ({'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}), got {value!r}"
    )


def autocast_dtype(name: str) -> torch.dtype | None:
    """The autocast dtype for --dtype NAME, None for float32 (autocast off)."""
    dtype = DTYPES[name]
    return None if dtype is torch.float32 else dtype

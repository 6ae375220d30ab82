"""VALL-E / VALL-F models. Imports torch only (see docs/architecture.md, import rule).

Modules: ``config`` (hyper-parameters, their flags and checkpoint round trip), ``layout``
(sequence layouts), ``losses`` (training losses), ``valle`` (the modules, ``forward``),
``generation`` (decoding), ``sampling``, ``transformer``, ``embedding``, ``rng``, ``convert``
(checkpoint loading).
"""

from __future__ import annotations

from typing import Any

from valle.args import str2bool

from .config import (
    LEGACY_HPARAMS,
    MODEL_DEFAULTS,
    NAR_HEAD_TIES,
    NAR_POSITION_SCALES,
    POSITION_LAYOUTS,
    TRAINING_HPARAMS,
    ModelConfig,
    add_model_arguments,
    model_hparams,
)
from .layout import NUM_AUDIO_TOKENS, PrefixMode
from .valle import VALLE, VALLF

__all__ = [
    "LEGACY_HPARAMS", "MODEL_DEFAULTS", "NAR_HEAD_TIES", "NAR_POSITION_SCALES", "NUM_AUDIO_TOKENS",
    "POSITION_LAYOUTS", "TRAINING_HPARAMS", "VALLE", "VALLF", "ModelConfig", "PrefixMode",
    "add_model_arguments", "get_model", "model_hparams", "str2bool",
]  # fmt: skip

_MODEL_CLASSES = {"valle": VALLE, "vall-e": VALLE, "vallf": VALLF, "vall-f": VALLF}


def get_model(params: Any) -> VALLE | VALLF:
    """The model of a Namespace/dataclass/dict of hyper-parameters (flags or a checkpoint's)."""
    config = ModelConfig.from_params(params)
    cls = _MODEL_CLASSES.get(config.model_name)
    if cls is None:
        raise ValueError(f"unknown --model-name {config.model_name!r}: use valle or vall-f")
    return cls(config)

"""The model's hyper-parameters: one typed dataclass, ``ModelConfig``.

Its fields are the one list of options: each carries its default, CLI help, argparse group
and whether it is a training-loss setting, and from them come the ``--flags``
(``add_model_arguments``), the hparams dict a checkpoint records (``ModelConfig.hparams``)
and its way back (``ModelConfig.from_params``). Adding an option means adding one field.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import Any, get_type_hints

from valle.args import str2bool
from valle.config_flags import FLAG, add_flags, flag, flag_name

from .layout import NUM_AUDIO_TOKENS, PrefixMode

NAR_HEAD_TIES = ("lifeiteng", "same")
POSITION_LAYOUTS = ("interleaved", "concatenated")
NAR_POSITION_SCALES = ("fixed", "learned")

MODEL_GROUP = "model"
EXPERIMENTAL_GROUP = "model (experimental)"
_GROUP_DESCRIPTIONS = {
    EXPERIMENTAL_GROUP: "kept for experiments: measured no gain at the demo's size "
    "(docs/evaluation.md); the defaults leave them off",
}

# Options that existed once and were removed: the value that meant "off" (a checkpoint that
# records it still loads); any other value names the option in an error.
REMOVED_OPTIONS: dict[str, Any] = {
    "paired_prompts": False,  # no held-out PER gain (docs/results-log.md)
}


def option(
    default: Any,
    help: str = "",
    *,
    group: str = MODEL_GROUP,
    choices: tuple[Any, ...] | None = None,
    training: bool = False,
    legacy: Any = MISSING,
) -> Any:
    """A ``ModelConfig`` field. ``training``: a setting of the training loss, not of the
    architecture (on resume the flags give it, not the checkpoint). ``legacy``: what a
    checkpoint written before the option existed meant by its absence."""
    return flag(default, help or None, group=group, choices=choices,
                metadata=dict(training=training, legacy=legacy))


@dataclass(frozen=True)
class ModelConfig:
    model_name: str = option("valle", "valle or vall-f (case-insensitive)")
    decoder_dim: int = option(1024, "AR transformer width")
    nhead: int = option(16, "attention heads")
    num_decoder_layers: int = option(12, "AR transformer layers")
    scale_factor: float = option(1.0, "NAR width/heads/layers = AR ones x this")
    norm_first: bool = option(True, "pre-norm (true) or post-norm")
    add_prenet: bool = option(False, "text and audio prenets before the transformers")
    prefix_mode: PrefixMode = option(
        PrefixMode.UTTERANCE_PREFIX,
        "NAR prompt: 0 none, 1 prefix, 2 random segment, 4 other utterance",
        choices=tuple(int(m) for m in PrefixMode),
    )
    share_embedding: bool = option(
        True,
        "as in lifeiteng/vall-e: tie the NAR output heads to the NAR audio embeddings (the AR "
        "head stays untied; see --tie-ar-head)",
    )
    prepend_bos: bool = option(False, "BOS before AR audio")
    num_quantizers: int = option(8, "codebooks modelled (the AR's 1 + the NAR's Q-1)")
    num_text_tokens: int = option(512, "text vocabulary size")
    dropout: float = option(0.1, "dropout of every transformer and prenet")
    tie_ar_head: bool = option(
        False,
        "also tie the AR output head to the AR audio embedding (this project's first meaning "
        "of --share-embedding true)",
    )
    nar_head_tie: str = option(
        "lifeiteng",
        "with --share-embedding: lifeiteng (stage j's head is codebook j+1's table, the last "
        "stage has its own) or same (codebook j's table)",
        choices=NAR_HEAD_TIES,
        legacy="same",
    )
    positions: str = option(
        "interleaved",
        "sinusoid layout: interleaved sin/cos (lifeiteng) or concatenated",
        choices=POSITION_LAYOUTS,
        legacy="concatenated",
    )
    nar_position_scale: str = option(
        "fixed",
        "NAR positional scale alpha: fixed at 1 (lifeiteng) or learned",
        choices=NAR_POSITION_SCALES,
        legacy="learned",
    )
    num_languages: int = option(
        0,
        "VALL-E X: > 0 adds a language-ID embedding to the text (ids from the supervision's "
        "language, in the order of the config's 'languages')",
    )
    guided_attention_weight: float = option(
        0.0,
        "AR training: weight of the guided attention loss that pulls the attention from audio "
        "to text towards the diagonal (0: off; docs/training.md)",
        training=True,
    )
    guided_attention_sigma: float = option(
        0.2, "width of the diagonal band, as a fraction of the text/audio length", training=True
    )
    guided_attention_heads: int = option(
        2, "guided heads per layer (the first ones)", training=True
    )
    guided_attention_layers: int = option(2, "guided layers (the last ones)", training=True)
    ar_codebook_size: int = option(
        NUM_AUDIO_TOKENS,
        "codes in codebook 0 (1024 for EnCodec; a mel-rvq codec fitted with "
        "--first-codebook-size N: N): the AR predicts these and EOS, so a small first codebook "
        "makes a cheaper head (the trainer checks it against the corpus's codec)",
    )
    ar_group_size: int = option(
        1,
        "experimental (cost held-out PER at the demo's size at equal steps): VALL-E 2's "
        "grouped code modeling, each AR position reads and predicts this many consecutive "
        "frames of codebook 0 (a G times shorter AR sequence, G frames per decoding step; "
        "docs/training.md)",
        group=EXPERIMENTAL_GROUP,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_name", str(self.model_name).lower())
        object.__setattr__(self, "prefix_mode", PrefixMode.parse(self.prefix_mode))
        self._check()

    def _check(self) -> None:
        if self.num_quantizers < 1:
            raise ValueError(f"--num-quantizers must be >= 1, got {self.num_quantizers}")
        for f in fields(self):
            choices = f.metadata[FLAG].choices
            value = getattr(self, f.name)  # prefix_mode's choices are checked by its parse
            if choices and isinstance(value, str) and value not in choices:
                raise ValueError(
                    f"{flag_name(f.name)} must be one of {', '.join(choices)}, got {value!r}"
                )
        if self.num_languages < 0:
            raise ValueError(f"--num-languages must be >= 0, got {self.num_languages}")
        if self.guided_attention_weight < 0 or self.guided_attention_sigma <= 0:
            raise ValueError(
                "--guided-attention-weight must be >= 0 and --guided-attention-sigma > 0, got "
                f"{self.guided_attention_weight} and {self.guided_attention_sigma}"
            )
        if self.guided_attention_weight and (
            self.guided_attention_heads < 1 or self.guided_attention_layers < 1
        ):
            raise ValueError(
                "--guided-attention-heads and --guided-attention-layers must be >= 1, got "
                f"{self.guided_attention_heads} and {self.guided_attention_layers}"
            )
        if not 1 <= self.ar_codebook_size <= NUM_AUDIO_TOKENS:
            raise ValueError(
                f"--ar-codebook-size must be in [1, {NUM_AUDIO_TOKENS}], got {self.ar_codebook_size}"
            )
        if self.ar_group_size < 1:
            raise ValueError(f"--ar-group-size must be >= 1, got {self.ar_group_size}")

    # ------------------------------------------------------------ round trip
    def hparams(self) -> dict[str, Any]:
        """The dict a checkpoint records: plain ints, floats, bools and strs."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_params(cls, params: Any) -> ModelConfig:
        """From a Namespace, dataclass or dict (flags or a checkpoint's config): missing
        options take their defaults, other keys are ignored, values are parsed by type."""
        get = (
            params.get if isinstance(params, Mapping) else (lambda k, d: getattr(params, k, d))
        )
        _refuse_removed(get)
        values = {}
        for f in fields(cls):
            value = get(f.name, MISSING)
            if value is not MISSING:
                values[f.name] = _parsers()[f.name](value)
        return cls(**values)


def _plain(value: Any) -> Any:
    return int(value) if isinstance(value, PrefixMode) else value


def _refuse_removed(get: Callable[[str, Any], Any]) -> None:
    for name, off in REMOVED_OPTIONS.items():
        value = get(name, off)
        if str2bool(value) != off:
            raise ValueError(
                f"{flag_name(name)} {value} is no longer supported (the option was removed: it "
                "measured no held-out gain, docs/evaluation.md); this model was trained with it"
            )


@cache
def _parsers() -> dict[str, Callable[[Any], Any]]:
    """Per field, the function that reads its value from a flag or a checkpoint."""
    by_type: dict[Any, Callable[[Any], Any]] = {
        bool: str2bool, int: int, float: float, str: str, PrefixMode: PrefixMode.parse,
    }  # fmt: skip
    hints = get_type_hints(ModelConfig)
    return {f.name: by_type[hints[f.name]] for f in fields(ModelConfig)}


# ------------------------------------------------------------ derived tables
MODEL_DEFAULTS: dict[str, Any] = ModelConfig().hparams()
# Hyper-parameters of the training loss, not of the architecture: on resume the flags
# give them (a run may turn guided attention off once the model aligns), not the checkpoint.
TRAINING_HPARAMS = frozenset(f.name for f in fields(ModelConfig) if f.metadata["training"])
# What the keys added after the first checkpoints meant before they existed: a config
# without them was written by the first model (AR head tied under --share-embedding,
# NAR head j = codebook j's table, concatenated positions, learned NAR position scale).
LEGACY_HPARAMS: dict[str, Any] = {
    f.name: f.metadata["legacy"] for f in fields(ModelConfig) if f.metadata["legacy"] is not MISSING
}


def model_hparams(params: Any) -> dict[str, Any]:
    """The model's hyper-parameters from a Namespace/dataclass/dict; missing ones take defaults."""
    return ModelConfig.from_params(params).hparams()


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``ModelConfig`` field, in its group."""
    add_flags(parser, ModelConfig, _GROUP_DESCRIPTIONS)

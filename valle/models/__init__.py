"""VALL-E / VALL-F models. Imports torch only (see docs/architecture.md, import rule)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from valle.args import str2bool

from .valle import (
    NAR_HEAD_TIES,
    NAR_POSITION_SCALES,
    NUM_AUDIO_TOKENS,
    POSITION_LAYOUTS,
    VALLE,
    VALLF,
)

__all__ = ["NUM_AUDIO_TOKENS", "VALLE", "VALLF", "add_model_arguments", "get_model", "str2bool"]

# Flag defaults, also used to fill hyper-parameters missing from an old config.
MODEL_DEFAULTS: dict[str, Any] = dict(
    model_name="valle", decoder_dim=1024, nhead=16, num_decoder_layers=12, scale_factor=1.0,
    norm_first=True, add_prenet=False, prefix_mode=1, share_embedding=True, prepend_bos=False,
    num_quantizers=8, num_text_tokens=512, dropout=0.1,
    tie_ar_head=False, nar_head_tie="lifeiteng", positions="interleaved", nar_position_scale="fixed",
    num_languages=0, guided_attention_weight=0.0, guided_attention_sigma=0.2,
    guided_attention_heads=2, guided_attention_layers=2, paired_prompts=False,
    ar_codebook_size=1024, ar_group_size=1,
)  # fmt: skip

# Hyper-parameters of the training loss, not of the architecture: on resume the flags
# give them (a run may turn guided attention off once the model aligns), not the checkpoint.
TRAINING_HPARAMS = frozenset(
    ("guided_attention_weight", "guided_attention_sigma", "guided_attention_heads",
     "guided_attention_layers", "paired_prompts")
)  # fmt: skip

# What the keys added after the first checkpoints meant before they existed: a config
# without them was written by the first model (AR head tied under --share-embedding,
# NAR head j = codebook j's table, concatenated positions, learned NAR position scale).
LEGACY_HPARAMS: dict[str, Any] = dict(
    nar_head_tie="same", positions="concatenated", nar_position_scale="learned",
)  # fmt: skip

_MODEL_CLASSES = {"valle": VALLE, "vall-e": VALLE, "vallf": VALLF, "vall-f": VALLF}




def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    d = MODEL_DEFAULTS
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model-name", type=str, default=d["model_name"], help="valle or vall-f (case-insensitive)"
    )
    g.add_argument("--decoder-dim", type=int, default=d["decoder_dim"], help="AR transformer width")
    g.add_argument("--nhead", type=int, default=d["nhead"], help="attention heads")
    g.add_argument("--num-decoder-layers", type=int, default=d["num_decoder_layers"])
    g.add_argument("--scale-factor", type=float, default=d["scale_factor"],
                   help="NAR width/heads/layers = AR ones x this")  # fmt: skip
    g.add_argument(
        "--norm-first", type=str2bool, default=d["norm_first"], help="pre-norm (true) or post-norm"
    )
    g.add_argument("--add-prenet", type=str2bool, default=d["add_prenet"])
    g.add_argument("--prefix-mode", type=int, default=d["prefix_mode"], choices=[0, 1, 2, 4],
                   help="NAR prompt: 0 none, 1 prefix, 2 random segment, 4 other utterance")  # fmt: skip
    g.add_argument("--share-embedding", type=str2bool, default=d["share_embedding"],
                   help="as in lifeiteng/vall-e: tie the NAR output heads to the NAR audio "
                        "embeddings (the AR head stays untied; see --tie-ar-head)")  # fmt: skip
    g.add_argument("--tie-ar-head", type=str2bool, default=d["tie_ar_head"],
                   help="also tie the AR output head to the AR audio embedding (this project's "
                        "first meaning of --share-embedding true)")  # fmt: skip
    g.add_argument("--nar-head-tie", default=d["nar_head_tie"], choices=list(NAR_HEAD_TIES),
                   help="with --share-embedding: lifeiteng (stage j's head is codebook j+1's "
                        "table, the last stage has its own) or same (codebook j's table)")  # fmt: skip
    g.add_argument("--positions", default=d["positions"], choices=list(POSITION_LAYOUTS),
                   help="sinusoid layout: interleaved sin/cos (lifeiteng) or concatenated")  # fmt: skip
    g.add_argument("--nar-position-scale", default=d["nar_position_scale"],
                   choices=list(NAR_POSITION_SCALES),
                   help="NAR positional scale alpha: fixed at 1 (lifeiteng) or learned")  # fmt: skip
    g.add_argument(
        "--prepend-bos", type=str2bool, default=d["prepend_bos"], help="BOS before AR audio"
    )
    g.add_argument("--num-quantizers", type=int, default=d["num_quantizers"])
    g.add_argument("--ar-codebook-size", type=int, default=d["ar_codebook_size"],
                   help="codes in codebook 0 (1024 for EnCodec; a mel-rvq codec fitted with "
                        "--first-codebook-size N: N): the AR predicts these and EOS, so a small "
                        "first codebook makes a cheaper head (the trainer checks it against the "
                        "corpus's codec)")  # fmt: skip
    g.add_argument("--ar-group-size", type=int, default=d["ar_group_size"],
                   help="VALL-E 2's grouped code modeling: each AR position reads and predicts "
                        "this many consecutive frames of codebook 0 (a G times shorter AR "
                        "sequence, G frames per decoding step; docs/training.md)")  # fmt: skip
    g.add_argument(
        "--num-text-tokens", type=int, default=d["num_text_tokens"], help="text vocabulary size"
    )
    g.add_argument("--dropout", type=float, default=d["dropout"])
    g.add_argument("--num-languages", type=int, default=d["num_languages"],
                   help="VALL-E X: > 0 adds a language-ID embedding to the text (ids from the "
                        "supervision's language, in the order of the config's 'languages')")  # fmt: skip
    g.add_argument("--guided-attention-weight", type=float, default=d["guided_attention_weight"],
                   help="AR training: weight of the guided attention loss that pulls the "
                        "attention from audio to text towards the diagonal (0: off; "
                        "docs/training.md)")  # fmt: skip
    g.add_argument(
        "--guided-attention-sigma",
        type=float,
        default=d["guided_attention_sigma"],
        help="width of the diagonal band, as a fraction of the text/audio length",
    )
    g.add_argument(
        "--guided-attention-heads",
        type=int,
        default=d["guided_attention_heads"],
        help="guided heads per layer (the first ones)",
    )
    g.add_argument(
        "--guided-attention-layers",
        type=int,
        default=d["guided_attention_layers"],
        help="guided layers (the last ones)",
    )
    g.add_argument("--paired-prompts", type=str2bool, default=d["paired_prompts"],
                   help="train on rows [a neighbouring utterance of the same speaker; the cut], text "
                        "and audio, with the loss on the cut only: the zero-shot inference layout "
                        "(needs --prefix-mode 1 and a cut manifest; docs/training.md)")  # fmt: skip


def model_hparams(params: Any) -> dict[str, Any]:
    """The model's hyper-parameters from a Namespace/dataclass/dict; missing ones take defaults."""
    get = params.get if isinstance(params, Mapping) else (lambda k, dflt: getattr(params, k, dflt))
    hp = {k: get(k, v) for k, v in MODEL_DEFAULTS.items()}
    for k in ("norm_first", "add_prenet", "share_embedding", "prepend_bos", "tie_ar_head",
              "paired_prompts"):
        hp[k] = str2bool(hp[k])
    for k in (
        "decoder_dim",
        "nhead",
        "num_decoder_layers",
        "prefix_mode",
        "num_quantizers",
        "num_text_tokens",
        "num_languages",
        "guided_attention_heads",
        "guided_attention_layers",
        "ar_codebook_size",
        "ar_group_size",
    ):
        hp[k] = int(hp[k])
    for k in ("scale_factor", "dropout", "guided_attention_weight", "guided_attention_sigma"):
        hp[k] = float(hp[k])
    hp["model_name"] = str(hp["model_name"]).lower()
    for k in ("nar_head_tie", "positions", "nar_position_scale"):
        hp[k] = str(hp[k])
    return hp


def get_model(params: Any) -> VALLE | VALLF:
    hp = model_hparams(params)
    cls = _MODEL_CLASSES.get(hp["model_name"])
    if cls is None:
        raise ValueError(f"unknown --model-name {hp['model_name']!r}: use valle or vall-f")
    return cls(**hp)

"""Audio codecs behind one interface, and how a corpus records which one it was tokenized with.

``encodec`` is ``valle.codec.encodec.AudioTokenizer`` (pretrained weights; never downloaded).
``mel-rvq`` is ``valle.codec.mel_rvq.MelRvqCodec`` (fitted on the corpus itself, no weights).
Both give 8 codebooks x 1024 codes at 75 frames/s from 24 kHz audio (``valle.codec.constants``).
Also here: ``encodec`` (the EnCodec tokenizer) with ``encodec_model`` (the network, plain torch),
``vocos`` (a Vocos decoder for EnCodec codes, plain torch),
``weights`` (where pretrained weights come from), ``audio`` (waveforms at 24 kHz). How codes
are stored as lhotse features is ``valle.data.codes``'s (valle.data uses valle.codec, never
the reverse).

Where the codec is recorded: ``bin/tokenizer.py`` writes ``audio_codec.json`` into its output
directory (the manifest dir), next to the fitted state (``mel_rvq.pt``). The trainer copies
``--manifest-dir`` and the absolute ``text_tokens`` path (which lives in that directory) into
every checkpoint's ``config``, so ``codec_for_checkpoint`` finds the record from a checkpoint
alone and inference decodes with the codec the model was trained on. A mel-rvq codec is fitted
(k-means), so refitting it (re-running the recipe's codec stage) gives other codes for the same
audio: the trainer also records ``audio_codec`` (``codec_identity``: the record plus the
state file's sha256) in the checkpoint, and ``codec_for_checkpoint`` refuses a state file
whose hash differs (``CodecMismatchError``) instead of decoding noise.

Nothing heavy is imported here.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from valle.codec.constants import CODEBOOK_SIZE
from valle.codec.weights import sha256_of

logger = logging.getLogger(__name__)

CODECS = ("encodec", "mel-rvq")
RECORD_FILE = "audio_codec.json"


class CodecMismatchError(ValueError):
    """The codec found for a checkpoint is not the one its corpus was tokenized with."""


def encodec_weights_present(checkpoint: str | os.PathLike | None = None) -> bool:
    from valle.codec.encodec import WEIGHTS

    return WEIGHTS.present(checkpoint)


def resolve_codec_name(codec: str, encodec_checkpoint: str | os.PathLike | None = None) -> str:
    """``auto``: EnCodec where its weights are present, else the offline mel-rvq codec."""
    if codec == "auto":
        return "encodec" if encodec_weights_present(encodec_checkpoint) else "mel-rvq"
    if codec not in CODECS:
        raise ValueError(f"--codec {codec!r}: choose one of {', '.join(CODECS)} or auto")
    return codec


def make_audio_tokenizer(codec: str, state_dir: str | os.PathLike | None = None, device: str = "cpu",
                         encodec_checkpoint: str | None = None, allow_random_encodec: bool = False,
                         seed: int = 0):
    """The tokenizer for ``codec``. mel-rvq loads ``{state_dir}/mel_rvq.pt`` (fit it first:
    ``python -m valle.codec fit``); encodec behaves as ``AudioTokenizer`` always did."""
    codec = resolve_codec_name(codec, encodec_checkpoint)
    if codec == "mel-rvq":
        from valle.codec.mel_rvq import STATE_FILE, MelRvqCodec

        if state_dir is None:
            raise ValueError("--codec mel-rvq needs the directory holding mel_rvq.pt")
        return MelRvqCodec.load(Path(state_dir) / STATE_FILE, device=device)
    from valle.codec.encodec import AudioTokenizer

    return AudioTokenizer(device, encodec_checkpoint, allow_random_encodec, seed)


def write_codec_record(directory: str | os.PathLike, tokenizer) -> Path:
    """Write ``audio_codec.json`` naming the codec (and its state file) into ``directory``."""
    from valle.codec.mel_rvq import STATE_FILE

    name = getattr(tokenizer, "name", "encodec")
    record: dict[str, Any] = {"codec": name}
    if name == "mel-rvq":
        record["state"] = STATE_FILE
    else:
        record["random_weights"] = bool(getattr(tokenizer, "random_weights", False))
    path = Path(directory) / RECORD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # parallel tokenizer workers write it too
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_codec_record(directory: str | os.PathLike) -> dict | None:
    path = Path(directory) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable codec record: {e}") from e
    if record.get("codec") not in CODECS:
        raise ValueError(f"{path}: unknown codec {record.get('codec')!r}")
    return record


def record_dirs_from_config(config: dict) -> list[Path]:
    """Directories that may hold the corpus's codec record, most specific first: the checkpoint's
    ``manifest_dir`` (as given, relative to the working directory) and the directory of its
    absolute ``text_tokens`` path (which bin/tokenizer.py writes into the manifest dir)."""
    dirs = []
    if config.get("manifest_dir"):
        dirs.append(Path(config["manifest_dir"]))
    if config.get("text_tokens"):
        dirs.append(Path(config["text_tokens"]).parent)
    return dirs


def _first_codebook_size(directory: str | os.PathLike, record: dict) -> int:
    if record["codec"] != "mel-rvq":
        return CODEBOOK_SIZE
    import torch

    state = Path(directory) / record.get("state", "")
    sizes = torch.load(state, map_location="cpu", weights_only=True).get("sizes") if state.is_file() else None
    return int(sizes[0]) if sizes else CODEBOOK_SIZE


def first_codebook_size(directory: str | os.PathLike) -> int | None:
    """How many codes codebook 0 of the corpus in ``directory`` uses (1024 for EnCodec; a
    mel-rvq codec's fitted ``--first-codebook-size``); None without a codec record."""
    record = read_codec_record(directory)
    return None if record is None else _first_codebook_size(directory, record)


def check_ar_codebook_size(ar_codebook_size: int, directory: str | os.PathLike) -> None:
    """Refuse a model whose AR predicts fewer codebook-0 codes than the corpus uses: its codes
    beyond the head would be out of range (an index error deep in the first step at best)."""
    record = read_codec_record(directory)
    size = None if record is None else _first_codebook_size(directory, record)
    if size is not None and ar_codebook_size < size:
        raise ValueError(
            f"--ar-codebook-size {ar_codebook_size}: the corpus in {directory} was tokenized with "
            f"{record['codec']} whose codebook 0 has {size} codes; "
            f"use --ar-codebook-size {size} (or more)"
        )


def codec_identity(directory: str | os.PathLike) -> dict | None:
    """The codec record of ``directory`` plus, for a fitted codec, its state file's sha256
    (what the trainer stores in checkpoints as ``audio_codec``); None without a record."""
    record = read_codec_record(directory)
    if record is None:
        return None
    identity = dict(record)
    state = Path(directory) / record.get("state", "")
    if record["codec"] == "mel-rvq" and state.is_file():
        identity["sha256"] = sha256_of(state)
    return identity


def check_codec_identity(config: dict, directory: str | os.PathLike) -> None:
    """Raise ``CodecMismatchError`` when the checkpoint recorded a fitted codec whose state
    file is not the one in ``directory`` (refitted since, or another corpus's)."""
    from valle.codec.mel_rvq import STATE_FILE

    recorded = config.get("audio_codec") or {}
    want = recorded.get("sha256")
    if not want:
        return  # a checkpoint from before the hash was recorded, or EnCodec: nothing to compare
    state = Path(directory) / recorded.get("state", STATE_FILE)
    have = sha256_of(state) if state.is_file() else None
    if have != want:
        found = f"sha256 {have[:12]}" if have else "missing"
        raise CodecMismatchError(
            f"{state} ({found}) is not the codec this checkpoint was trained with (sha256 "
            f"{want[:12]}): the codec was refitted after training, so its codes mean other "
            "sounds. Pass --codec-dir with the original mel_rvq.pt, or retrain on the new codes")


def find_codec_record(config: dict) -> tuple[dict, Path] | None:
    for d in record_dirs_from_config(config):
        record = read_codec_record(d)
        if record is not None:
            return record, d
    return None


def codec_for_checkpoint(config: dict, device: str = "cpu", encodec_checkpoint: str | None = None,
                         allow_random_encodec: bool = False, codec: str | None = None,
                         codec_dir: str | os.PathLike | None = None):
    """The audio tokenizer a checkpoint was trained with. ``codec``/``codec_dir`` override the
    record (e.g. a corpus moved elsewhere); without a record the codec is EnCodec, as before."""
    if codec_dir is not None:
        record = read_codec_record(codec_dir) or {"codec": codec or "mel-rvq"}
        where: Path | None = Path(codec_dir)
    else:
        found = find_codec_record(config)
        record, where = found if found else ({"codec": "encodec"}, None)
    name = codec or record["codec"]
    if name == "mel-rvq" and where is None:
        raise FileNotFoundError(
            f"the checkpoint's corpus ({', '.join(map(str, record_dirs_from_config(config))) or 'no manifest_dir'}) "
            f"has no {RECORD_FILE}: pass --codec-dir DIR holding mel_rvq.pt")
    if name == "mel-rvq":
        check_codec_identity(config, where)
    logger.info("audio codec: %s%s", name, f" (from {where})" if where else "")
    return make_audio_tokenizer(name, where, device, encodec_checkpoint, allow_random_encodec)

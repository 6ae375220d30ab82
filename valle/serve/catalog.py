"""What the page offers: the checkpoints under ``--exp-dir`` and the example prompts of ``--prompt-dir``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from valle.infer import BEST_CHECKPOINT
from valle.synthesizer import PROMPT_FILE_SUFFIX, InputError, is_prompt_file

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")
PROMPT_SUFFIXES = (*AUDIO_SUFFIXES, PROMPT_FILE_SUFFIX)  # VALL-E X's .npz: codes + text ids
TRANSCRIPT_SUFFIXES = (".txt", ".lab")


@dataclass(frozen=True)
class CheckpointEntry:
    id: str  # what the page sends back: a path relative to --exp-dir, or a --checkpoint as given
    path: Path


@dataclass(frozen=True)
class PromptEntry:
    name: str  # file name inside --prompt-dir
    path: Path
    transcript: str  # from a sibling .txt/.lab file; empty when there is none

    @property
    def is_audio(self) -> bool:
        """False for a VALL-E X .npz prompt: codes and text ids, nothing to play, no transcript."""
        return not is_prompt_file(str(self.path))


def _checkpoint_rank(path: Path) -> tuple:
    """Directory by directory: best-valid-loss.pt first (what bin/infer.py picks for an exp dir),
    then the newest epochs, then the rest by name."""
    epoch = re.fullmatch(r"epoch-(\d+)\.pt", path.name)
    return (str(path.parent), path.name != BEST_CHECKPOINT, epoch is None,
            -int(epoch.group(1)) if epoch else 0, path.name)  # fmt: skip


def find_checkpoints(exp_dir: Path | None, extra: list[Path]) -> list[CheckpointEntry]:
    """Every ``*.pt`` under ``exp_dir`` (rescanned per call: training may add epochs) and ``extra``."""
    entries = [CheckpointEntry(str(p), p) for p in extra]
    if exp_dir is not None and exp_dir.is_dir():
        found = [p for p in exp_dir.rglob("*.pt")
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(exp_dir).parts)]  # fmt: skip
        entries += [CheckpointEntry(p.relative_to(exp_dir).as_posix(), p)
                    for p in sorted(found, key=_checkpoint_rank)]  # fmt: skip
    return entries


def resolve_checkpoint(entries: list[CheckpointEntry], checkpoint_id: str) -> Path:
    """The file behind a checkpoint id the page sent: only listed checkpoints may be loaded."""
    if not checkpoint_id:
        raise InputError("choose a checkpoint")
    for entry in entries:
        if entry.id == checkpoint_id:
            if not entry.path.is_file():
                raise InputError(f"checkpoint {checkpoint_id} not found (deleted?)")
            return entry.path
    raise InputError(f"checkpoint {checkpoint_id} not found: not one of the served checkpoints")


def _transcript(audio: Path) -> str:
    for suffix in TRANSCRIPT_SUFFIXES:
        text_file = audio.with_suffix(suffix)
        if text_file.is_file():
            return text_file.read_text(encoding="utf-8").strip()
    return ""


def find_prompts(prompt_dir: Path | None) -> list[PromptEntry]:
    """The audio files (and VALL-E X .npz prompts) directly in ``prompt_dir``, each audio file
    with its transcript when one is beside it."""
    if prompt_dir is None or not prompt_dir.is_dir():
        return []
    files = sorted(p for p in prompt_dir.iterdir() if p.suffix.lower() in PROMPT_SUFFIXES and p.is_file())
    return [PromptEntry(p.name, p, _transcript(p)) for p in files]


def resolve_prompt(entries: list[PromptEntry], name: str) -> PromptEntry:
    for entry in entries:
        if entry.name == name:
            return entry
    raise InputError(f"example prompt {name} not found")

"""Word error rate through Whisper, only where its weights are already on disk (never downloaded).

``openai-whisper``: ``--whisper-model`` is a name (looked up as ``~/.cache/whisper/NAME.pt``,
or ``$WHISPER_CACHE``) or a ``.pt`` path. ``faster-whisper``: a CTranslate2 model directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from valle.eval.per import error_rate

WHISPER_BACKENDS = ("openai-whisper", "faster-whisper")


class AsrUnavailable(RuntimeError):
    """Package or weights missing: the message names the file, the flag and the install."""


def normalize_words(text: str) -> list[str]:
    """Lower case, punctuation dropped (apostrophes kept): what WER compares."""
    return re.sub(r"[^\w' ]+", " ", text.lower()).split()


def word_error_rate(ref_text: str, hyp_text: str) -> float:
    return error_rate(normalize_words(ref_text), normalize_words(hyp_text))


def _openai_weights(model: str) -> Path:
    path = Path(model)
    if path.suffix == ".pt":
        return path
    cache = Path(os.environ.get("WHISPER_CACHE", Path.home() / ".cache" / "whisper"))
    return cache / f"{model}.pt"


class WhisperAsr:
    sample_rate = 16_000

    def __init__(self, model: str, backend: str = "openai-whisper", device: str = "cpu") -> None:
        if backend not in WHISPER_BACKENDS:
            raise ValueError(f"--whisper-backend {backend!r}: choose {' or '.join(WHISPER_BACKENDS)}")
        self.backend = backend
        if backend == "openai-whisper":
            weights = _openai_weights(model)
            if not weights.is_file():
                raise AsrUnavailable(
                    f"--whisper-model {model}: no weights at {weights} (put the .pt file there or pass its "
                    "path); nothing is downloaded, so WER is not measured")
            try:
                import whisper
            except ImportError as e:
                raise AsrUnavailable(f"--whisper-model needs openai-whisper: pip install openai-whisper ({e})") from e
            self._model = whisper.load_model(str(weights), device=device)
        else:
            try:
                from faster_whisper import WhisperModel
            except ImportError as e:
                raise AsrUnavailable(f"--whisper-backend faster-whisper needs faster-whisper ({e})") from e
            try:
                self._model = WhisperModel(model, device=device, local_files_only=True)
            except Exception as e:  # missing model directory: say so in one line
                raise AsrUnavailable(f"--whisper-model {model}: faster-whisper cannot load it offline ({e})") from e

    def transcribe(self, wav: torch.Tensor, sr: int) -> str:
        from valle.codec.audio import resample

        x = resample(torch.as_tensor(wav, dtype=torch.float32).reshape(-1), sr, self.sample_rate)
        if self.backend == "openai-whisper":
            return self._model.transcribe(x.numpy(), language="en", fp16=False)["text"].strip()
        segments, _info = self._model.transcribe(x.numpy(), language="en")
        return " ".join(s.text.strip() for s in segments)

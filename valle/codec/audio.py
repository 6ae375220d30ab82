"""Waveforms at the codecs' rate: any audio in, mono 24 kHz out (torchaudio and soundfile
are imported inside the functions)."""

from __future__ import annotations

import os

import numpy as np
import torch

from valle.codec.constants import SAMPLE_RATE


class AudioLoadError(RuntimeError):
    """Audio that cannot be read or holds no samples."""


def to_mono_24k(samples: np.ndarray | torch.Tensor, sampling_rate: int) -> torch.Tensor:
    """(C, N) or (N,) audio at any rate -> 1-D float tensor at 24 kHz."""
    import torchaudio.functional as AF

    x = torch.as_tensor(samples, dtype=torch.float32)
    if x.dim() == 2:
        x = x.mean(dim=0)
    if sampling_rate != SAMPLE_RATE:
        x = AF.resample(x, sampling_rate, SAMPLE_RATE)
    return x


def load_audio_24k(path: str | os.PathLike) -> torch.Tensor:
    """Read an audio file -> (1, 1, N) mono at 24 kHz. Errors name the file."""
    import soundfile as sf

    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:
        raise AudioLoadError(f"cannot read audio file {path}: {e}") from e
    if data.shape[0] == 0:
        raise AudioLoadError(f"audio file {path} holds no samples")
    return to_mono_24k(data.T, sr).reshape(1, 1, -1)

"""Waveforms at the codecs' rate: any audio in, mono 24 kHz out (soundfile is imported
inside the functions; no torchaudio).

``resample`` is band-limited sinc interpolation with a Hann window (6 zero crossings, cut-off
at 99 % of the lower Nyquist rate): the method and defaults of torchaudio's ``resample``, so
prompts and evaluation audio are what they were when torchaudio resampled them (equal within
float rounding: tests/codec/test_audio.py).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch.nn import functional as F

from valle.codec.constants import SAMPLE_RATE


class AudioLoadError(RuntimeError):
    """Audio that cannot be read or holds no samples."""


LOWPASS_ZEROS = 6  # sinc zero crossings each side of the kernel's centre
ROLLOFF = 0.99  # cut-off, as a fraction of the lower rate's Nyquist frequency


def _sinc_kernel(orig: int, new: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
    """(new, 1, 2 * width + orig) polyphase filters for rates already divided by their gcd:
    filter k gives output sample k of every block of ``new`` from ``orig`` input samples."""
    cutoff = min(orig, new) * ROLLOFF
    width = math.ceil(LOWPASS_ZEROS * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=dtype, device=device)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=dtype, device=device)[:, None, None] / new + taps) * cutoff
    t = t.clamp_(-LOWPASS_ZEROS, LOWPASS_ZEROS)
    window = torch.cos(t * math.pi / LOWPASS_ZEROS / 2) ** 2  # Hann over the kernel's span
    t *= math.pi
    sinc = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    return sinc * (window * (cutoff / orig)), width


def resample(wav: torch.Tensor, orig_freq: int, new_freq: int) -> torch.Tensor:
    """(..., N) float audio at ``orig_freq`` -> (..., ceil(N * new / orig)) at ``new_freq``."""
    if orig_freq <= 0 or new_freq <= 0 or int(orig_freq) != orig_freq or int(new_freq) != new_freq:
        raise ValueError(f"resample needs positive whole sample rates, got {orig_freq} -> {new_freq}")
    if orig_freq == new_freq:
        return wav
    if not wav.is_floating_point():
        raise TypeError(f"resample needs float audio, got {wav.dtype}")
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    kernel, width = _sinc_kernel(orig, new, wav.dtype, wav.device)
    shape = wav.shape
    x = F.pad(wav.reshape(-1, shape[-1]), (width, width + orig))
    y = F.conv1d(x[:, None], kernel, stride=orig).transpose(1, 2).reshape(x.shape[0], -1)
    return y[:, : math.ceil(new * shape[-1] / orig)].reshape(*shape[:-1], -1)


def to_mono_24k(samples: np.ndarray | torch.Tensor, sampling_rate: int) -> torch.Tensor:
    """(C, N) or (N,) audio at any rate -> 1-D float tensor at 24 kHz."""
    x = torch.as_tensor(samples, dtype=torch.float32)
    if x.dim() == 2:
        x = x.mean(dim=0)
    return resample(x, sampling_rate, SAMPLE_RATE)


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


def use_torch_resampling_in_lhotse() -> None:
    """Make lhotse resample with its torch resampler whether or not torchaudio is installed.

    lhotse (1.33) resamples a cut (``cut.resample``) with its own torch port of torchaudio's
    resampler when torchaudio is installed, and with scipy's ``resample_poly`` (another filter)
    when it is not. valle no longer needs torchaudio, so without this a corpus not at 24 kHz
    would get slightly other audio, hence other codes, depending on what else is installed.
    With it, the audio (and the codes) are those of the torchaudio path always. Idempotent;
    call it before loading audio through lhotse (DataLoader workers included)."""
    from lhotse.audio.resampling_backend import get_current_resampling_backend
    from lhotse.augmentation import torchaudio as lhotse_ta

    resample_cls = lhotse_ta.Resample
    if getattr(resample_cls, "_valle_torch_resampling", False):
        return
    original = resample_cls.__call__

    def __call__(self, samples, *args, **kwargs):
        if (self.source_sampling_rate == self.target_sampling_rate or lhotse_ta.is_torchaudio_available()
                or get_current_resampling_backend() == "sox"):
            return original(self, samples, *args, **kwargs)
        x = torch.from_numpy(samples) if isinstance(samples, np.ndarray) else samples
        return self.resampler(x).numpy()

    resample_cls.__call__ = __call__
    resample_cls._valle_torch_resampling = True

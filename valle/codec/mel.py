"""Log-mel frames at EnCodec's frame rate (24 kHz, hop 320 -> 75 frames/s), and their inverse.

Shared by the mel-RVQ codec (what it quantises) and the phoneme judge (what it hears), so
both see audio the same way. Plain torch: the filterbank (Slaney's mel scale, area-normalised
triangles, librosa's and torchaudio's "slaney" definition) and Griffin-Lim are written here,
equal to torchaudio's ``MelSpectrogram`` and ``griffinlim`` within float rounding
(tests/codec/test_mel_rvq.py), so fitted mel-rvq codecs keep their codes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from valle.codec.constants import HOP_LENGTH, SAMPLE_RATE

LOG_FLOOR = 1e-5


@dataclass(frozen=True)
class MelConfig:
    sample_rate: int = SAMPLE_RATE
    n_fft: int = 1280  # window = 4 hops: 75 % overlap, what Griffin-Lim needs to converge
    hop_length: int = HOP_LENGTH
    n_mels: int = 80
    f_min: float = 0.0
    f_max: float = 12_000.0

    def to_dict(self) -> dict:
        return asdict(self)


def num_frames(num_samples: int, hop_length: int = HOP_LENGTH) -> int:
    """EnCodec's frame count for ``num_samples``: ceil(N / hop)."""
    return -(-int(num_samples) // hop_length)


# Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = math.log(6.4) / 27.0


def hz_to_mel(hz: float) -> float:
    if hz < _MIN_LOG_HZ:
        return hz / _F_SP
    return _MIN_LOG_MEL + math.log(hz / _MIN_LOG_HZ) / _LOGSTEP


def mel_to_hz(mels: torch.Tensor) -> torch.Tensor:
    hz = _F_SP * mels
    log = mels >= _MIN_LOG_MEL
    hz[log] = _MIN_LOG_HZ * torch.exp(_LOGSTEP * (mels[log] - _MIN_LOG_MEL))
    return hz


def mel_filterbank(c: MelConfig) -> torch.Tensor:
    """(n_fft / 2 + 1, n_mels) triangles between mel-spaced edges, each scaled to unit area
    per Hz (Slaney normalisation)."""
    freqs = torch.linspace(0, c.sample_rate // 2, c.n_fft // 2 + 1)
    edges = mel_to_hz(torch.linspace(hz_to_mel(c.f_min), hz_to_mel(c.f_max), c.n_mels + 2))
    widths = edges[1:] - edges[:-1]
    slopes = edges.unsqueeze(0) - freqs.unsqueeze(1)  # (F, n_mels + 2)
    rising = (-1.0 * slopes[:, :-2]) / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    fb = torch.max(torch.zeros(1), torch.min(rising, falling))
    return fb * (2.0 / (edges[2 : c.n_mels + 2] - edges[: c.n_mels])).unsqueeze(0)


def _stft(x: torch.Tensor, c: MelConfig, window: torch.Tensor) -> torch.Tensor:
    return torch.stft(x, c.n_fft, c.hop_length, c.n_fft, window, center=True, pad_mode="reflect",
                      normalized=False, onesided=True, return_complex=True)


def griffin_lim(mag: torch.Tensor, c: MelConfig, window: torch.Tensor, n_iter: int, length: int,
                momentum: float = 0.99) -> torch.Tensor:
    """(B, F, T) linear magnitudes -> (B, length) waveform: fast Griffin-Lim (Perraudin et al.,
    2013), phases starting at zero so that the same magnitudes always give the same audio."""
    alpha = momentum / (1 + momentum)
    angles = torch.ones_like(mag, dtype=torch.complex64 if mag.dtype == torch.float32 else torch.complex128)
    previous = torch.tensor(0.0, dtype=mag.dtype)
    for _ in range(n_iter):
        inverse = torch.istft(mag * angles, c.n_fft, c.hop_length, c.n_fft, window, length=length)
        rebuilt = _stft(inverse, c, window)
        angles = rebuilt - previous * alpha
        angles = angles / (angles.abs() + 1e-16)
        previous = rebuilt
    return torch.istft(mag * angles, c.n_fft, c.hop_length, c.n_fft, window, length=length)


class MelFrontend:
    """(B, N) or (N,) waveform -> (B, T, n_mels) natural-log mel magnitudes, T = ceil(N / hop)."""

    def __init__(self, config: MelConfig | None = None) -> None:
        self.config = c = config or MelConfig()
        self.window = torch.hann_window(c.n_fft)
        self.fb = mel_filterbank(c)

    def mel(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N) -> (B, n_mels, N // hop + 1) mel magnitudes (a centred STFT's frames)."""
        spec = _stft(x, self.config, self.window).abs()
        return torch.matmul(spec.transpose(-1, -2), self.fb).transpose(-1, -2)

    @torch.no_grad()
    def __call__(self, wav: torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(wav, dtype=torch.float32)
        squeeze = x.dim() == 1
        x = x.reshape(1, -1) if squeeze else x.reshape(x.shape[0], -1)
        t = num_frames(x.shape[-1], self.config.hop_length)
        if x.shape[-1] <= self.config.n_fft // 2:  # reflect padding needs more: pad with silence
            x = torch.nn.functional.pad(x, (0, self.config.n_fft - x.shape[-1]))
        mel = self.mel(x)[..., :t]  # centred STFT gives N // hop + 1 >= t frames
        out = torch.log(mel.clamp_min(LOG_FLOOR)).transpose(1, 2).contiguous()
        return out[0] if squeeze else out

    def filterbank(self) -> torch.Tensor:
        """(n_freq, n_mels) triangular filters of the forward transform."""
        return self.fb


class MelInverter:
    """(T, n_mels) log-mel -> (T * hop,) waveform: pseudo-inverse of the filterbank, then
    Griffin-Lim. No learned weights, so it works offline; phase is estimated, so the sound is
    a little rough (fine for eSpeak-like corpora and for measuring intelligibility)."""

    def __init__(self, config: MelConfig | None = None, n_iter: int = 32) -> None:
        self.config = c = config or MelConfig()
        fb = MelFrontend(c).filterbank()  # (F, M)
        self.inverse = torch.linalg.pinv(fb)  # (M, F): least-squares linear magnitude
        self.n_iter = n_iter
        self.window = torch.hann_window(c.n_fft)

    @torch.no_grad()
    def __call__(self, log_mel: torch.Tensor) -> torch.Tensor:
        squeeze = log_mel.dim() == 2
        x = log_mel.unsqueeze(0) if squeeze else log_mel
        mag = torch.exp(x.float()) @ self.inverse  # (B, T, F)
        mag = mag.clamp_min(0.0).transpose(1, 2)  # (B, F, T)
        t = x.shape[1]
        c = self.config
        # Griffin-Lim's STFT needs more samples than half a window: very short inputs (a model
        # that stopped at once) are padded with silence and cropped back.
        t_pad = max(t, c.n_fft // c.hop_length)
        mag = torch.nn.functional.pad(mag, (0, t_pad - t))
        # A centred STFT of t * hop samples has t + 1 frames: repeat the last one.
        mag = torch.cat([mag, mag[..., -1:]], dim=-1)
        wav = griffin_lim(mag, c, self.window, self.n_iter, t_pad * c.hop_length)[..., : t * c.hop_length]
        return wav[0] if squeeze else wav

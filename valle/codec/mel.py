"""Log-mel frames at EnCodec's frame rate (24 kHz, hop 320 -> 75 frames/s), and their inverse.

Shared by the mel-RVQ codec (what it quantises) and the phoneme judge (what it hears), so
both see audio the same way. torchaudio is imported inside the functions.
"""

from __future__ import annotations

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


class MelFrontend:
    """(B, N) or (N,) waveform -> (B, T, n_mels) natural-log mel magnitudes, T = ceil(N / hop)."""

    def __init__(self, config: MelConfig | None = None) -> None:
        import torchaudio

        self.config = c = config or MelConfig()
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=c.sample_rate, n_fft=c.n_fft, hop_length=c.hop_length, n_mels=c.n_mels,
            f_min=c.f_min, f_max=c.f_max, power=1.0, center=True, norm="slaney", mel_scale="slaney",
        )

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
        return self.mel.mel_scale.fb


class MelInverter:
    """(T, n_mels) log-mel -> (T * hop,) waveform: pseudo-inverse of the filterbank, then
    Griffin-Lim. No learned weights, so it works offline; phase is estimated, so the sound is
    a little rough (fine for eSpeak-like corpora and for measuring intelligibility)."""

    def __init__(self, config: MelConfig | None = None, n_iter: int = 32) -> None:
        import torchaudio

        self.config = c = config or MelConfig()
        fb = MelFrontend(c).filterbank()  # (F, M)
        self.inverse = torch.linalg.pinv(fb)  # (M, F): least-squares linear magnitude
        self.n_iter = n_iter
        self.window = torch.hann_window(c.n_fft)
        self._griffinlim = torchaudio.functional.griffinlim

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
        # rand_init=False: the same codes always give the same wav (determinism).
        wav = self._griffinlim(mag, self.window, c.n_fft, c.hop_length, c.n_fft, 1.0, self.n_iter,
                               0.99, t_pad * c.hop_length, False)[..., : t * c.hop_length]
        return wav[0] if squeeze else wav

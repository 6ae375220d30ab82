"""Codec codes stored as lhotse features (int16, exact), so cuts stay lazy.

``EncodecCodes`` is a lhotse feature extractor that runs the EnCodec tokenizer;
``store_codes``/``encode_cut_batch`` write codes any codec made (bin/tokenizer.py's path).
The codecs themselves live in ``valle.codec``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from lhotse.features.base import FeatureExtractor, register_extractor

from valle.codec.audio import to_mono_24k
from valle.codec.constants import FRAME_SHIFT, HOP_LENGTH, NUM_QUANTIZERS, SAMPLE_RATE
from valle.codec.encodec import AudioTokenizer


def fit_frames(codes: np.ndarray, num_frames: int) -> np.ndarray:
    """Make (T, Q) codes exactly num_frames long (lhotse's frame count for the duration):
    trim, or repeat the last frame (EnCodec's ceil may differ from lhotse's rounding by one)."""
    if codes.shape[0] >= num_frames:
        return codes[:num_frames]
    pad = np.repeat(codes[-1:], num_frames - codes.shape[0], axis=0)
    return np.concatenate([codes, pad], axis=0)


@dataclass
class EncodecConfig:
    checkpoint: str | None = None
    allow_random_weights: bool = False
    device: str = "cpu"
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> EncodecConfig:
        return EncodecConfig(**data)


@register_extractor
class EncodecCodes(FeatureExtractor):
    """EnCodec codes as lhotse features: (T, 8) int16 at 75 frames/s.

    Store them with a writer that keeps integers exactly (``NumpyHdf5Writer``, as
    bin/tokenizer.py does, or ``NumpyFilesWriter``); lilcom writers are lossy float
    compressors. lhotse's own pipeline requires the recording's rate times 320/24000 to
    be an integer (true for 22.05, 24, 44.1, 48 kHz); bin/tokenizer.py resamples cuts to
    24 kHz first and ``encode_cut_batch`` has no such limit.
    """

    name = "encodec"
    config_type = EncodecConfig

    def __init__(self, config: EncodecConfig | None = None):
        super().__init__(config)
        self._tokenizer: AudioTokenizer | None = None

    @property
    def tokenizer(self) -> AudioTokenizer:
        if self._tokenizer is None:
            c = self.config
            self._tokenizer = AudioTokenizer(c.device, c.checkpoint, c.allow_random_weights, c.seed)
        return self._tokenizer

    @property
    def frame_shift(self) -> float:
        return FRAME_SHIFT

    def feature_dim(self, sampling_rate: int) -> int:
        return NUM_QUANTIZERS

    def extract(self, samples: np.ndarray | torch.Tensor, sampling_rate: int) -> np.ndarray:
        from lhotse.utils import compute_num_frames

        wav = to_mono_24k(samples, sampling_rate)
        codes = self.tokenizer.encode_batch([wav])[0].T.numpy().astype(np.int16)
        n = compute_num_frames(wav.shape[-1] / SAMPLE_RATE, FRAME_SHIFT, SAMPLE_RATE)
        return fit_frames(codes, n)


def store_codes(cut, codes: torch.Tensor, storage, codec=None, storage_path=None):
    """Write one cut's (Q, T) codes through a lhotse writer (int16, exact) and return the cut
    with a ``Features`` manifest: ``codec``'s rate and hop (EnCodec's by default), frames
    fitted to lhotse's count for the cut's duration. Any codec with the ``AudioTokenizer``
    attributes plugs in here. ``storage_path``: where readers will find the file, when the
    writer writes it under a temporary name (default: the writer's own path)."""
    from lhotse.features.base import Features
    from lhotse.utils import compute_num_frames, fastcopy

    rate = codec.sample_rate if codec is not None else SAMPLE_RATE
    hop = codec.hop_length if codec is not None else HOP_LENGTH
    name = getattr(codec, "name", EncodecCodes.name) if codec is not None else EncodecCodes.name
    frame_shift = hop / rate
    n = compute_num_frames(cut.duration, frame_shift, rate)
    arr = fit_frames(codes.T.cpu().numpy().astype(np.int16), n)
    key = storage.write(cut.id, arr)
    feats = Features(
        recording_id=cut.recording_id, channels=cut.channel, start=cut.start, duration=cut.duration,
        type=name, num_frames=n, num_features=arr.shape[1], frame_shift=frame_shift,
        sampling_rate=rate, storage_type=storage.name,
        storage_path=str(storage.storage_path if storage_path is None else storage_path),
        storage_key=key,
    )
    return fastcopy(cut, features=feats)


def encode_cut_batch(cuts, tokenizer: AudioTokenizer, storage, wavs: Sequence[torch.Tensor]):
    """Encode already-loaded waveforms of ``cuts`` (at the codec's rate), write their codes to
    ``storage`` and return the cuts with ``Features`` attached (see ``store_codes``)."""
    return [store_codes(cut, codes, storage, tokenizer) for cut, codes in zip(cuts, tokenizer.encode_batch(wavs))]

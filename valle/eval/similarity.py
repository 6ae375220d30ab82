"""Speaker similarity: cosine between speaker embeddings of the output and of the prompt.

``resemblyzer`` (default): its GE2E speaker encoder ships inside the wheel, so it works offline
(``pip install 'valle[eval]'``). ``wavlm`` (WavLM-base-plus-sv through ``transformers``) and
``ecapa`` (SpeechBrain's ECAPA-TDNN) are what the VALL-E papers use; they load only from a
local directory given by ``--speaker-model-path`` and never download.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

SPEAKER_MODELS = ("resemblyzer", "wavlm", "ecapa")


class SpeakerModelUnavailable(RuntimeError):
    """The chosen speaker model's package or weights are missing (the message says which)."""


def _resample(wav: torch.Tensor, sr: int, target: int) -> torch.Tensor:
    from valle.codec.audio import resample

    return resample(torch.as_tensor(wav, dtype=torch.float32).reshape(-1), sr, target)


def _cosine(a: np.ndarray | None, b: np.ndarray | None) -> float:
    if a is None or b is None:
        return float("nan")
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denom) if denom > 0 else float("nan")


class SpeakerEmbedder:
    """embed(wav at ``sample_rate``) -> vector or None (audio too short or silent)."""

    name = "resemblyzer"

    def __init__(self, model: str = "resemblyzer", path: str | os.PathLike | None = None,
                 device: str = "cpu") -> None:
        if model not in SPEAKER_MODELS:
            raise ValueError(f"--speaker-model {model!r}: choose one of {', '.join(SPEAKER_MODELS)}")
        self.name, self.device = model, device
        getattr(self, f"_init_{model}")(path)

    # ---- back ends
    def _init_resemblyzer(self, path) -> None:
        try:
            from resemblyzer import VoiceEncoder, preprocess_wav
        except ImportError as e:
            raise SpeakerModelUnavailable(
                f"speaker similarity needs resemblyzer ({e}); install it with pip install 'valle[eval]' "
                "(its encoder weights ship in the wheel), or pass --speaker-model none") from e
        self._encoder = VoiceEncoder(self.device, verbose=False, weights_fpath=path)
        self._preprocess = preprocess_wav
        self.sample_rate = 16_000

    def _local_dir(self, path, what: str) -> Path:
        if path is None or not Path(path).exists():
            raise SpeakerModelUnavailable(
                f"--speaker-model {self.name}: pass --speaker-model-path DIR holding {what} "
                f"(got {path}); nothing is downloaded")
        return Path(path)

    def _init_wavlm(self, path) -> None:
        local = self._local_dir(path, "a transformers WavLMForXVector model (e.g. microsoft/wavlm-base-plus-sv)")
        try:
            from transformers import AutoFeatureExtractor, WavLMForXVector
        except ImportError as e:
            raise SpeakerModelUnavailable(f"--speaker-model wavlm needs transformers ({e})") from e
        self._fe = AutoFeatureExtractor.from_pretrained(local, local_files_only=True)
        self._wavlm = WavLMForXVector.from_pretrained(local, local_files_only=True).to(self.device).eval()
        self.sample_rate = 16_000

    def _init_ecapa(self, path) -> None:
        local = self._local_dir(path, "a SpeechBrain ECAPA model (e.g. speechbrain/spkrec-ecapa-voxceleb)")
        try:
            from speechbrain.inference.speaker import EncoderClassifier
        except ImportError as e:
            raise SpeakerModelUnavailable(f"--speaker-model ecapa needs speechbrain ({e})") from e
        self._ecapa = EncoderClassifier.from_hparams(source=str(local), savedir=str(local),
                                                     run_opts={"device": self.device})
        self.sample_rate = 16_000

    # ---- embedding
    @torch.inference_mode()
    def embed(self, wav: torch.Tensor, sr: int) -> np.ndarray | None:
        if wav.numel() < sr // 4:  # under 0.25 s: no voice to compare
            return None
        x = _resample(wav, sr, self.sample_rate)
        if self.name == "resemblyzer":
            y = self._preprocess(x.numpy(), source_sr=self.sample_rate)  # volume norm, silence trim
            if len(y) < self.sample_rate // 4:
                return None
            return self._encoder.embed_utterance(y)
        if self.name == "wavlm":
            inputs = self._fe(x.numpy(), sampling_rate=self.sample_rate, return_tensors="pt")
            out = self._wavlm(**{k: v.to(self.device) for k, v in inputs.items()})
            return out.embeddings[0].cpu().numpy()
        return self._ecapa.encode_batch(x.unsqueeze(0).to(self.device))[0, 0].cpu().numpy()

    def similarity(self, a: torch.Tensor, sr_a: int, b: torch.Tensor, sr_b: int) -> float:
        """Cosine of the two embeddings; NaN when either is too short to embed."""
        return _cosine(self.embed(a, sr_a), self.embed(b, sr_b))

"""Audio <-> EnCodec codes (24 kHz model, 6 kbps: 8 codebooks at 75 frames/s).

How codes are stored (lhotse features) is ``valle.data.codes``'s business; this module only
makes them. The network is ``valle.codec.encodec_model`` (plain torch: no ``encodec`` package,
no torchaudio); its codes are the ``encodec`` package's bit for bit, so corpora tokenized with
the package stay valid.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from valle.codec.constants import FRAME_RATE, HOP_LENGTH, NUM_QUANTIZERS, SAMPLE_RATE
from valle.codec.encodec_model import EncodecNet
from valle.codec.weights import PretrainedWeights, TorchHubFile, WeightsError

logger = logging.getLogger(__name__)

BANDWIDTH_KBPS = 6.0
CHECKPOINT_FLAG = "--encodec-checkpoint"
RANDOM_WEIGHTS_FLAG = "--allow-random-encodec"


class EncodecWeightsError(WeightsError):
    """No EnCodec weights (a one-line message naming the file, the cache path and the flag)."""


# The official 24 kHz weights; the name's suffix is a prefix of their sha256.
WEIGHTS = PretrainedWeights(
    "EnCodec", TorchHubFile("https://dl.fbaipublicfiles.com/encodec/v0/encodec_24khz-d7cc33bc.th"),
    CHECKPOINT_FLAG, RANDOM_WEIGHTS_FLAG, EncodecWeightsError)


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_encodec_weights(
    checkpoint: str | os.PathLike | None = None, allow_random: bool = False, download: bool = True
) -> Path | None:
    """Where the EnCodec weights are: ``checkpoint``, else the torch hub cache, else a fresh
    download (hash-checked) into the cache. ``None`` means random weights (only with
    ``allow_random``). Cheap: call it before any long work so a missing file fails first."""
    return WEIGHTS.resolve(checkpoint, allow_random, download)


def _build_encodec(seed: int) -> EncodecNet:
    # fork_rng: building with random init must not disturb the caller's RNG streams; the
    # init draws the RNG as the encodec package does, so a seed gives the package's model.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return EncodecNet(BANDWIDTH_KBPS)


def _calibration_audio(seed: int, seconds: float = 6.0) -> torch.Tensor:
    """A seeded signal with varied spectra and loudness (noise bursts, chirps, silence)."""
    gen = torch.Generator().manual_seed(seed)
    n = int(seconds * SAMPLE_RATE)
    t = torch.arange(n) / SAMPLE_RATE
    noise = torch.randn(n, generator=gen)
    freq = 80.0 + 4000.0 * torch.rand(1, generator=gen) * (t / seconds)
    chirp = torch.sin(2 * torch.pi * torch.cumsum(freq.expand(n) / SAMPLE_RATE, 0) * 1.0)
    envelope = torch.rand(int(seconds * 10), generator=gen).repeat_interleave(SAMPLE_RATE // 10)[:n]
    mix = torch.rand(int(seconds * 10), generator=gen).repeat_interleave(SAMPLE_RATE // 10)[:n]
    return (envelope * (mix * noise * 0.3 + (1 - mix) * chirp * 0.5)).reshape(1, 1, -1)


@torch.inference_mode()
def _randomize_codebooks(model: EncodecNet, seed: int) -> None:
    """Untrained codebooks are zeros (k-means init happens in training), which maps every
    frame to code 0, and pure noise codebooks sit far from the encoder's outputs, which maps
    every frame to one code. Seed each residual codebook with encoder outputs of a seeded
    calibration signal (k-means-style init without iterations): deterministic, and the codes
    follow the input. (The same draws as before the codec was rewritten: same codes.)"""
    gen = torch.Generator().manual_seed(seed)
    emb = model.encoder(_calibration_audio(seed))  # (1, D, T)
    residual = emb[0].T.contiguous()  # (T, D)
    codebooks = model.quantizer.vq.codebooks(len(model.quantizer.vq.layers))
    for cb in codebooks[:NUM_QUANTIZERS]:
        bins = cb.embed.shape[0]
        idx = torch.randint(0, residual.shape[0], (bins,), generator=gen)
        jitter = 1e-3 * residual.std() * torch.randn(cb.embed.shape, generator=gen)
        cb.embed.copy_(residual[idx] + jitter)
        cb.inited.fill_(1.0)
        codes = cb.encode(residual.T.unsqueeze(0))  # (1, T)
        residual = residual - cb.decode(codes)[0].T
    for cb in codebooks[NUM_QUANTIZERS:]:
        cb.embed.copy_(torch.randn(cb.embed.shape, generator=gen))
        cb.inited.fill_(1.0)


class AudioTokenizer:
    """EnCodec 24 kHz at 6 kbps. Weights: ``checkpoint``, the hub cache, or a hash-checked
    download (``resolve_encodec_weights``); random weights only with ``allow_random_weights``.

    The codec interface the data pipeline relies on (a second codec provides the same):
    ``sample_rate``, ``num_quantizers``, ``frame_rate``, ``hop_length``, ``name``,
    ``encode_batch(list of 1-D waveforms at sample_rate) -> list of (Q, T) codes``,
    ``decode((B, Q, T)) -> (B, 1, N)`` and ``code_vectors() -> Q tensors (K_j, D)``."""

    name = "encodec"
    causal = True  # a frame's audio depends on it and the frames before: batches pad on the right
    sample_rate = SAMPLE_RATE
    num_quantizers = NUM_QUANTIZERS
    frame_rate = FRAME_RATE
    hop_length = HOP_LENGTH

    def __init__(
        self,
        device: str | torch.device = "cpu",
        checkpoint: str | os.PathLike | None = None,
        allow_random_weights: bool = False,
        seed: int = 0,
        download: bool = True,
    ) -> None:
        self.device = resolve_device(device)
        path = resolve_encodec_weights(checkpoint, allow_random_weights, download)
        model = _build_encodec(seed)
        self.random_weights = False
        if path is not None:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
                model.load_state_dict(state)
            except Exception as e:
                raise EncodecWeightsError(f"{path}: not an EnCodec 24 kHz state dict ({type(e).__name__}: "
                                          f"{str(e).splitlines()[0][:200]})") from e
            logger.info("EnCodec weights loaded from %s", path)
        else:
            _randomize_codebooks(model, seed)
            self.random_weights = True
            logger.warning("%s", "\n" + "!" * 72)
            logger.warning("RANDOM ENCODEC WEIGHTS: audio will be noise.")
            logger.warning(
                "No EnCodec checkpoint was given (%s) and %s is absent;", CHECKPOINT_FLAG, WEIGHTS.source.path()
            )
            logger.warning(
                "%s was passed, so codes come from a randomly initialised (seed %d) model.",
                RANDOM_WEIGHTS_FLAG, seed,
            )
            logger.warning("Fine for tests and pipeline demos; useless for real training.")
            logger.warning("%s", "!" * 72)
        self.model = model.eval().fold_weight_norm().to(self.device)

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """(B, 1, N) float at 24 kHz -> (B, 8, ceil(N / 320)) long codes."""
        if wav.dim() != 3 or wav.shape[1] != 1:
            raise ValueError(f"encode expects (B, 1, N) audio, got {tuple(wav.shape)}")
        return self.model.encode(wav.to(self.device, torch.float32)).long()

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, 8, T) codes -> (B, 1, N) waveform at 24 kHz."""
        if codes.dim() != 3:
            raise ValueError(f"decode expects (B, Q, T) codes, got {tuple(codes.shape)}")
        return self.model.decode(codes.to(self.device).long())

    @torch.inference_mode()
    def code_vectors(self) -> list[torch.Tensor]:
        """Per codebook, each code's vector in EnCodec's latent, (1024, 128): the decoder sums
        them (``--nar-decoding mmse`` in bin/infer.py)."""
        return [cb.embed.detach().clone() for cb in self.model.codebooks()]

    def encode_batch(self, wavs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Mono 24 kHz 1-D waveforms -> list of (8, T_i) codes. EnCodec 24 kHz is causal, so
        right-padding a batch leaves each item's codes unchanged; padding frames are cut off."""
        if not wavs:
            return []
        lens = [int(w.shape[-1]) for w in wavs]
        batch = torch.zeros(len(wavs), 1, max(lens))
        for i, w in enumerate(wavs):
            batch[i, 0, : lens[i]] = w.reshape(-1)
        codes = self.encode(batch).cpu()
        return [codes[i, :, : -(-n // HOP_LENGTH)] for i, n in enumerate(lens)]

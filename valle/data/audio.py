"""Audio <-> EnCodec codes (24 kHz model, 6 kbps: 8 codebooks at 75 frames/s).

Codes are stored as lhotse features (int16, exact) so cuts stay lazy: see
``EncodecCodes`` and ``encode_cut_batch``.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
NUM_QUANTIZERS = 8
BANDWIDTH_KBPS = 6.0
HOP_LENGTH = 320
FRAME_RATE = SAMPLE_RATE // HOP_LENGTH  # 75
FRAME_SHIFT = HOP_LENGTH / SAMPLE_RATE
NUM_AUDIO_TOKENS = 1024  # codebook size; also the padding value of audio features
CHECKPOINT_NAME = "encodec_24khz-d7cc33bc.th"
RANDOM_WEIGHTS_FLAG = "--allow-random-encodec"


class AudioLoadError(RuntimeError):
    """Audio that cannot be read or holds no samples."""


ENCODEC_URL = f"https://dl.fbaipublicfiles.com/encodec/v0/{CHECKPOINT_NAME}"
CHECKPOINT_FLAG = "--encodec-checkpoint"


class EncodecWeightsError(FileNotFoundError):
    """No EnCodec weights (a one-line message naming the file, the cache path and the flag)."""


def hub_checkpoint_path() -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / CHECKPOINT_NAME


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _download_checkpoint(dest: Path) -> str | None:
    """Fetch the official weights into ``dest`` with torch.hub's sha256 prefix check (the
    name's suffix, as the encodec package does). Returns None on success, else why not."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(ENCODEC_URL, str(dest), hash_prefix=CHECKPOINT_NAME.split("-")[-1][:8],
                                       progress=False)
    except Exception as e:  # urllib/OSError offline, RuntimeError on a hash mismatch
        if dest.exists() and dest.stat().st_size == 0:
            dest.unlink()
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return None


def resolve_encodec_weights(
    checkpoint: str | os.PathLike | None = None, allow_random: bool = False, download: bool = True
) -> Path | None:
    """Where the EnCodec weights are: ``checkpoint``, else the torch hub cache, else a fresh
    download (hash-checked) into the cache. ``None`` means random weights (only with
    ``allow_random``). Cheap: call it before any long work so a missing file fails first."""
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_file():
            raise EncodecWeightsError(f"{CHECKPOINT_FLAG} {path}: no such file")
        return path
    cached = hub_checkpoint_path()
    if cached.is_file():
        return cached
    why = _download_checkpoint(cached) if download else "downloads disabled"
    if why is None:
        logger.info("EnCodec weights downloaded to %s (sha256 prefix checked)", cached)
        return cached
    if allow_random:
        return None
    raise EncodecWeightsError(
        f"no EnCodec weights: {CHECKPOINT_NAME} is not at {cached} and {ENCODEC_URL} could not be "
        f"fetched ({why}); copy the file there or pass {CHECKPOINT_FLAG} PATH "
        f"({RANDOM_WEIGHTS_FLAG} gives random weights for tests: the audio is noise)")


def _build_encodec(seed: int):
    from encodec import EncodecModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm deprecation inside encodec
        # fork_rng: building with random init must not disturb the caller's RNG streams.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = EncodecModel._get_model(
                [1.5, 3.0, 6.0, 12.0, 24.0],
                SAMPLE_RATE,
                1,
                causal=True,
                model_norm="weight_norm",
                audio_normalize=False,
                name="encodec_24khz",
            )
    return model


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
def _randomize_codebooks(model, seed: int) -> None:
    """encodec leaves untrained codebooks at zero (k-means init happens in training), which
    maps every frame to code 0, and pure noise codebooks sit far from the encoder's outputs,
    which maps every frame to one code. Seed each residual codebook with encoder outputs of a
    seeded calibration signal (k-means-style init without iterations): deterministic, and the
    codes follow the input."""
    gen = torch.Generator().manual_seed(seed)
    emb = model.encoder(_calibration_audio(seed))  # (1, D, T)
    residual = emb[0].T.contiguous()  # (T, D)
    for layer in model.quantizer.vq.layers[:NUM_QUANTIZERS]:
        cb = layer._codebook
        bins = cb.embed.shape[0]
        idx = torch.randint(0, residual.shape[0], (bins,), generator=gen)
        jitter = 1e-3 * residual.std() * torch.randn(cb.embed.shape, generator=gen)
        cb.embed.copy_(residual[idx] + jitter)
        cb.inited.fill_(1.0)
        codes = layer.encode(residual.T.unsqueeze(0))  # (1, T)
        residual = residual - layer.decode(codes)[0].T
    for layer in model.quantizer.vq.layers[NUM_QUANTIZERS:]:
        layer._codebook.embed.copy_(torch.randn(layer._codebook.embed.shape, generator=gen))
        layer._codebook.inited.fill_(1.0)


class AudioTokenizer:
    """EnCodec 24 kHz at 6 kbps. Weights: ``checkpoint``, the hub cache, or a hash-checked
    download (``resolve_encodec_weights``); random weights only with ``allow_random_weights``.

    The codec interface the data pipeline relies on (a second codec provides the same):
    ``sample_rate``, ``num_quantizers``, ``frame_rate``, ``hop_length``, ``name``,
    ``encode_batch(list of 1-D waveforms at sample_rate) -> list of (Q, T) codes``,
    ``decode((B, Q, T)) -> (B, 1, N)`` and ``code_vectors() -> Q tensors (K_j, D)``."""

    name = "encodec"
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
                "No EnCodec checkpoint was given (%s) and %s is absent;", CHECKPOINT_FLAG, hub_checkpoint_path()
            )
            logger.warning(
                "%s was passed, so codes come from a randomly initialised (seed %d) model.",
                RANDOM_WEIGHTS_FLAG, seed,
            )
            logger.warning("Fine for tests and pipeline demos; useless for real training.")
            logger.warning("%s", "!" * 72)
        model.set_target_bandwidth(BANDWIDTH_KBPS)
        self.model = model.eval().to(self.device)

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """(B, 1, N) float at 24 kHz -> (B, 8, ceil(N / 320)) long codes."""
        if wav.dim() != 3 or wav.shape[1] != 1:
            raise ValueError(f"encode expects (B, 1, N) audio, got {tuple(wav.shape)}")
        frames = self.model.encode(wav.to(self.device, torch.float32))
        return torch.cat([codes for codes, _scale in frames], dim=-1).long()

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, 8, T) codes -> (B, 1, N) waveform at 24 kHz."""
        if codes.dim() != 3:
            raise ValueError(f"decode expects (B, Q, T) codes, got {tuple(codes.shape)}")
        return self.model.decode([(codes.to(self.device).long(), None)])

    @torch.inference_mode()
    def code_vectors(self) -> list[torch.Tensor]:
        """Per codebook, each code's vector in EnCodec's latent, (1024, 128): the decoder sums
        them (``--nar-decoding mmse`` in bin/infer.py)."""
        layers = self.model.quantizer.vq.layers[:NUM_QUANTIZERS]
        return [layer.project_out(layer._codebook.embed).detach() for layer in layers]

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


def fit_frames(codes: np.ndarray, num_frames: int) -> np.ndarray:
    """Make (T, Q) codes exactly num_frames long (lhotse's frame count for the duration):
    trim, or repeat the last frame (EnCodec's ceil may differ from lhotse's rounding by one)."""
    if codes.shape[0] >= num_frames:
        return codes[:num_frames]
    pad = np.repeat(codes[-1:], num_frames - codes.shape[0], axis=0)
    return np.concatenate([codes, pad], axis=0)


# --------------------------------------------------------------------------- lhotse integration
def _register():
    from lhotse.features.base import FeatureExtractor, register_extractor
    from lhotse.utils import compute_num_frames

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
            wav = to_mono_24k(samples, sampling_rate)
            codes = self.tokenizer.encode_batch([wav])[0].T.numpy().astype(np.int16)
            n = compute_num_frames(wav.shape[-1] / SAMPLE_RATE, FRAME_SHIFT, SAMPLE_RATE)
            return fit_frames(codes, n)

    return EncodecConfig, EncodecCodes


EncodecConfig, EncodecCodes = _register()


def store_codes(cut, codes: torch.Tensor, storage, codec=None):
    """Write one cut's (Q, T) codes through a lhotse writer (int16, exact) and return the cut
    with a ``Features`` manifest: ``codec``'s rate and hop (EnCodec's by default), frames
    fitted to lhotse's count for the cut's duration. Any codec with the ``AudioTokenizer``
    attributes plugs in here."""
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
        sampling_rate=rate, storage_type=storage.name, storage_path=str(storage.storage_path),
        storage_key=key,
    )
    return fastcopy(cut, features=feats)


def encode_cut_batch(cuts, tokenizer: AudioTokenizer, storage, wavs: Sequence[torch.Tensor]):
    """Encode already-loaded waveforms of ``cuts`` (at the codec's rate), write their codes to
    ``storage`` and return the cuts with ``Features`` attached (see ``store_codes``)."""
    return [store_codes(cut, codes, storage, tokenizer) for cut, codes in zip(cuts, tokenizer.encode_batch(wavs))]

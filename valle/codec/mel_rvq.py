"""An offline audio codec with EnCodec's interface: residual vector quantisation of log-mel frames.

Why: EnCodec's weights cannot be downloaded everywhere, and random EnCodec weights give noise.
This codec needs no pretrained weights: its 8 codebooks of 1024 codes are fitted by k-means
on the training corpus's own log-mel frames (standardised per mel bin), one residual stage
after another, so codebook 0 alone already carries the coarse spectrum (what the AR stage
predicts) and codebooks 1-7 refine it (the NAR stage). Decoding sums the chosen centroids and
inverts the mel spectrogram with Griffin-Lim. 24 kHz audio, 75 frames/s, codes in [0, 1024):
the models, the collation (padding 1024) and the trainer are unchanged.

The fitted state is a small ``torch.save`` file (``mel_rvq.pt``) kept beside the tokenized
manifests; see ``valle.codec`` for how tokenizer, trainer checkpoints and inference find it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from valle.codec.constants import CODEBOOK_SIZE, HOP_LENGTH, NUM_QUANTIZERS, SAMPLE_RATE
from valle.codec.mel import MelConfig, MelFrontend, MelInverter

logger = logging.getLogger(__name__)

NAME = "mel-rvq"
STATE_FILE = "mel_rvq.pt"
FORMAT = "valle-mel-rvq-1"


@dataclass
class FitConfig:
    num_quantizers: int = NUM_QUANTIZERS
    codebook_size: int = CODEBOOK_SIZE
    iterations: int = 12  # Lloyd iterations per stage; more barely lowers the distortion
    # Codes in use in codebook 0 (<= codebook_size). Fewer, coarser classes make the AR's task
    # (codebook 0) far easier to learn; the residual stages carry the detail for the NAR.
    first_codebook_size: int = CODEBOOK_SIZE
    max_frames: int = 200_000  # frames sampled for fitting (memory and time bound)
    seed: int = 0
    mel: MelConfig = field(default_factory=MelConfig)


# ----------------------------------------------------------------------------- k-means
def _nearest(x: torch.Tensor, centers: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the nearest centre for each row of ``x`` and the squared distance to it.
    Chunked so memory stays (chunk x K) whatever the corpus size."""
    c2 = (centers * centers).sum(1)
    idx, dist = [], []
    for s in range(0, x.shape[0], chunk):
        xs = x[s : s + chunk]
        d = (xs * xs).sum(1, keepdim=True) - 2.0 * xs @ centers.T + c2
        m = d.min(dim=1)
        idx.append(m.indices)
        dist.append(m.values.clamp_min(0.0))
    return torch.cat(idx), torch.cat(dist)


def kmeans(x: torch.Tensor, k: int, iterations: int, gen: torch.Generator) -> torch.Tensor:
    """Lloyd's k-means, deterministic for a given generator. Centres left empty are moved to the
    worst-served points (largest distance), so all ``k`` codes stay in use when data allows."""
    n = x.shape[0]
    if n >= k:
        centers = x[torch.randperm(n, generator=gen)[:k]].clone()
    else:  # fewer frames than codes (tiny test corpora): jittered copies
        reps = x[torch.randint(0, n, (k,), generator=gen)]
        centers = reps + 1e-3 * x.std() * torch.randn(reps.shape, generator=gen)
    for _ in range(iterations):
        idx, dist = _nearest(x, centers)
        sums = torch.zeros_like(centers).index_add_(0, idx, x)
        counts = torch.bincount(idx, minlength=k).to(x.dtype)
        used = counts > 0
        centers[used] = sums[used] / counts[used, None]
        empty = (~used).nonzero().flatten()
        if empty.numel() and n >= k:
            worst = dist.topk(min(empty.numel(), n)).indices
            centers[empty[: worst.numel()]] = x[worst]
    return centers


# ----------------------------------------------------------------------------- the codec
class MelRvqCodec:
    """Same surface as ``valle.codec.encodec.AudioTokenizer`` (encode / decode / encode_batch)."""

    name = NAME
    feature_type = "mel_rvq"  # lhotse Features.type of the stored codes
    sample_rate = SAMPLE_RATE
    frame_rate = SAMPLE_RATE // HOP_LENGTH
    hop_length = HOP_LENGTH
    random_weights = False

    def __init__(self, codebooks: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                 mel: MelConfig | None = None, griffin_lim_iters: int = 32, info: dict | None = None,
                 device: str | torch.device = "cpu", sizes: list[int] | None = None) -> None:
        if codebooks.dim() != 3 or codebooks.shape[2] != mean.numel():
            raise ValueError(f"codebooks must be (Q, K, n_mels={mean.numel()}), got {tuple(codebooks.shape)}")
        self.device = torch.device(device)
        self.codebooks = codebooks.float()
        # codes in use per codebook (the rest of the 1024 rows are never chosen)
        self.sizes = list(sizes) if sizes else [int(codebooks.shape[1])] * int(codebooks.shape[0])
        self.mean, self.std = mean.float(), std.float()
        self.mel_config = mel or MelConfig()
        self.griffin_lim_iters = griffin_lim_iters
        self.info = dict(info or {})
        self.frontend = MelFrontend(self.mel_config)
        self._inverter: MelInverter | None = None

    @property
    def num_quantizers(self) -> int:
        return int(self.codebooks.shape[0])

    @property
    def codebook_size(self) -> int:
        return int(self.codebooks.shape[1])

    # ---- features <-> codes
    def features(self, wav: torch.Tensor) -> torch.Tensor:
        """(N,) waveform -> (T, n_mels) standardised log-mel, the space the codebooks live in."""
        return (self.frontend(wav.reshape(-1)) - self.mean) / self.std

    def quantize(self, feats: torch.Tensor) -> torch.Tensor:
        """(T, n_mels) standardised features -> (Q, T) codes (greedy residual search)."""
        residual = feats.float().clone()
        codes = []
        for cb, size in zip(self.codebooks, self.sizes):
            idx, _ = _nearest(residual, cb[:size])
            residual -= cb[idx]
            codes.append(idx)
        return torch.stack(codes)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """(Q', T) codes, Q' <= Q (the first Q' codebooks) -> (T, n_mels) log-mel."""
        q = codes.shape[0]
        if q > self.num_quantizers:
            raise ValueError(f"{q} codebooks given; the mel-rvq codec has {self.num_quantizers}")
        bad = (codes < 0) | (codes >= self.codebook_size)
        if bool(bad.any()):
            raise ValueError(f"codes outside [0, {self.codebook_size}) (padding 1024 left in?): "
                             f"{codes[bad][:5].tolist()}")
        feats = sum(self.codebooks[j][codes[j].long()] for j in range(q))
        return feats * self.std + self.mean

    def code_vectors(self) -> list[torch.Tensor]:
        """Per codebook, the vector of each code in use, (size_j, n_mels): the codes' place in
        the space decoding sums them in (``--nar-decoding mmse`` in bin/infer.py)."""
        return [cb[:size] for cb, size in zip(self.codebooks, self.sizes)]

    # ---- AudioTokenizer interface
    @torch.inference_mode()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """(B, 1, N) float at 24 kHz -> (B, 8, ceil(N / 320)) long codes (every row padded to N)."""
        if wav.dim() != 3 or wav.shape[1] != 1:
            raise ValueError(f"encode expects (B, 1, N) audio, got {tuple(wav.shape)}")
        out = torch.stack([self.quantize(self.features(w.cpu())) for w in wav])
        return out.long().to(self.device)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, Q, T) codes -> (B, 1, T * 320) waveform at 24 kHz."""
        if codes.dim() != 3:
            raise ValueError(f"decode expects (B, Q, T) codes, got {tuple(codes.shape)}")
        if self._inverter is None:
            self._inverter = MelInverter(self.mel_config, self.griffin_lim_iters)
        wavs = [self._inverter(self.dequantize(c.cpu())) for c in codes]
        return torch.stack(wavs).unsqueeze(1).to(self.device)

    def encode_batch(self, wavs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Mono 24 kHz 1-D waveforms -> list of (8, T_i) codes, each encoded on its own."""
        with torch.inference_mode():
            return [self.quantize(self.features(w.reshape(-1).cpu())).long() for w in wavs]

    # ---- persistence
    def state_dict(self) -> dict:
        return {"format": FORMAT, "codebooks": self.codebooks, "mean": self.mean, "std": self.std,
                "mel": self.mel_config.to_dict(), "griffin_lim_iters": self.griffin_lim_iters,
                "info": self.info, "sizes": self.sizes}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu") -> MelRvqCodec:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"mel-rvq codec state {path} not found: fit it with "
                f"`python -m valle.codec fit --recordings <train recordings manifest> --output-dir {path.parent}`")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"{path}: not a mel-rvq codec state (format {FORMAT!r} expected)")
        return cls(state["codebooks"], state["mean"], state["std"], MelConfig(**state["mel"]),
                   state.get("griffin_lim_iters", 32), state.get("info"), device, state.get("sizes"))

    # ---- fitting
    @classmethod
    def fit(cls, wavs: Iterable[torch.Tensor], config: FitConfig | None = None) -> MelRvqCodec:
        """Fit on an iterable of mono 24 kHz waveforms (the training corpus)."""
        cfg = config or FitConfig()
        frontend = MelFrontend(cfg.mel)
        t0 = time.time()
        frames = [frontend(w.reshape(-1)) for w in wavs]
        if not frames:
            raise ValueError("mel-rvq fit: no audio given")
        x = torch.cat(frames)
        seconds = x.shape[0] / (SAMPLE_RATE / HOP_LENGTH)
        gen = torch.Generator().manual_seed(cfg.seed)
        if x.shape[0] > cfg.max_frames:
            x = x[torch.randperm(x.shape[0], generator=gen)[: cfg.max_frames]]
        mean, std = x.mean(0), x.std(0).clamp_min(1e-3)
        residual = (x - mean) / std
        codebooks, sizes = [], []
        for q in range(cfg.num_quantizers):
            size = cfg.first_codebook_size if q == 0 else cfg.codebook_size
            centers = kmeans(residual, size, cfg.iterations, gen)
            idx, dist = _nearest(residual, centers)
            residual = residual - centers[idx]
            # unused rows repeat the used ones: never chosen, harmless if decoded
            codebooks.append(centers[torch.arange(cfg.codebook_size) % size])
            sizes.append(size)
            logger.info("mel-rvq fit: stage %d/%d, residual energy per frame %.3f (%.1fs elapsed)",
                        q + 1, cfg.num_quantizers, float(dist.mean()), time.time() - t0)
        info = {"fit_frames": int(x.shape[0]), "fit_seconds_of_audio": round(seconds, 1),
                "utterances": len(frames), "iterations": cfg.iterations, "seed": cfg.seed}
        return cls(torch.stack(codebooks), mean, std, cfg.mel, info=info, sizes=sizes)

"""Vocos decoding of EnCodec 24 kHz codes (``bin/infer.py --decoder vocos``).

Vocos's EnCodec variant ("charactr/vocos-encodec-24khz") maps EnCodec codes straight to a
waveform: each code's EnCodec codebook vector, summed over the codebooks (the quantized
latent), through a ConvNeXt backbone conditioned on the bandwidth (adaptive layer norm), to
an STFT (magnitude and phase) that an inverse STFT with "same" padding turns into audio.

Written here in plain torch (no ``vocos``, ``encodec`` or torchaudio import): the ``vocos``
package needs both, and its ``EncodecFeatures`` downloads EnCodec's weights only to read the
codebooks, which the Vocos state dict already holds. Module names follow the published
``pytorch_model.bin`` (``backbone.convnext.0.dwconv.weight``, ``head.out.weight``...), and the
model's sizes come from the ``config.yaml`` beside it when there is one. Decoding equals the
``vocos`` package's within float rounding (tests/codec/test_vocos.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from valle.codec.constants import CODEBOOK_SIZE, HOP_LENGTH
from valle.codec.weights import HubRepoFile, PretrainedWeights, WeightsError

logger = logging.getLogger(__name__)

CHECKPOINT_FLAG = "--vocos-checkpoint"
RANDOM_WEIGHTS_FLAG = "--allow-random-vocos"
MAX_CODEBOOKS = 16  # 12 kbps, the largest bandwidth Vocos was trained with
BANDWIDTHS = (1.5, 3.0, 6.0, 12.0)  # kbps; 2, 4, 8, 16 codebooks
CONFIG_FILE = "config.yaml"


class VocosWeightsError(WeightsError):
    """No Vocos weights (one line naming the file, the cache and the flag)."""


class VocosCodecError(ValueError):
    """Vocos asked for a corpus whose codes are not EnCodec's."""


WEIGHTS = PretrainedWeights("Vocos", HubRepoFile("charactr/vocos-encodec-24khz", "pytorch_model.bin"),
                            CHECKPOINT_FLAG, RANDOM_WEIGHTS_FLAG, VocosWeightsError)


def resolve_vocos_weights(checkpoint: str | os.PathLike | None = None, allow_random: bool = False,
                          download: bool = True) -> Path | None:
    """``checkpoint``, else the Hugging Face hub cache, else a download; ``None`` means random
    weights (only with ``allow_random``). Cheap: call it before any synthesis work."""
    return WEIGHTS.resolve(checkpoint, allow_random, download)


def check_codec_for_vocos(codec_name: str) -> None:
    """Vocos was trained on EnCodec 24 kHz codes; any other codec's codes mean nothing to it."""
    if codec_name != "encodec":
        raise VocosCodecError(
            f"--decoder vocos decodes EnCodec codes only; this checkpoint's corpus uses the "
            f"'{codec_name}' codec: use --decoder encodec")


@dataclass(frozen=True)
class VocosConfig:
    """charactr/vocos-encodec-24khz's sizes (its config.yaml)."""

    input_channels: int = 128
    dim: int = 384
    intermediate_dim: int = 1152
    num_layers: int = 8
    n_fft: int = 1280
    hop_length: int = HOP_LENGTH
    bandwidths: tuple[float, ...] = BANDWIDTHS


def read_vocos_config(path: Path) -> VocosConfig:
    """A Vocos ``config.yaml`` (feature extractor, backbone, head with their init_args) ->
    ``VocosConfig``; any other architecture is refused, naming the file."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        parts = {name: (raw[name]["class_path"], raw[name].get("init_args", {}))
                 for name in ("feature_extractor", "backbone", "head")}
    except Exception as e:
        raise VocosWeightsError(f"{path}: not a Vocos config.yaml ({type(e).__name__}: {e})") from e
    want = {"feature_extractor": "EncodecFeatures", "backbone": "VocosBackbone", "head": "ISTFTHead"}
    for name, cls in want.items():
        if parts[name][0].rsplit(".", 1)[-1] != cls:
            raise VocosWeightsError(f"{path}: {name} is {parts[name][0]}; only the EnCodec Vocos "
                                    f"({cls}) decodes EnCodec codes")
    fe, bb, hd = (parts[n][1] for n in ("feature_extractor", "backbone", "head"))
    if fe.get("encodec_model", "encodec_24khz") != "encodec_24khz" or hd.get("padding", "same") != "same":
        raise VocosWeightsError(f"{path}: needs encodec_24khz features and an ISTFT head with 'same' padding")
    bandwidths = tuple(float(b) for b in fe.get("bandwidths", BANDWIDTHS))
    if bb.get("adanorm_num_embeddings", len(bandwidths)) != len(bandwidths):
        raise VocosWeightsError(f"{path}: adanorm_num_embeddings differs from the number of bandwidths")
    return VocosConfig(input_channels=int(bb["input_channels"]), dim=int(bb["dim"]),
                       intermediate_dim=int(bb["intermediate_dim"]), num_layers=int(bb["num_layers"]),
                       n_fft=int(hd["n_fft"]), hop_length=int(hd["hop_length"]), bandwidths=bandwidths)


def config_beside(weights: Path | None) -> VocosConfig:
    """The config.yaml next to the weights (a hub snapshot that ``Vocos.from_pretrained``
    filled holds both), else charactr/vocos-encodec-24khz's sizes."""
    if weights is None:
        return VocosConfig()
    path = Path(weights).parent / CONFIG_FILE
    return read_vocos_config(path) if path.is_file() else VocosConfig()


class AdaLayerNorm(nn.Module):
    """Layer norm whose scale and shift are looked up by the bandwidth."""

    def __init__(self, conditions: int, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.scale = nn.Embedding(conditions, dim)
        self.shift = nn.Embedding(conditions, dim)
        nn.init.ones_(self.scale.weight)
        nn.init.zeros_(self.shift.weight)

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), eps=self.eps) * self.scale(condition) + self.shift(condition)


class ConvNeXtBlock(nn.Module):
    """x + gamma * pw2(gelu(pw1(adanorm(depthwise_conv7(x))))) in the (B, C, T) layout."""

    def __init__(self, dim: int, intermediate_dim: int, conditions: int, layer_scale: float):
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = AdaLayerNorm(conditions, dim)
        self.pwconv1 = nn.Linear(dim, intermediate_dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(intermediate_dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).transpose(1, 2), condition)
        y = self.gamma * self.pwconv2(self.act(self.pwconv1(y)))
        return x + y.transpose(1, 2)


class Backbone(nn.Module):
    """(B, input_channels, T) features -> (B, T, dim)."""

    def __init__(self, c: VocosConfig):
        super().__init__()
        conditions = len(c.bandwidths)
        self.embed = nn.Conv1d(c.input_channels, c.dim, kernel_size=7, padding=3)
        self.norm = AdaLayerNorm(conditions, c.dim)
        self.convnext = nn.ModuleList(ConvNeXtBlock(c.dim, c.intermediate_dim, conditions, 1 / c.num_layers)
                                      for _ in range(c.num_layers))
        self.final_layer_norm = nn.LayerNorm(c.dim, eps=1e-6)

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(x).transpose(1, 2), condition).transpose(1, 2)
        for block in self.convnext:
            x = block(x, condition)
        return self.final_layer_norm(x.transpose(1, 2))


class SameISTFT(nn.Module):
    """Inverse STFT whose output has exactly hop samples per frame: overlap-add of the
    windowed inverse FFTs, (win - hop) / 2 trimmed at each end, divided by the summed squared
    window (torch.istft's centre padding would need NOLA at the edges, which trimming avoids)."""

    def __init__(self, n_fft: int, hop_length: int):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop_length
        self.register_buffer("window", torch.hann_window(n_fft))

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        """(B, n_fft / 2 + 1, T) complex -> (B, T * hop)."""
        frames = spec.shape[-1]
        pad = (self.n_fft - self.hop) // 2
        size = (frames - 1) * self.hop + self.n_fft
        frames_td = torch.fft.irfft(spec, self.n_fft, dim=1, norm="backward") * self.window[None, :, None]
        y = F.fold(frames_td, output_size=(1, size), kernel_size=(1, self.n_fft), stride=(1, self.hop))
        envelope = F.fold(self.window.square().expand(1, frames, -1).transpose(1, 2), output_size=(1, size),
                          kernel_size=(1, self.n_fft), stride=(1, self.hop)).squeeze()
        return y[:, 0, 0, pad:-pad] / envelope[pad:-pad]


class ISTFTHead(nn.Module):
    """(B, T, dim) -> log-magnitude and phase per bin -> (B, T * hop) audio."""

    def __init__(self, c: VocosConfig):
        super().__init__()
        self.out = nn.Linear(c.dim, c.n_fft + 2)
        self.istft = SameISTFT(c.n_fft, c.hop_length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_mag, phase = self.out(x).transpose(1, 2).chunk(2, dim=1)
        mag = torch.exp(log_mag).clip(max=1e2)  # Vocos's guard against huge magnitudes
        return self.istft(mag * (torch.cos(phase) + 1j * torch.sin(phase)))


class VocosDecoder(nn.Module):
    """EnCodec codes (T, Q) -> (N,) waveform at 24 kHz with Vocos."""

    def __init__(self, device: str | torch.device = "cpu", checkpoint: str | os.PathLike | None = None,
                 allow_random_weights: bool = False, download: bool = True, seed: int = 0):
        super().__init__()
        path = resolve_vocos_weights(checkpoint, allow_random_weights, download)
        self.config = c = config_beside(path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.backbone = Backbone(c)
            self.head = ISTFTHead(c)
            self.codebook_weights = nn.Parameter(
                torch.randn(MAX_CODEBOOKS * CODEBOOK_SIZE, c.input_channels),
                requires_grad=False)
            if path is None:  # random weights: small, like a fresh Vocos (trunc normal, std 0.02)
                for m in self.modules():
                    if isinstance(m, (nn.Conv1d, nn.Linear)):
                        nn.init.trunc_normal_(m.weight, std=0.02)
                        nn.init.zeros_(m.bias)
        if path is None:
            logger.warning("!!! Vocos has RANDOM weights (%s): the audio is noise !!!", RANDOM_WEIGHTS_FLAG)
        else:
            self._load(path)
        self.eval().to(device)

    def _load(self, path: Path) -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            ours = {k: v for k, v in state.items() if k.split(".")[0] in ("backbone", "head")}
            ours["codebook_weights"] = state["feature_extractor.codebook_weights"]
            self.load_state_dict(ours, strict=True)
        except Exception as e:
            raise VocosWeightsError(f"{path}: not a charactr/vocos-encodec-24khz state dict "
                                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
        logger.info("Vocos weights from %s", path)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes``: (T, Q) or (1, T, Q) EnCodec codes, Q in 2/4/8/16."""
        codes = codes.reshape(-1, codes.shape[-1]).long().to(self.codebook_weights.device)
        q = codes.shape[1]
        bandwidth_id = {2: 0, 4: 1, 8: 2, 16: 3}.get(q)
        if bandwidth_id is None:
            raise ValueError(f"Vocos decodes 2, 4, 8 or 16 codebooks, got {q}")
        offsets = torch.arange(q, device=codes.device) * CODEBOOK_SIZE
        features = F.embedding(codes + offsets, self.codebook_weights).sum(dim=1)
        x = self.backbone(features.T.unsqueeze(0), torch.tensor([bandwidth_id], device=codes.device))
        return self.head(x).reshape(-1).float().cpu()

"""Vocos decoding of EnCodec 24 kHz codes (``bin/infer.py --decoder vocos``).

Vocos's EnCodec variant ("charactr/vocos-encodec-24khz") maps EnCodec codes straight to a
waveform. Its ``EncodecFeatures`` loads EnCodec's own weights (a download) only to read the
codebooks, which the Vocos state dict already holds, so this module builds the backbone and
head itself and keeps the codebook table: no EnCodec download, and random weights possible.
``vocos`` is imported inside the functions (valle.models stays torch-only).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from valle.codec.constants import CODEBOOK_SIZE, HOP_LENGTH
from valle.codec.weights import HubRepoFile, PretrainedWeights, WeightsError

logger = logging.getLogger(__name__)

CHECKPOINT_FLAG = "--vocos-checkpoint"
RANDOM_WEIGHTS_FLAG = "--allow-random-vocos"
MAX_CODEBOOKS = 16  # 12 kbps, the largest bandwidth Vocos was trained with
BANDWIDTHS = (1.5, 3.0, 6.0, 12.0)  # kbps; 2, 4, 8, 16 codebooks


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


class VocosDecoder(torch.nn.Module):
    """EnCodec codes (T, Q) -> (N,) waveform at 24 kHz with Vocos."""

    def __init__(self, device: str | torch.device = "cpu", checkpoint: str | os.PathLike | None = None,
                 allow_random_weights: bool = False, download: bool = True, seed: int = 0):
        super().__init__()
        from vocos.heads import ISTFTHead
        from vocos.models import VocosBackbone

        path = resolve_vocos_weights(checkpoint, allow_random_weights, download)
        torch.manual_seed(seed)
        # charactr/vocos-encodec-24khz's config.yaml
        self.backbone = VocosBackbone(input_channels=128, dim=384, intermediate_dim=1152, num_layers=8,
                                      adanorm_num_embeddings=len(BANDWIDTHS))
        self.head = ISTFTHead(dim=384, n_fft=1280, hop_length=HOP_LENGTH, padding="same")
        self.codebook_weights = torch.nn.Parameter(
            torch.randn(MAX_CODEBOOKS * CODEBOOK_SIZE, 128), requires_grad=False)
        if path is None:
            logger.warning("!!! Vocos has RANDOM weights (%s): the audio is noise !!!", RANDOM_WEIGHTS_FLAG)
        else:
            self._load(path)
        self.eval().to(device)

    def _load(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        ours = {k: v for k, v in state.items() if k.split(".")[0] in ("backbone", "head")}
        ours["codebook_weights"] = state["feature_extractor.codebook_weights"]
        self.load_state_dict(ours, strict=True)
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
        features = torch.nn.functional.embedding(codes + offsets, self.codebook_weights).sum(dim=1)
        x = self.backbone(features.T.unsqueeze(0), bandwidth_id=torch.tensor([bandwidth_id], device=codes.device))
        return self.head(x).reshape(-1).float().cpu()

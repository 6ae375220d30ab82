"""EnCodec 24 kHz (Défossez et al., 2022) in plain torch: no torchaudio, no ``encodec`` package.

The network the official checkpoint ``encodec_24khz-d7cc33bc.th`` was trained as: a causal
SEANet encoder (weight-normed convolutions, strides 2-4-5-8, a 2-layer LSTM) to 128-d latents
at 75 Hz, a residual vector quantizer of 32 codebooks x 1024 codes (8 at 6 kbps), and the
mirrored decoder. Module names follow the checkpoint's state-dict keys
(``encoder.model.0.conv.conv.weight_g``, ``quantizer.vq.layers.0._codebook.embed``...), so it
loads as is.

Numerics follow the ``encodec`` package op for op (the same padding, the same weight-norm
kernel, the same distance expression), so codes are bit-equal to it and the decoded audio
equal within float rounding (tests/codec/test_encodec_model.py). Inference only: no training
losses, no codebook updates. Random initialisation draws the RNG in the package's order, so a
seeded random model is the package's seeded random model.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

SAMPLE_RATE = 24_000
DIMENSION = 128
N_FILTERS = 32
RATIOS = (8, 5, 4, 2)  # decoder's upsampling order; the encoder downsamples in reverse
KERNEL_SIZE = 7
RESIDUAL_KERNEL_SIZE = 3
LSTM_LAYERS = 2
BANDWIDTHS = (1.5, 3.0, 6.0, 12.0, 24.0)  # kbps
N_Q = 32  # codebooks at 24 kbps
BINS = 1024


class _WeightNormed(nn.Module):
    """A conv's parameters as ``torch.nn.utils.weight_norm`` stores them (``weight_g``,
    ``weight_v``, ``bias``), the weight computed with the same kernel. ``fold()`` computes it
    once for inference; loading a state dict drops the folded copy."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        # weight_norm's initial split: g = ||w|| per output slice (dim 0), v = w
        self.weight_g = nn.Parameter(torch.norm_except_dim(conv.weight.data, 2, 0))
        self.weight_v = nn.Parameter(conv.weight.data)
        self.bias = nn.Parameter(conv.bias.data)
        self.register_buffer("folded", None, persistent=False)

    def weight(self) -> torch.Tensor:
        if self.folded is not None:
            return self.folded
        return torch._weight_norm(self.weight_v, self.weight_g, 0)

    def fold(self) -> None:
        with torch.no_grad():
            self.folded = torch._weight_norm(self.weight_v, self.weight_g, 0).detach()

    def _load_from_state_dict(self, *args, **kwargs):
        self.folded = None
        super()._load_from_state_dict(*args, **kwargs)


class _Conv(_WeightNormed):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int, dilation: int):
        super().__init__(nn.Conv1d(cin, cout, kernel, stride, dilation=dilation))
        self.stride, self.dilation = stride, dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight(), self.bias, self.stride, 0, self.dilation)


class _ConvTranspose(_WeightNormed):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__(nn.ConvTranspose1d(cin, cout, kernel, stride))
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose1d(x, self.weight(), self.bias, self.stride)


class _Holder(nn.Module):
    """One level of the checkpoint's nesting (``SConv1d.conv`` -> ``NormConv1d.conv``)."""

    def __init__(self, name: str, inner: nn.Module):
        super().__init__()
        self.add_module(name, inner)
        self.inner = [inner]  # not a submodule: no second key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner[0](x)


def _reflect_pad(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Reflect padding that also works on inputs shorter than the padding: zeros are appended
    first, then cut off again (what the package does, so short clips give the same codes)."""
    length = x.shape[-1]
    extra = max(left, right) - length + 1 if length <= max(left, right) else 0
    if extra:
        x = F.pad(x, (0, extra))
    padded = F.pad(x, (left, right), mode="reflect")
    return padded[..., : padded.shape[-1] - extra]


class CausalConv1d(nn.Module):
    """Left (causal) reflect padding, plus the right padding that makes the last window whole."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1):
        super().__init__()
        self.conv = _Holder("conv", _Conv(cin, cout, kernel, stride, dilation))
        self.kernel, self.stride, self.dilation = kernel, stride, dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = (self.kernel - 1) * self.dilation + 1
        padding = kernel - self.stride
        n_frames = (x.shape[-1] - kernel + padding) / self.stride + 1
        extra = (math.ceil(n_frames) - 1) * self.stride + (kernel - padding) - x.shape[-1]
        return self.conv(_reflect_pad(x, padding, extra))


class CausalConvTranspose1d(nn.Module):
    """Transposed conv whose whole overhang (kernel - stride) is trimmed on the right."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.convtr = _Holder("convtr", _ConvTranspose(cin, cout, kernel, stride))
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.convtr(x)
        return y[..., : y.shape[-1] - self.trim]


class ResidualBlock(nn.Module):
    """x + conv1(elu(conv3_dilated(elu(x)))), the skip a 1x1 conv (SEANet, compress 2)."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        hidden = dim // 2
        self.block = nn.Sequential(nn.ELU(), CausalConv1d(dim, hidden, RESIDUAL_KERNEL_SIZE, dilation=dilation),
                                   nn.ELU(), CausalConv1d(hidden, dim, 1))
        self.shortcut = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shortcut(x) + self.block(x)


class SkipLSTM(nn.Module):
    """LSTM over time in the conv layout (B, C, T), plus its input."""

    def __init__(self, dim: int):
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, LSTM_LAYERS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(2, 0, 1)
        y, _ = self.lstm(x)
        return (y + x).permute(1, 2, 0)


class Encoder(nn.Module):
    """(B, 1, N) audio -> (B, 128, ceil(N / 320)) latents."""

    def __init__(self):
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(1, N_FILTERS, KERNEL_SIZE)]
        mult = 1
        for ratio in reversed(RATIOS):
            layers += [ResidualBlock(mult * N_FILTERS, 1), nn.ELU(),
                       CausalConv1d(mult * N_FILTERS, mult * N_FILTERS * 2, ratio * 2, ratio)]
            mult *= 2
        layers += [SkipLSTM(mult * N_FILTERS), nn.ELU(), CausalConv1d(mult * N_FILTERS, DIMENSION, KERNEL_SIZE)]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class Decoder(nn.Module):
    """(B, 128, T) latents -> (B, 1, 320 T) audio."""

    def __init__(self):
        super().__init__()
        mult = 2 ** len(RATIOS)
        layers: list[nn.Module] = [CausalConv1d(DIMENSION, mult * N_FILTERS, KERNEL_SIZE),
                                   SkipLSTM(mult * N_FILTERS)]
        for ratio in RATIOS:
            layers += [nn.ELU(), CausalConvTranspose1d(mult * N_FILTERS, mult * N_FILTERS // 2, ratio * 2, ratio),
                       ResidualBlock(mult * N_FILTERS // 2, 1)]
            mult //= 2
        layers += [nn.ELU(), CausalConv1d(N_FILTERS, 1, KERNEL_SIZE)]
        self.model = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model(z)


class Codebook(nn.Module):
    """One codebook. ``inited``, ``cluster_size`` and ``embed_avg`` are training state, kept
    so the checkpoint loads strictly; only ``embed`` is used. Untrained codebooks are zeros
    (the package fills them by k-means on the first training batch)."""

    def __init__(self, dim: int = DIMENSION, bins: int = BINS):
        super().__init__()
        self.register_buffer("inited", torch.zeros(1))
        self.register_buffer("cluster_size", torch.zeros(bins))
        self.register_buffer("embed", torch.zeros(bins, dim))
        self.register_buffer("embed_avg", torch.zeros(bins, dim))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D, T) -> (B, T) nearest codes. The distance is written as the package writes
        it: rounding decides near ties, and the codes must be the package's bit for bit."""
        b, d, t = x.shape
        flat = x.transpose(1, 2).reshape(-1, d)
        embed = self.embed.t()
        dist = -(flat.pow(2).sum(1, keepdim=True) - 2 * flat @ embed + embed.pow(2).sum(0, keepdim=True))
        return dist.max(dim=-1).indices.view(b, t)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, D, T)."""
        return F.embedding(codes, self.embed).transpose(1, 2)


class _CodebookLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self._codebook = Codebook()


class ResidualVQ(nn.Module):
    """Codebook j quantizes what codebooks 0..j-1 left over."""

    def __init__(self, n_q: int = N_Q):
        super().__init__()
        self.layers = nn.ModuleList(_CodebookLayer() for _ in range(n_q))

    def codebooks(self, n_q: int) -> list[Codebook]:
        return [layer._codebook for layer in self.layers[:n_q]]

    def encode(self, z: torch.Tensor, n_q: int) -> torch.Tensor:
        """(B, D, T) -> (B, n_q, T)."""
        residual, codes = z, []
        for cb in self.codebooks(n_q):
            c = cb.encode(residual)
            residual = residual - cb.decode(c)
            codes.append(c)
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, Q, T) -> (B, D, T): the sum of each codebook's vectors."""
        out = torch.tensor(0.0, device=codes.device)
        for q, cb in enumerate(self.codebooks(codes.shape[1])):
            out = out + cb.decode(codes[:, q])
        return out


class _Quantizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.vq = ResidualVQ()


def codebooks_for_bandwidth(kbps: float) -> int:
    """1.5 -> 2, 3 -> 4, 6 -> 8, 12 -> 16, 24 -> 32 (10 bits per code at 75 frames/s)."""
    if kbps not in BANDWIDTHS:
        raise ValueError(f"EnCodec 24 kHz has no {kbps} kbps: choose one of {', '.join(map(str, BANDWIDTHS))}")
    return int(kbps * 1000 // (math.log2(BINS) * SAMPLE_RATE / math.prod(RATIOS)))


class EncodecNet(nn.Module):
    """The 24 kHz model. ``encode``: (B, 1, N) -> (B, Q, ceil(N / 320)); ``decode``: back."""

    sample_rate = SAMPLE_RATE
    hop_length = math.prod(RATIOS)

    def __init__(self, bandwidth: float = 6.0):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.quantizer = _Quantizer()
        self.n_q = codebooks_for_bandwidth(bandwidth)

    def set_bandwidth(self, kbps: float) -> None:
        self.n_q = codebooks_for_bandwidth(kbps)

    def fold_weight_norm(self) -> EncodecNet:
        """Compute every weight-normed conv's weight once (inference: they never change)."""
        for m in self.modules():
            if isinstance(m, _WeightNormed):
                m.fold()
        return self

    def codebooks(self) -> list[Codebook]:
        return self.quantizer.vq.codebooks(self.n_q)

    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        return self.quantizer.vq.encode(self.encoder(wav), self.n_q)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.quantizer.vq.decode(codes))

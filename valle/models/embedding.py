"""Positional encoding and the optional prenets (``--add-prenet``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SinePositionalEncoding(nn.Module):
    """x + alpha * sinusoid(position), then dropout.

    ``interleaved=True`` lays the features out as sin, cos, sin, cos, ... (lifeiteng/vall-e,
    the Transformer paper); ``False`` as all sines then all cosines (this project's first
    layout). The two are a fixed permutation of each other: equivalent from scratch, but
    trained weights only carry over with the layout they were trained with.
    ``learned_alpha=False`` keeps alpha at its loaded value (1 at init) as a buffer, as
    lifeiteng's NAR positions do; the state-dict key is ``alpha`` either way.

    Positions are given explicitly, per row when needed, so the same code serves
    training (0..T-1) and batched decoding where rows have different prompt lengths.
    """

    def __init__(
        self, dim: int, dropout: float = 0.0, interleaved: bool = True, learned_alpha: bool = True
    ):
        super().__init__()
        if dim % 2:
            raise ValueError(f"model width must be even for sinusoidal positions, got {dim}")
        self.interleaved = interleaved
        if learned_alpha:
            self.alpha = nn.Parameter(torch.ones(1))
        else:
            self.register_buffer("alpha", torch.ones(1))
        self.dim = dim
        self.dropout = nn.Dropout(dropout)

    def encoding(self, positions: torch.Tensor) -> torch.Tensor:
        # Frequencies computed here in float32 (not a buffer): model.to(bfloat16) would
        # round them and shift every position's phase.
        inv_freq = torch.exp(
            torch.arange(0, self.dim, 2, dtype=torch.float32, device=positions.device)
            * (-math.log(10000.0) / self.dim)
        )
        angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        if self.interleaved:
            return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pe = self.encoding(positions).to(x.dtype)
        return self.dropout(x + self.alpha.to(x.dtype) * pe)


class TextPrenet(nn.Module):
    """Three conv blocks + projection over the text (bidirectional; text sees only text).

    LayerNorm (per position) rather than BatchNorm: a row's output must not depend on
    the other rows, or micro-batch splitting would change the loss.
    """

    def __init__(self, dim: int, dropout: float, kernel_size: int = 5, layers: int = 3):
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv1d(dim, dim, kernel_size, padding=kernel_size // 2) for _ in range(layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.dropout = nn.Dropout(dropout)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        keep = valid.unsqueeze(-1).to(x.dtype)
        for conv, norm in zip(self.convs, self.norms):
            # Zero padding before each conv so padded positions never leak into real ones.
            x = conv((x * keep).transpose(1, 2)).transpose(1, 2)
            x = self.dropout(F.relu(norm(x)))
        return self.proj(x)


class AudioPrenet(nn.Module):
    """Position-wise MLP on audio embeddings (causal by construction)."""

    def __init__(self, dim: int, dropout: float, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

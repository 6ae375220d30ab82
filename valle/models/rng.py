"""Counter-based random numbers computed from per-row seeds with tensor arithmetic.

Each training row carries a seed (derived by the trainer from seed, step and cut id).
Every random choice the model makes for that row is a pure function of
``(seed, stream)``, so splitting a batch into micro-batches or retrying it draws
exactly the same values, on any device, without touching torch's global RNG.

All products are kept below 2**63 (32-bit words times 16-bit halves), so the int64
arithmetic never overflows: signed overflow is undefined behaviour in the kernels.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32): good avalanche, cheap, exact on int64."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_from_seeds(seeds: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform floats in [0, 1), one per seed, for the named ``stream`` (a small int).

    ``seeds`` is an int64 tensor of any shape and values (negative ones included).
    The result is float64 so that ``floor(u * n)`` is exact for every realistic n.
    """
    seeds = seeds.to(torch.int64)
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    h = _hash32(lo ^ _hash32(hi + _GOLDEN))
    h = _hash32(h ^ _mul32(torch.full_like(h, stream + 1), _GOLDEN))
    h = _hash32(h + stream)
    # 32 random bits -> [0, 1) exactly representable in float64.
    return h.to(torch.float64) / 4294967296.0


def row_uniforms(
    sample_seeds: torch.Tensor | None, batch_size: int, stream: int, device: torch.device
) -> torch.Tensor:
    """Per-row uniforms in [0, 1) (float64, on ``device``).

    With seeds: deterministic per row. Without: torch's global RNG (plain training).
    """
    if sample_seeds is None:
        return torch.rand(batch_size, device=device, dtype=torch.float64)
    if sample_seeds.shape != (batch_size,):
        raise ValueError(
            f"sample_seeds must have shape ({batch_size},), got {tuple(sample_seeds.shape)}"
        )
    return uniform_from_seeds(sample_seeds.to(device), stream)


def randint_per_row(
    u: torch.Tensor, low: torch.Tensor | int, high: torch.Tensor | int
) -> torch.Tensor:
    """Integers in [low, high) per row from uniforms ``u``; ``high <= low`` gives ``low``."""
    low_t = torch.as_tensor(low, device=u.device, dtype=torch.int64)
    high_t = torch.as_tensor(high, device=u.device, dtype=torch.int64)
    span = (high_t - low_t).clamp(min=1)
    return low_t + torch.floor(u * span.to(torch.float64)).to(torch.int64).clamp(max=span - 1)

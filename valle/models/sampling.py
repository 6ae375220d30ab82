"""Token sampling for AR decoding: temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = -100, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus.

    ``top_k <= 0`` disables top-k (VALL-E recipes pass -100); ``top_p >= 1`` disables top-p.
    The most likely token always survives, so a row never ends with nothing to sample.
    """
    logits = logits.clone()
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass *before* it already reaches top_p (keeps the first).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    *,
    top_k: int = -100,
    top_p: float = 1.0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row from ``logits`` (B, V) -> LongTensor (B,).

    ``top_k == 1`` or ``temperature <= 0`` is greedy (argmax, no randomness). ``uniforms``
    (B,) in [0, 1): each row's draw by inverse CDF from its own number (the same row gives the
    same token in any batch); otherwise ``torch.multinomial`` with ``generator``.
    """
    logits = logits.float()
    if top_k == 1 or temperature <= 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
    probs = torch.softmax(logits, dim=-1)
    if uniforms is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    cdf = torch.cumsum(probs.double(), dim=-1)
    # the first token whose CDF exceeds u: a token of probability 0 never is
    target = (uniforms.to(cdf)[:, None] * cdf[:, -1:]).contiguous()
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def nearest_to_expectation(logits: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """The code whose codec vector lies nearest the distribution's expected vector.

    ``logits`` (..., V) over codes, ``vectors`` (K, D): code k's vector in the space where the
    codec sums its codebooks (EnCodec's latent, mel-rvq's standardised log-mel), K <= V codes
    in use. Among single codes this is the minimum-mean-squared-error choice: it minimises
    E||v_c - v_true||^2 = ||v_c - E[v]||^2 + const. When one code holds nearly all the mass
    that code is chosen, as by argmax; when the model is unsure between distant codes it
    picks a code near their mean (for a residual codebook, one near zero: little added)
    instead of committing to one of them, which costs more than it gains when wrong.
    """
    k = vectors.shape[0]
    probs = torch.softmax(logits[..., :k].float(), dim=-1)
    table = vectors.to(device=probs.device, dtype=probs.dtype)
    mean = probs.reshape(-1, k) @ table
    # ||m - v||^2 = ||v||^2 - 2 m.v + ||m||^2; the last term is the same for every code.
    dist = (table * table).sum(-1)[None, :] - 2.0 * mean @ table.T
    return dist.argmin(dim=-1).reshape(probs.shape[:-1])

"""Training losses: the AR and NAR cross entropies and the guided attention penalty.

The loss functions take the model (its embeddings, cores and heads) and a batch; the rows
they train on come from ``layout.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .layout import (
    IGNORE,
    STREAM_NAR_STAGE,
    ar_group_layout,
    lengths_to_valid,
    nar_layout,
)
from .rng import randint_per_row, row_uniforms
from .transformer import AttentionProbe


class GuidedAttention:
    """Guided attention loss (Tachibana et al. 2017, DC-TTS; ESPnet's guided multi-head
    form): the AR's attention from audio frame t to text token s is penalised by
    ``1 - exp(-(s/S - t/T)^2 / (2 sigma^2))``, zero on the diagonal of the (T, S) grid of
    each row's own lengths. Text and speech advance together, so this only tells the model
    where to look sooner: a decoder-only AR otherwise discovers the alignment from data
    alone, which a small corpus or a short budget may not give it (docs/training.md).

    Applied to the first ``heads`` heads of the last ``layers`` layers (the others stay
    free), in training only; inference is unchanged. Summed over audio frames like the
    cross entropy it is added to, averaged over the guided heads, times ``weight``.
    """

    def __init__(self, weight: float, sigma: float, heads: int, layers: int):
        self.weight, self.sigma, self.heads = weight, sigma, heads
        self.layers = layers if weight > 0 else 0

    def penalty_grid(self, text_valid: torch.Tensor, audio_valid: torch.Tensor) -> torch.Tensor:
        """(B, T, S) penalty, zero at padded text keys and padded audio queries."""
        s_len = text_valid.sum(1, keepdim=True).clamp(min=1).float()
        t_len = audio_valid.sum(1, keepdim=True).clamp(min=1).float()
        s_pos = torch.arange(text_valid.shape[1], device=text_valid.device)[None, :] / s_len
        t_pos = torch.arange(audio_valid.shape[1], device=audio_valid.device)[None, :] / t_len
        dist = s_pos[:, None, :] - t_pos[:, :, None]
        grid = 1.0 - torch.exp(-dist.square() / (2 * self.sigma**2))
        return grid * (audio_valid[:, :, None] & text_valid[:, None, :])

    def loss(
        self, scores: list[torch.Tensor], text_valid: torch.Tensor, audio_valid: torch.Tensor
    ) -> torch.Tensor:
        """``scores``: per probed layer, (B, H, T, S) attention scores of audio frames on the
        text. The penalty is taken on each head's attention renormalised over the text: on
        the full softmax a decoder-only head escapes it by looking at past audio instead
        (measured: guided heads' text mass fell to 0.01 and nothing aligned)."""
        grid = self.penalty_grid(text_valid, audio_valid)[:, None]
        total = sum((s[:, : self.heads].softmax(dim=-1) * grid).sum() for s in scores)
        return self.weight * total / (self.heads * len(scores))


def loss_and_top10(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed cross entropy over the targets that are not IGNORE, and (detached) how many of
    them are in the top 10 logits and how many there are."""
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
        ignore_index=IGNORE, reduction="sum",
    )  # fmt: skip
    with torch.no_grad():
        valid = targets != IGNORE
        top10 = logits.topk(min(10, logits.shape[-1]), dim=-1).indices
        hit = (top10 == targets.unsqueeze(-1)).any(-1) & valid
        return loss, hit.sum().float(), valid.sum().float()


def ar_loss(
    model: Any,
    text: torch.Tensor,
    text_valid: torch.Tensor,
    codes0: torch.Tensor,
    audio_lens: torch.Tensor,
    langs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Teacher-forced AR loss over codebook 0 (the target after the last frame is EOS), its
    top-10 hits and frames, and the weighted guided-attention penalty (None when off or
    not training)."""
    inputs, targets, n_in = ar_group_layout(
        codes0, audio_lens, model.ar_group_size, model.prepend_bos
    )
    in_valid = lengths_to_valid(n_in, inputs.shape[1])
    x = model.ar_embed_text(text, text_valid, langs)
    pos = torch.arange(inputs.shape[1], device=inputs.device)
    guided = model.guided
    probing = model.training and guided.weight > 0
    probe = AttentionProbe(heads=guided.heads) if probing else None
    y = model.ar_embed_audio(inputs, pos)
    h = model.ar_core(x, text_valid, y, in_valid, probe=probe, probe_last=guided.layers)
    targets = model.ar_classes(targets)  # IGNORE (< 0) stays
    loss, correct, frames = loss_and_top10(model.ar_logits(h, by_id=False), targets)
    penalty = guided.loss(probe.scores, text_valid, in_valid) if probing else None
    return loss, correct, frames, penalty


def nar_loss(
    model: Any,
    text: torch.Tensor,
    text_valid: torch.Tensor,
    codes: torch.Tensor,
    audio_lens: torch.Tensor,
    sample_seeds: torch.Tensor | None,
    prompt: torch.Tensor | None,
    prompt_lens: torch.Tensor | None,
    langs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NAR loss of one stage per row (drawn from the row's seed) over its target frames."""
    q = model.num_quantizers
    codes = codes[..., :q]
    bsz = codes.shape[0]
    u = row_uniforms(sample_seeds, bsz, STREAM_NAR_STAGE, codes.device)
    stage = randint_per_row(u, 1, q)  # (B,) in 1..Q-1
    packed, p, lens, target_mask = nar_layout(
        codes, audio_lens, sample_seeds, prompt, prompt_lens, model.prefix_mode
    )
    length = packed.shape[1]
    audio_valid = lengths_to_valid(lens, length)
    targets = packed.gather(2, stage[:, None, None].expand(-1, length, 1)).squeeze(2)
    targets = targets.masked_fill(~target_mask, IGNORE)
    h = model.nar_hidden(
        text, text_valid, packed, p, audio_valid, stage, prompt_full=True, langs=langs
    )
    return loss_and_top10(model.nar_head(h, stage), targets)

"""valle.eval.alignment: the per-head alignment figures, and that the guided-attention loss
teaches the guided heads to read the text in order (which the same training without it does not)."""

from __future__ import annotations

import pytest
import torch

from valle.eval.alignment import format_table, head_alignment
from valle.models import NUM_AUDIO_TOKENS, get_model


def _model(name="valle", **overrides):
    hp = dict(model_name=name, decoder_dim=32, nhead=4, num_decoder_layers=2, num_quantizers=2,
              num_text_tokens=40, dropout=0.0, **overrides)  # fmt: skip
    torch.manual_seed(0)
    return get_model(hp)


def _batch(seed=0, text_lens=(6, 9, 4, 8), rate=(4, 3, 5, 4)):
    """Random tokens; each row's audio is ``rate`` frames per text token."""
    g = torch.Generator().manual_seed(seed)
    audio_lens = [t * r for t, r in zip(text_lens, rate)]
    text = torch.ones(len(text_lens), max(text_lens), dtype=torch.long)
    codes0 = torch.full((len(text_lens), max(audio_lens)), NUM_AUDIO_TOKENS, dtype=torch.long)
    for b, (s, t) in enumerate(zip(text_lens, audio_lens)):
        text[b, :s] = torch.randint(4, 40, (s,), generator=g)
        codes0[b, :t] = torch.randint(0, 64, (t,), generator=g)
    return text, torch.tensor(text_lens), codes0, torch.tensor(audio_lens)


@pytest.mark.parametrize("name", ["valle", "vallf"])
def test_one_row_per_head_with_figures_in_range(name):
    model = _model(name).train()
    heads = head_alignment(model, *_batch())
    assert model.training  # restored
    assert [(h.layer, h.head) for h in heads] == [(la, he) for la in range(2) for he in range(4)]
    for h in heads:
        assert 0 < h.text_mass <= 1 + 1e-5 and 0 <= h.off_diagonal < 1 and -1 <= h.order <= 1
        if name == "vallf":
            assert h.text_mass == pytest.approx(1.0)
    assert "best head" in format_table(heads)


def _train(model, steps=100):
    """Fit the AR to one batch; the alignment figures on that batch."""
    text, text_lens, codes0, audio_lens = _batch(seed=1)
    audio = torch.stack([codes0, codes0], dim=-1)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if n.startswith("ar_")], lr=3e-3)
    model.train()
    for _ in range(steps):
        loss, _ = model(text, text_lens, audio, audio_lens, train_stage=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head_alignment(model, text, text_lens, codes0, audio_lens)


def test_the_guided_loss_makes_the_guided_heads_read_the_text_in_order():
    guided = _train(_model(guided_attention_weight=50.0, guided_attention_heads=2))
    plain = _train(_model())
    guided_heads = [h for h in guided if h.head < 2]  # the first 2 heads of both layers
    for h in guided_heads:
        assert h.order > 0.8 and h.off_diagonal < 0.25, h
    # The same training without the loss leaves those heads unaligned (random tokens carry
    # no alignment to discover).
    for h in (h for h in plain if h.head < 2):
        assert h.order < 0.6 and h.off_diagonal > 0.35, h

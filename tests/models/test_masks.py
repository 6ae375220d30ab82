"""Attention masks: audio never sees a later frame, text never sees audio, padding is inert."""

from __future__ import annotations

import pytest
import torch
from models_testlib import make_batch, tiny_model

from valle.models.layout import lengths_to_valid
from valle.models.transformer import prefix_causal_mask


def test_prefix_causal_mask_structure():
    s, t = 3, 4
    key_valid = torch.ones(1, s + t, dtype=torch.bool)
    key_valid[0, 2] = False  # one padded text column
    m = prefix_causal_mask(key_valid, s)[0, 0]
    for q in range(s + t):
        for k in range(s + t):
            if q == k:
                expected = True  # a row always sees itself (no empty softmax rows)
            elif not key_valid[0, k]:
                expected = False
            elif q < s:
                expected = k < s  # text sees text only, both directions
            else:
                expected = k < s or k <= q  # audio: all text, causal audio
            assert bool(m[q, k]) == expected, (q, k)


def _ar_hidden_full(model, text, text_lens, audio_tokens):
    """Hidden states of every column [text; audio] of the decoder-only AR."""
    text_valid = lengths_to_valid(text_lens, text.shape[1])
    x = model.ar_embed_text(text, text_valid)
    pos = torch.arange(audio_tokens.shape[1])
    y = model.ar_embed_audio(audio_tokens, pos)
    key_valid = torch.cat([text_valid, torch.ones_like(audio_tokens, dtype=torch.bool)], dim=1)
    mask = prefix_causal_mask(key_valid, text.shape[1])
    return model.ar_decoder(torch.cat([x, y], dim=1), mask)


def test_valle_ar_no_future_and_text_blind_to_audio():
    model = tiny_model("valle").eval()
    b = make_batch()
    text, lens = b["text_tokens"], b["text_tokens_lens"]
    audio = b["audio_features"][..., 0].clamp(max=1023)
    s, t_change = text.shape[1], 5
    h1 = _ar_hidden_full(model, text, lens, audio)
    audio2 = audio.clone()
    audio2[:, t_change] = (audio2[:, t_change] + 17) % 1024
    h2 = _ar_hidden_full(model, text, lens, audio2)
    # Text columns and audio columns before the change: bit-identical.
    torch.testing.assert_close(h1[:, : s + t_change], h2[:, : s + t_change], rtol=0, atol=1e-6)
    # The changed column and later ones do move (the test can fail).
    assert (h1[:, s + t_change :] - h2[:, s + t_change :]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["valle", "vallf"])
def test_ar_core_causal_and_padding_inert(name):
    model = tiny_model(name).eval()
    b = make_batch()
    text, lens = b["text_tokens"], b["text_tokens_lens"]
    text_valid = lengths_to_valid(lens, text.shape[1])
    audio = b["audio_features"][..., 0].clamp(max=1023)
    pos = torch.arange(audio.shape[1])
    valid = torch.ones_like(audio, dtype=torch.bool)

    def hidden(txt, aud):
        x = model.ar_embed_text(txt, text_valid)
        return model.ar_core(x, text_valid, model.ar_embed_audio(aud, pos), valid)

    h1 = hidden(text, audio)
    audio2 = audio.clone()
    audio2[:, 7] = (audio2[:, 7] + 3) % 1024
    torch.testing.assert_close(hidden(text, audio2)[:, :7], h1[:, :7], rtol=0, atol=1e-6)
    # Changing padded text ids changes nothing anywhere.
    text2 = text.masked_fill(~text_valid, 33)
    torch.testing.assert_close(hidden(text2, audio), h1, rtol=0, atol=1e-6)
    # Changing a real text token changes the audio states (text is attended).
    text3 = text.clone()
    text3[:, 0] = (text3[:, 0] + 1) % 40
    assert (hidden(text3, audio) - h1).abs().max() > 1e-3

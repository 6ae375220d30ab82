"""A tiny model memorises one batch: the loss falls by more than 90%."""

from __future__ import annotations

import pytest
import torch
from models_testlib import make_batch, run, tiny_model


@pytest.mark.parametrize("name", ["valle", "vallf"])
def test_overfit_one_batch(name):
    model = tiny_model(name, 1, decoder_dim=64)
    b = make_batch(text_lens=(8, 6), audio_lens=(24, 18), prompt_lens=(3, 2))
    seeds = torch.tensor([1, 2])  # same NAR stage and prefix every step
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(100):
        loss, metrics = run(model, b, 0, seeds)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss, metrics = run(model, b, 0, seeds)
    assert loss.item() < 0.1 * first, (first, loss.item())
    assert metrics["ar_top10_correct"] == metrics["ar_frames"]
    assert metrics["nar_top10_correct"] == metrics["nar_frames"]

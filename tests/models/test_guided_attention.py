"""Guided attention loss (--guided-attention-*): what it penalises, that probing the
attention does not change the forward, that it is a training-only term, and that a
resumed run takes it from the flags."""

from __future__ import annotations

import math

import pytest
import torch
from models_testlib import make_batch, run, tiny_model

from valle.models import TRAINING_HPARAMS, get_model
from valle.models.convert import ours_hparams
from valle.models.layout import lengths_to_valid
from valle.models.losses import GuidedAttention
from valle.models.transformer import AttentionProbe, prefix_causal_mask


def _valid(lens, width):
    return lengths_to_valid(torch.tensor(lens), width)


def test_penalty_grid_is_zero_on_each_rows_diagonal_and_on_padding():
    guided = GuidedAttention(1.0, sigma=0.4, heads=1, layers=1)
    text_valid, audio_valid = _valid([4, 2], 4), _valid([8, 3], 8)
    grid = guided.penalty_grid(text_valid, audio_valid)
    assert grid.shape == (2, 8, 4)
    # Row 0: 8 frames over 4 tokens; frame 2t is exactly on token t's diagonal point.
    for s in range(4):
        assert grid[0, 2 * s, s] == 0
    # The far corner is penalised by 1 - exp(-d^2 / (2 sigma^2)) with d = 3/4 - 0.
    assert grid[0, 0, 3] == pytest.approx(1 - math.exp(-(0.75**2) / (2 * 0.4**2)), rel=1e-5)
    assert grid[0, 7, 0] > grid[0, 7, 2] > grid[0, 7, 3]  # closer to the diagonal, less penalty
    # Row 1 uses its own lengths (3 frames, 2 tokens) and is zero beyond them.
    assert grid[1, 0, 0] == 0 and grid[1, 2, 1] > 0
    assert grid[1, 3:].abs().sum() == 0 and grid[1, :, 2:].abs().sum() == 0


def test_diagonal_attention_costs_less_than_anti_diagonal():
    guided = GuidedAttention(1.0, sigma=0.2, heads=1, layers=1)
    t, s = 12, 4
    diag = torch.zeros(1, 1, t, s)
    anti = torch.zeros(1, 1, t, s)
    for i in range(t):
        diag[0, 0, i, i * s // t] = 1.0
        anti[0, 0, i, s - 1 - i * s // t] = 1.0
    tv, av = _valid([s], s), _valid([t], t)
    # Scores whose softmax over the text is (nearly) one-hot.
    assert guided.loss([diag * 30], tv, av) < 0.2 * guided.loss([anti * 30], tv, av)


@pytest.mark.parametrize("name", ["valle", "vallf"])
def test_probing_the_attention_leaves_the_forward_unchanged(name):
    model = tiny_model(name, guided_attention_weight=1.0).train()
    batch = make_batch()
    text_valid = _valid(batch["text_tokens_lens"].tolist(), batch["text_tokens"].shape[1])
    audio = batch["audio_features"][..., 0].clamp(max=1023)
    audio_valid = _valid(batch["audio_features_lens"].tolist(), audio.shape[1])
    pos = torch.arange(audio.shape[1])
    x = model.ar_embed_text(batch["text_tokens"], text_valid)
    y = model.ar_embed_audio(audio, pos)
    plain = model.ar_core(x, text_valid, y, audio_valid)
    probe = AttentionProbe()
    probed = model.ar_core(x, text_valid, y, audio_valid, probe=probe, probe_last=2)
    scores = probe.scores
    torch.testing.assert_close(probed, plain, rtol=1e-5, atol=1e-5)
    assert len(scores) == 2
    b, t, s = audio.shape[0], audio.shape[1], x.shape[1]
    for sc in scores:
        assert sc.shape == (b, 4, t, s)  # audio queries over text keys
        # Padded text keys are masked out, every query has a valid text key to renormalise over.
        pad = ~text_valid[:, None, None, :].expand_as(sc)
        assert torch.isinf(sc[pad]).all() and torch.isfinite(sc[~pad]).all()
        torch.testing.assert_close(sc.softmax(-1).sum(-1), torch.ones(b, 4, t))


def test_the_guided_heads_probe_is_the_text_block_of_the_full_attention():
    """The loss probes only the guided heads' audio-to-text block; it must be that block of
    the full scores, with the same gradient into the weights."""
    model = tiny_model("valle", guided_attention_weight=1.0, guided_attention_heads=2).train()
    batch = make_batch()
    text, text_lens = batch["text_tokens"], batch["text_tokens_lens"]
    text_valid = _valid(text_lens.tolist(), text.shape[1])
    audio = batch["audio_features"][..., 0].clamp(max=1023)
    audio_valid = _valid(batch["audio_features_lens"].tolist(), audio.shape[1])
    guided = model.guided

    def penalty(full: bool) -> torch.Tensor:
        model.zero_grad()
        x = model.ar_embed_text(text, text_valid)
        y = model.ar_embed_audio(audio, torch.arange(audio.shape[1]))
        s = x.shape[1]
        if full:  # every head, every row and column, sliced afterwards
            probe = AttentionProbe()
            mask = prefix_causal_mask(torch.cat([text_valid, audio_valid], dim=1), s)
            model.ar_decoder(torch.cat([x, y], 1), mask, probe=probe, probe_last=guided.layers)
            scores = [sc[:, :2, s:, :s] for sc in probe.scores]
        else:
            probe = AttentionProbe(heads=guided.heads)
            model.ar_core(x, text_valid, y, audio_valid, probe=probe, probe_last=guided.layers)
            scores = probe.scores
            assert [sc.shape[1] for sc in scores] == [2, 2]  # only the guided heads computed
        value = guided.loss(scores, text_valid, audio_valid)
        value.backward()
        # None where the penalty does not reach (the last layer's feed-forward).
        return value.detach(), [p.grad for p in model.ar_decoder.parameters()]

    full_value, full_grads = penalty(full=True)
    block_value, block_grads = penalty(full=False)
    assert full_value > 0
    torch.testing.assert_close(block_value, full_value)
    assert sum(g is not None for g in full_grads) > len(full_grads) // 2
    for a, b in zip(block_grads, full_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["valle", "vallf"])
def test_the_loss_adds_the_weighted_penalty_in_training_only(name):
    batch = make_batch()
    guided = tiny_model(name, guided_attention_weight=2.0, guided_attention_heads=3)
    plain = tiny_model(name)
    plain.load_state_dict(guided.state_dict())
    guided.train(), plain.train()
    loss_g, metrics_g = run(guided, batch, train_stage=1)
    loss_p, metrics_p = run(plain, batch, train_stage=1)
    # The cross entropy is the same; the loss carries 2 x the penalty on top.
    torch.testing.assert_close(metrics_g["ar_loss"], metrics_p["ar_loss"], rtol=1e-5, atol=1e-4)
    extra = loss_g - loss_p
    assert extra > 0
    # The penalty's gradient reaches the AR weights.
    extra.backward()
    grads = [
        p.grad for n, p in guided.named_parameters() if n.startswith("ar_") and p.grad is not None
    ]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    # Not in evaluation (validation measures the cross entropy alone).
    guided.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            run(guided, batch, train_stage=1)[0], run(plain, batch, train_stage=1)[0]
        )
    # The NAR stage has no guided term.
    guided.train(), plain.train()
    seeds = torch.arange(4)
    with torch.no_grad():
        torch.testing.assert_close(
            run(guided, batch, train_stage=2, seeds=seeds)[0],
            run(plain, batch, train_stage=2, seeds=seeds)[0],
        )


def test_the_penalty_is_averaged_over_the_guided_heads_and_layers():
    batch = make_batch()
    one = tiny_model(
        guided_attention_weight=1.0, guided_attention_heads=1, guided_attention_layers=1
    )
    assert (one.guided.heads, one.guided.layers) == (1, 1)
    many = tiny_model(
        guided_attention_weight=1.0, guided_attention_heads=9, guided_attention_layers=9
    )
    assert (many.guided.heads, many.guided.layers) == (4, 2)  # clamped to the model's
    off = tiny_model(guided_attention_weight=0.0)
    assert off.guided.layers == 0  # nothing probed: SDPA everywhere
    one.train(), many.train(), off.train()
    with torch.no_grad():
        base = run(off, batch, train_stage=1)[0]
        per_frame = [(run(m, batch, train_stage=1)[0] - base) / batch["audio_features_lens"].sum()
                     for m in (one, many)]  # fmt: skip
    for value in per_frame:  # a mean of penalties in [0, 1) per frame
        assert 0 < value < 1


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(guided_attention_weight=-1.0), "--guided-attention-weight"),
        (dict(guided_attention_weight=1.0, guided_attention_sigma=0.0), "--guided-attention-sigma"),
        (dict(guided_attention_weight=1.0, guided_attention_heads=0), "--guided-attention-heads"),
    ],
)
def test_bad_settings_name_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        tiny_model(**overrides)


def test_a_resumed_run_takes_the_loss_settings_from_its_flags_not_the_checkpoint():
    model = tiny_model(guided_attention_weight=5.0, guided_attention_sigma=0.3)
    assert model.hparams["guided_attention_weight"] == 5.0  # recorded with the run's config
    restored = ours_hparams(model.hparams, model.state_dict())
    assert not TRAINING_HPARAMS & restored.keys()
    assert restored["decoder_dim"] == 32  # the architecture is the checkpoint's
    # Loaded for inference: the default (off), and the weights load as they are.
    again = get_model(restored)
    again.load_state_dict(model.state_dict())
    assert again.guided.weight == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_guided_path_trains_under_autocast(dtype):
    """The probed layers compute their scores in float32 whatever autocast gives them."""
    model = tiny_model(guided_attention_weight=1.0).train()
    batch = make_batch()
    with torch.autocast("cpu", dtype=dtype):
        loss, metrics = run(model, batch, train_stage=1)
    assert loss.dtype == torch.float32 and loss > metrics["ar_loss"]
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)

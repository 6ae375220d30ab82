"""lifeiteng/vall-e checkpoints load and reproduce lifeiteng's own outputs; our old ones still load.

The fixture (tests/fixtures/lifeiteng, see PROVENANCE.md) was written once by lifeiteng's
code: a tiny VALL-E in its exact key layout and what that code computed with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_testlib import tiny_model

from valle.models import generation, get_model
from valle.models.convert import CheckpointError, load_model_checkpoint

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lifeiteng"


# (variant, file suffix, (width, heads, layers, codebooks), frames lifeiteng generated)
VARIANTS = {"valle": ("", (32, 4, 1, 4), 77), "vallf": ("_vallf", (16, 2, 1, 3), 40)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def reference(request):
    suffix, shape, frames = VARIANTS[request.param]
    state, hp = load_model_checkpoint(FIXTURE / f"lifeiteng{suffix}_tiny.pt")
    model = get_model(hp).eval()
    model.load_state_dict(state)  # strict: every key converted, nothing left over
    assert hp["model_name"] == request.param
    return model, hp, torch.load(FIXTURE / f"expected{suffix}.pt"), shape, frames


def test_hyper_parameters_come_from_the_checkpoint(reference):
    _, hp, _, shape, _ = reference
    assert hp["source_format"] == "lifeiteng"
    assert (hp["decoder_dim"], hp["nhead"], hp["num_decoder_layers"], hp["num_quantizers"]) == shape
    assert hp["num_text_tokens"] == 512
    assert hp["share_embedding"] and not hp["tie_ar_head"] and hp["nar_head_tie"] == "lifeiteng"
    assert hp["positions"] == "interleaved" and hp["nar_position_scale"] == "fixed"


def test_ar_loss_matches_lifeiteng(reference):
    model, _, e, _, _ = reference
    loss, metrics = model(e["ar_x"], e["ar_x_lens"], e["ar_y"], e["ar_y_lens"], train_stage=1)
    # lifeiteng's per-row (unpadded) sums; our padded batch ignores padding, so it equals them.
    torch.testing.assert_close(loss.detach(), e["ar_loss_rows"].sum(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", [1, 2])
def test_greedy_synthesis_matches_lifeiteng(reference, mode, monkeypatch):
    model, _, e, shape, frames = reference
    model.prefix_mode = mode
    try:
        text = e["text"]
        codes = model.inference(text, torch.tensor([text.shape[1]]), e["prompt"],
                                prompt_text_lens=e["enroll_x_lens"] - 2, top_k=1)  # fmt: skip
        expected = e[f"codes_prefix_mode_{mode}"]
        assert (
            codes.shape == expected.shape == (1, frames, shape[3])
        )  # stopped on EOS, as lifeiteng
        assert torch.equal(codes, expected)
        if mode == 2:
            # The match needs the NAR text fix: with the prompt's transcript left in, it differs.
            monkeypatch.setattr(generation, "nar_text", lambda t, lens, p, mode: (t, lens))
            old = model.inference(text, torch.tensor([text.shape[1]]), e["prompt"], top_k=1)
            assert torch.equal(old[..., 0], expected[..., 0]) and not torch.equal(old, expected)
    finally:
        model.prefix_mode = 1


def test_our_old_checkpoints_still_load(tmp_path):
    # A checkpoint of the first model: its config predates the new keys.
    old = tiny_model("valle", 1, tie_ar_head=True, nar_head_tie="same", positions="concatenated",
                     nar_position_scale="learned")  # fmt: skip
    config = {k: v for k, v in old.hparams.items()
              if k not in ("tie_ar_head", "nar_head_tie", "positions", "nar_position_scale")}  # fmt: skip
    path = tmp_path / "old.pt"
    torch.save({"format": "valle-checkpoint-1", "model": old.state_dict(), "config": config}, path)
    state, hp = load_model_checkpoint(path)
    assert (hp["tie_ar_head"], hp["nar_head_tie"], hp["positions"], hp["nar_position_scale"]) == (
        True, "same", "concatenated", "learned")  # fmt: skip
    model = get_model(hp)
    model.load_state_dict(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in old.state_dict().items())


def test_bad_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="nope.pt: no such file"):
        load_model_checkpoint(tmp_path / "nope.pt")
    p = tmp_path / "noconfig.pt"
    torch.save({"model": tiny_model().state_dict()}, p)
    with pytest.raises(CheckpointError, match="noconfig.pt: no 'config'"):
        load_model_checkpoint(p)
    payload = torch.load(FIXTURE / "lifeiteng_tiny.pt", weights_only=False)
    p = tmp_path / "nohp.pt"
    torch.save({"model": payload["model"]}, p)
    with pytest.raises(CheckpointError, match="nohp.pt: a lifeiteng/vall-e checkpoint without"):
        load_model_checkpoint(p)
    p = tmp_path / "prenet.pt"
    torch.save({**payload, "add_prenet": True}, p)
    with pytest.raises(CheckpointError, match="add-prenet"):
        load_model_checkpoint(p)
    with pytest.raises(CheckpointError, match="holds no 'model_avg'"):
        load_model_checkpoint(FIXTURE / "lifeiteng_tiny.pt", use_averaged_model=True)

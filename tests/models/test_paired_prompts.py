"""--paired-prompts: a training row is [same-speaker utterance; target] and only the target
is predicted, in the same positions inference continues a prompt from."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models_testlib import make_batch, run, tiny_model

from valle.models import NUM_AUDIO_TOKENS, TRAINING_HPARAMS, get_model
from valle.models.convert import ours_hparams
from valle.models.valle import pack_sequences


def _record_ar_logits(model) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    original = model._ar_logits

    def recorder(h, by_id=True):
        seen.append(original(h, by_id))
        return seen[-1]

    model._ar_logits = recorder
    return seen


def _with_prompt_lens(batch, lens):
    batch = dict(batch)
    batch["prompt_features_lens"] = torch.tensor(lens)
    return batch


@pytest.mark.parametrize("name", ["valle", "vallf"])
def test_the_ar_loss_is_the_cross_entropy_of_the_target_frames_after_the_prompt(name):
    batch = _with_prompt_lens(make_batch(), [9, 4, 0, 6])  # row 2: no neighbour to pair with
    paired = tiny_model(name, paired_prompts=True)
    logits_seen = _record_ar_logits(paired)
    loss, metrics = run(paired, batch, train_stage=1)
    logits = logits_seen[0]
    expected, frames = torch.zeros(()), 0
    for b in range(4):
        p, n = int(batch["prompt_features_lens"][b]), int(batch["audio_features_lens"][b])
        seq = torch.cat([batch["prompt_features"][b, :p, 0], batch["audio_features"][b, :n, 0],
                         torch.tensor([NUM_AUDIO_TOKENS])])  # fmt: skip
        # Position i predicts seq[i + 1]; the first target frame is predicted from the
        # prompt's last frame, a row without a prompt starts from its own frame 0.
        first = max(p - 1, 0)
        positions = torch.arange(first, p + n)
        expected = expected + F.cross_entropy(logits[b, positions].float(), seq[positions + 1], reduction="sum")
        frames += len(positions)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["ar_loss"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["ar_frames"].item() == frames == sum(n + 1 for n in (20, 11, 15)) + 6


@pytest.mark.parametrize("name", ["valle", "vallf"])
def test_a_paired_row_is_the_layout_inference_continues(name):
    """The paired model sees [prompt; target] where a plain model given the packed
    sequence as its audio sees it: the same logits at every position."""
    batch = make_batch()
    paired, plain = tiny_model(name, paired_prompts=True), tiny_model(name)
    paired_logits, plain_logits = _record_ar_logits(paired), _record_ar_logits(plain)
    run(paired, batch, train_stage=1)
    packed, lens = pack_sequences(batch["prompt_features"], batch["prompt_features_lens"],
                                  batch["audio_features"], batch["audio_features_lens"], NUM_AUDIO_TOKENS)
    run(plain, dict(batch, audio_features=packed, audio_features_lens=lens), train_stage=1)
    for b, n in enumerate(lens.tolist()):
        torch.testing.assert_close(paired_logits[0][b, :n], plain_logits[0][b, :n])


def test_the_prompt_is_context_not_target():
    batch = make_batch()
    model = tiny_model(paired_prompts=True)
    loss, _ = run(model, batch, train_stage=1)
    other = dict(batch, prompt_features=batch["prompt_features"].flip(1).clamp(max=NUM_AUDIO_TOKENS - 1))
    other["prompt_features"] = torch.where(batch["prompt_features"] == NUM_AUDIO_TOKENS,
                                           batch["prompt_features"], other["prompt_features"])
    loss_other, metrics = run(model, other, train_stage=1)
    assert loss_other.item() != pytest.approx(loss.item(), rel=1e-6)  # it conditions the target
    # The frame count does not depend on the prompt's content, only on its presence.
    assert metrics["ar_frames"].item() == sum(n + 1 for n in (20, 11, 6, 15))


def test_the_nar_predicts_every_target_frame_after_the_paired_prompt():
    batch = _with_prompt_lens(make_batch(), [9, 4, 0, 6])
    _, paired = run(tiny_model(paired_prompts=True), batch, train_stage=2, seeds=torch.arange(4))
    _, same_utterance = run(tiny_model(), batch, train_stage=2, seeds=torch.arange(4))
    assert paired["nar_frames"].item() == sum((20, 11, 6, 15))
    assert same_utterance["nar_frames"].item() < paired["nar_frames"].item()  # mode 1 predicts after its own prefix


def test_paired_prompts_need_prefix_mode_1_and_the_prompt():
    with pytest.raises(ValueError, match="--paired-prompts needs --prefix-mode 1"):
        tiny_model(prefix_mode=4, paired_prompts=True)
    batch = make_batch()
    with pytest.raises(ValueError, match="--paired-prompts needs prompt_features"):
        tiny_model(paired_prompts=True)(
            batch["text_tokens"], batch["text_tokens_lens"], batch["audio_features"],
            batch["audio_features_lens"], train_stage=1,
        )  # fmt: skip


def test_a_checkpoint_of_a_paired_run_loads_as_a_plain_model():
    model = tiny_model(paired_prompts=True)
    assert "paired_prompts" in TRAINING_HPARAMS and model.hparams["paired_prompts"] is True
    restored = ours_hparams(model.hparams, model.state_dict())
    assert "paired_prompts" not in restored
    again = get_model(restored)
    assert again.paired_prompts is False
    again.load_state_dict(model.state_dict())

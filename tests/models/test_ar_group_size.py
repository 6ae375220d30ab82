"""--ar-group-size G (VALL-E 2's grouped code modeling): each AR position reads and predicts G
consecutive frames of codebook 0. Training and decoding must cut the frames into the same
groups, stop at the exact frame of EOS inside a group, and G = 1 must be the plain AR."""

from __future__ import annotations

import pytest
import torch
from models_testlib import make_batch, run, tiny_model

from valle.models import NUM_AUDIO_TOKENS, get_model
from valle.models.convert import ours_hparams
from valle.models.generation import DecodeOptions, ar_generate
from valle.models.layout import ar_group_layout, ar_prompt_layout

EOS, BOS, IGNORE = NUM_AUDIO_TOKENS, NUM_AUDIO_TOKENS + 1, -100
K = 16


def test_training_groups_frames_then_eos_and_predicts_the_next_group():
    codes = torch.arange(10, 19)[None].repeat(2, 1)  # 9 frames; row 1 has 6
    inputs, targets, n_in = ar_group_layout(codes, torch.tensor([9, 6]), 2, prepend_bos=False)
    assert inputs.tolist() == [
        [[10, 11], [12, 13], [14, 15], [16, 17]],
        [[10, 11], [12, 13], [14, 15], [EOS, EOS]],
    ]
    # group i predicts group i + 1; EOS right after the last frame, mid-group for row 0
    assert targets.tolist() == [
        [[12, 13], [14, 15], [16, 17], [18, EOS]],
        [[12, 13], [14, 15], [EOS, IGNORE], [IGNORE, IGNORE]],
    ]
    assert n_in.tolist() == [4, 3]

    inputs, targets, n_in = ar_group_layout(codes, torch.tensor([9, 6]), 2, prepend_bos=True)
    assert inputs[:, 0].tolist() == [[BOS, BOS], [BOS, BOS]]  # every group is predicted
    assert targets[0, 0].tolist() == [10, 11] and targets[1, 3].tolist() == [EOS, IGNORE]
    assert n_in.tolist() == [5, 4]


def test_a_prompt_keeps_its_last_whole_groups_right_aligned():
    prompt = torch.arange(20, 28)[None].repeat(2, 1)
    tokens, positions, valid, n_groups = ar_prompt_layout(prompt, torch.tensor([8, 6]), 3, False)
    # row 0: 8 frames = 2 whole groups after its first 2 frames; row 1: frames 0-5
    assert tokens[0].tolist() == [[22, 23, 24], [25, 26, 27]]
    assert tokens[1].tolist() == [[20, 21, 22], [23, 24, 25]]
    assert positions.tolist() == [[0, 1], [0, 1]] and valid.all() and n_groups.tolist() == [2, 2]

    tokens, positions, valid, n_groups = ar_prompt_layout(prompt, torch.tensor([8, 3]), 3, False)
    assert tokens[1, 1].tolist() == [20, 21, 22] and valid.tolist() == [[True, True], [False, True]]
    assert positions[1, 1] == 0 and n_groups.tolist() == [2, 1]

    tokens, positions, valid, _ = ar_prompt_layout(prompt, torch.tensor([8, 3]), 3, True)
    assert tokens[1].tolist() == [[EOS, EOS, EOS], [BOS, BOS, BOS], [20, 21, 22]]
    assert positions[1].tolist() == [0, 0, 1] and valid[1].tolist() == [False, True, True]
    with pytest.raises(ValueError, match="at least 3 prompt frame"):
        ar_prompt_layout(prompt, torch.tensor([8, 2]), 3, False)


def _overfit(group: int, bos: bool, frames: torch.Tensor, text: torch.Tensor):
    model = tiny_model(ar_group_size=group, ar_codebook_size=K, prepend_bos=bos,
                       num_decoder_layers=1, nhead=2, decoder_dim=48)  # fmt: skip
    opt = torch.optim.Adam([p for _, p in model.stage_parameters(1)], lr=1e-2)
    audio = frames[None, :, None].expand(1, -1, model.num_quantizers).clone()
    lens = torch.tensor([frames.shape[0]])
    text_lens = torch.tensor([text.shape[0]])
    model.train()
    for _ in range(150):
        loss, _ = model(text[None], text_lens, audio, lens, train_stage=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), audio, text_lens


@pytest.mark.parametrize("group,bos", [(2, False), (3, False), (2, True)])
def test_decoding_continues_what_training_taught_and_stops_mid_group(group, bos):
    """A model fitted to one utterance, prompted with its first groups, says the rest and
    stops exactly where it ended (13 frames: EOS falls inside a group for G = 2 and 3): a
    decoder that cut groups, numbered positions or placed EOS other than training did would
    not. The frames repeat one code after the random start, so only the positions say
    where the utterance ends."""
    g = torch.Generator().manual_seed(3)
    frames = torch.cat([torch.randint(0, K, (6,), generator=g), torch.full((7,), 9)])
    text = torch.randint(3, 40, (5,), generator=g)
    model, audio, text_lens = _overfit(group, bos, frames, text)
    p = 2 * group
    with torch.no_grad():
        for cache in (True, False):
            codes, lens = model.inference(
                text[None], text_lens, audio[:, :p], torch.tensor([p]), top_k=1, seed=0,
                max_len_ratio=6, use_kv_cache=cache, return_lens=True,
            )  # fmt: skip
            assert lens.tolist() == [13 - p]
            assert codes[0, :, 0].tolist() == frames[p:].tolist()


def _scripted_logits(group: int, step: dict):
    """Code 5 everywhere, EOS the most likely from frame 7 on; ``step`` counts frames."""

    def scripted(h, by_id=True):
        out = []
        for s in range(group):
            logits = torch.full((h.shape[0], NUM_AUDIO_TOKENS + 1), float("-inf"))
            logits[:, 5] = 0.0
            logits[:, EOS] = 1.0 if step["frame"] + s >= 7 else -1.0
            out.append(logits)
        step["frame"] += group
        return torch.stack(out, 1) if group > 1 else out[0]

    return scripted


@pytest.mark.parametrize("group", [1, 2, 3])
def test_eos_caps_and_floors_act_on_frames_not_groups(group):
    """Scripted logits: the row stops at frame 7 (mid-group for G = 2 and 3); a floor of 9
    frames moves it to 9; a cap of 5 frames cuts it at 5."""
    model = tiny_model(ar_group_size=group, ar_codebook_size=K).eval()
    step = {"frame": 0}
    model.ar_logits = _scripted_logits(group, step)
    batch = make_batch()
    text, text_lens = batch["text_tokens"][:1], torch.tensor([6])
    prompt = batch["audio_features"][:1, :6, 0] % K

    def decode(max_len_ratio, min_lens=None):
        step["frame"] = 0
        options = DecodeOptions(top_k=1, seed=0, max_len_ratio=max_len_ratio)
        return ar_generate(
            model, text, text_lens, prompt, torch.tensor([6]), options, want_scores=True,
            min_lens=min_lens,
        )

    gen, lens, scores, ended = decode(max_len_ratio=4)
    assert lens.tolist() == [7] and ended.tolist() == [True]
    assert gen[0].tolist() == [5] * 7
    # the mean log-probability counts 7 frames of code 5 and the EOS that ended the row
    per = torch.log_softmax(torch.tensor([0.0, -1.0]), 0)[0]
    last = torch.log_softmax(torch.tensor([0.0, 1.0]), 0)[1]
    torch.testing.assert_close(scores, ((7 * per + last) / 8).reshape(1))
    _, lens, _, _ = decode(max_len_ratio=4, min_lens=torch.tensor([9]))
    assert lens.tolist() == [9]
    _, lens, _, _ = decode(max_len_ratio=1.5)
    assert lens.tolist() == [7]  # the cap (9 frames) is after EOS
    _, lens, _, ended = decode(max_len_ratio=0.84)  # a cap of 5 frames
    assert lens.tolist() == [5] and ended.tolist() == [False]


def _ar_columns_and_frames(group: int, batch: dict) -> tuple[int, int]:
    """(audio columns the AR decoder saw, frames its loss counted) for one training batch."""
    model = tiny_model(ar_group_size=group).train()
    seen = {}
    original = model.ar_core

    def spy(x, text_valid, y, audio_valid, **kw):
        seen["audio_columns"] = y.shape[1]
        return original(x, text_valid, y, audio_valid, **kw)

    model.ar_core = spy
    _, metrics = run(model, batch, train_stage=1)
    return seen["audio_columns"], int(metrics["ar_frames"])


def test_grouping_makes_the_ar_sequence_shorter_and_trains_every_frame():
    batch = make_batch()
    plain, grouped = _ar_columns_and_frames(1, batch), _ar_columns_and_frames(2, batch)
    t_max = int(batch["audio_features_lens"].max())
    assert plain[0] == t_max and grouped[0] == t_max // 2
    # G = 1 predicts frames 1..T and EOS; G = 2 frames 2..T and EOS (its first group is given)
    assert grouped[1] == plain[1] - len(batch["audio_features_lens"])


def test_checkpoints_keep_it_and_older_ones_mean_1():
    model = tiny_model(ar_group_size=2, tie_ar_head=True)
    assert model.hparams["ar_group_size"] == 2
    rebuilt = get_model(ours_hparams(model.hparams, model.state_dict()))
    rebuilt.load_state_dict(model.state_dict())
    old = {k: v for k, v in tiny_model().hparams.items() if k != "ar_group_size"}
    assert get_model(ours_hparams(old, {})).ar_group_size == 1
    with pytest.raises(ValueError, match="--ar-group-size"):
        tiny_model(ar_group_size=0)

"""Decoding options: stop rule, per-row empty rows, best-of-N, NAR text for prefix modes 2/4,
positions, head tying, reduced precision."""

from __future__ import annotations

import pytest
import torch
from models_testlib import Q, make_batch, tiny_model

from valle.models import NUM_AUDIO_TOKENS, PrefixMode, generation
from valle.models.embedding import SinePositionalEncoding
from valle.models.generation import ARResult, DecodeOptions, ar_generate
from valle.models.layout import nar_text


def _prompt(b, lens=(6, 3, 2, 5)):
    return b["audio_features"][:, : max(lens)], torch.tensor(lens)


def _eos_likely_model():
    """EOS is the most likely token at every step (logit ~3.8) but has only ~4% of the mass."""
    model = tiny_model("valle", 1).eval()
    with torch.no_grad():
        model.ar_predict_layer.weight.mul_(0.01)
        model.ar_decoder.final_norm.bias.fill_(1.0)
        model.ar_predict_layer.weight[NUM_AUDIO_TOKENS] = 0.12
    return model


def test_stop_rule_argmax_or_sampled():
    model, b = _eos_likely_model(), make_batch()
    prompt, plens = _prompt(b)
    args = (b["text_tokens"], b["text_tokens_lens"], prompt, plens)
    # lifeiteng's rule: EOS is the argmax, so every row stops at once (nothing to say).
    _, lens = model.inference(*args, seed=0, on_empty="mark", return_lens=True)
    assert lens.tolist() == [0, 0, 0, 0]
    # Only when sampled: rows run for a while.
    _, lens = model.inference(*args, seed=0, stop_rule="sampled", on_empty="mark",
                              max_len_ratio=4, return_lens=True)  # fmt: skip
    assert (lens > 0).sum() >= 3


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_min_len_ratio_holds_eos_back_per_row(num_candidates):
    """EOS is the argmax everywhere; with a floor each row runs exactly to its own floor
    (frames per token of the text to say: prompt transcript, BOS and EOS not counted)."""
    model, b = _eos_likely_model(), make_batch()
    prompt, plens = _prompt(b)
    text_lens = b["text_tokens_lens"]
    prompt_text_lens = torch.tensor([2, 0, 0, 1])  # text lens (7, 5, 3, 6)
    to_say = text_lens - 2 - prompt_text_lens
    _, lens = model.inference(b["text_tokens"], text_lens, prompt, plens, prompt_text_lens=prompt_text_lens,
                              seed=0, min_len_ratio=1.5, max_len_ratio=4, on_empty="mark",
                              num_candidates=num_candidates, return_lens=True)  # fmt: skip
    assert lens.tolist() == torch.floor(to_say * 1.5).long().tolist()
    assert len(set(lens.tolist())) > 1  # rows differ: the floor is per row
    # The length cap still wins over a floor above it.
    _, lens = model.inference(b["text_tokens"], text_lens, prompt, plens, seed=0, min_len_ratio=3,
                              max_len_ratio=1, on_empty="mark", return_lens=True)  # fmt: skip
    assert lens.tolist() == text_lens.tolist()


def test_one_empty_row_does_not_fail_the_batch():
    model, b = tiny_model("valle", 1).eval(), make_batch()
    prompt, plens = _prompt(b)
    original = model.ar_logits
    step = {"n": 0}

    def eos_first_for_row_2(h):
        logits = original(h)
        if step["n"] == 0:
            logits[2, NUM_AUDIO_TOKENS] = 1e4
        step["n"] += 1
        return logits

    model.ar_logits = eos_first_for_row_2
    args = (b["text_tokens"], b["text_tokens_lens"], prompt, plens)
    codes, lens = model.inference(
        *args, top_k=1, max_len_ratio=2, on_empty="mark", return_lens=True
    )
    assert lens[2] == 0 and bool((lens[[0, 1, 3]] > 0).all())
    assert (codes[2] == NUM_AUDIO_TOKENS).all()
    for r in (0, 1, 3):
        assert (codes[r, : lens[r]] < NUM_AUDIO_TOKENS).all()
    step["n"] = 0
    with pytest.raises(ValueError, match=r"EOS as the first token for batch row\(s\) \[2\]"):
        model.inference(*args, top_k=1, max_len_ratio=2)


def test_best_of_n_keeps_the_most_likely_candidate():
    model, b = tiny_model("valle", 1).eval(), make_batch()
    prompt, plens = _prompt(b)
    text, tlens = b["text_tokens"][:1, :7], b["text_tokens_lens"][:1]
    p0, pl = prompt[:1, :6], plens[:1]
    n, common = 4, dict(top_k=50, temperature=1.5, max_len_ratio=2.0, seed=3)
    codes, lens = model.inference(text, tlens, p0, pl, num_candidates=n, return_lens=True, **common)
    rep = lambda t: t.repeat_interleave(n, dim=0)  # noqa: E731
    gen, glens, scores, _ = ar_generate(
        model, rep(text), rep(tlens), rep(p0[..., 0]), rep(pl), DecodeOptions(**common),
        want_scores=True,
    )
    assert len({tuple(g[:k].tolist()) for g, k in zip(gen, glens)}) > 1  # candidates differ
    best = int(scores.argmax())
    assert int(lens[0]) == int(glens[best])
    assert torch.equal(codes[0, :, 0], gen[best, : int(glens[best])])
    # The score is the mean log-likelihood per frame, recomputed here by teacher forcing.
    k = int(glens[best])
    tokens = torch.cat([p0[0, :, 0], gen[best, :k]])[None]
    valid = torch.ones_like(tokens, dtype=torch.bool)
    x = model.ar_embed_text(text, torch.ones_like(text, dtype=torch.bool))
    h = model.ar_core(x, torch.ones_like(text, dtype=torch.bool),
                       model.ar_embed_audio(tokens, torch.arange(tokens.shape[1])), valid)  # fmt: skip
    logp = torch.log_softmax(model.ar_logits(h[0, 5:]), dim=-1)  # predicts frames 6.. and after
    targets = torch.cat([gen[best, :k], torch.tensor([NUM_AUDIO_TOKENS])])
    stopped_on_eos = k < 14  # the cap is 2 x 7 text tokens
    picked = logp[torch.arange(k + 1), targets][: k + int(stopped_on_eos)]
    torch.testing.assert_close(scores[best], picked.mean(), rtol=1e-4, atol=1e-4)


def test_ar_generate_says_which_rows_ended_on_eos():
    """EOS is the argmax everywhere: rows stop on EOS at once; held back (a fixed length),
    they end without it."""
    model, b = _eos_likely_model(), make_batch()
    prompt, plens = _prompt(b)
    args = (b["text_tokens"], b["text_tokens_lens"], prompt[..., 0], plens)
    common = dict(top_k=-100, top_p=1.0, temperature=1.0, max_len_ratio=4, use_kv_cache=True, seed=0)
    _, lens, _, ended_on_eos = ar_generate(model, *args, DecodeOptions(force_len=None, **common))
    assert lens.tolist() == [0, 0, 0, 0] and ended_on_eos.all()
    _, lens, _, ended_on_eos = ar_generate(model, *args, DecodeOptions(force_len=5, **common))
    assert lens.tolist() == [5, 5, 5, 5] and not ended_on_eos.any()


@pytest.mark.parametrize("all_capped", [False, True])
def test_best_of_n_passes_over_a_candidate_that_ran_to_the_cap(all_capped, monkeypatch):
    """A looping candidate that never emits EOS can be the most likely per frame; it is kept
    only when every candidate of its row ran to the length cap (then the most likely of them)."""
    model, b = tiny_model("valle", 1).eval(), make_batch()
    prompt, plens = _prompt(b)
    text, tlens = b["text_tokens"][:1, :7], torch.tensor([7])
    cap = 14  # 2 x 7 text tokens
    lens = torch.tensor([cap, cap, 5, 4]) if not all_capped else torch.tensor([cap, cap, cap, cap])
    ended_on_eos = lens < cap
    scores = torch.tensor([-0.1, -0.3, -2.0, -3.0])  # the capped ones are the most likely
    gen = torch.stack([torch.full((cap,), 10 + i) for i in range(4)])

    def fixed_candidates(*args, **kwargs):
        return ARResult(gen, lens, scores, ended_on_eos)

    monkeypatch.setattr(generation, "ar_generate", fixed_candidates)
    codes, out_lens = model.inference(text, tlens, prompt[:1, :6], plens[:1], num_candidates=4,
                                      max_len_ratio=2.0, return_lens=True)  # fmt: skip
    expected = 0 if all_capped else 2
    assert int(out_lens[0]) == int(lens[expected])
    assert bool((codes[0, : int(lens[expected]), 0] == 10 + expected).all())


def test_decoding_options_are_checked_and_repetition_aware_sampling_is_gone():
    with pytest.raises(ValueError, match="stop_rule must be one of"):
        DecodeOptions(stop_rule="never")
    with pytest.raises(ValueError, match="on_empty must be"):
        DecodeOptions(on_empty="skip")
    with pytest.raises(ValueError, match="--num-candidates must be >= 1"):
        DecodeOptions(num_candidates=0)
    # Removed (measured worse here): asking for it is an error, not a silent no-op.
    model, b = tiny_model("valle", 1).eval(), make_batch()
    prompt, plens = _prompt(b)
    with pytest.raises(TypeError, match="repetition_aware"):
        model.inference(b["text_tokens"], b["text_tokens_lens"], prompt, plens, repetition_aware=True)


def test_nar_text_drops_the_prompt_transcript_per_row():
    text = torch.tensor([[1, 10, 11, 12, 20, 21, 2], [1, 13, 22, 23, 24, 2, 0]])
    lens = torch.tensor([7, 6])
    for mode in (PrefixMode.RANDOM_SEGMENT, PrefixMode.OTHER_UTTERANCE):
        out, out_lens = nar_text(text, lens, torch.tensor([3, 1]), mode)
        assert out_lens.tolist() == [4, 5]
        assert out[0, :4].tolist() == [1, 20, 21, 2] and out[1, :5].tolist() == [1, 22, 23, 24, 2]
        with pytest.raises(ValueError, match=f"--prefix-mode {int(mode)} needs prompt_text_lens"):
            nar_text(text, lens, None, mode)
    for mode in (PrefixMode.NONE, PrefixMode.UTTERANCE_PREFIX):  # the whole text, as trained
        assert nar_text(text, lens, None, mode)[0] is text


def test_position_layouts_are_a_permutation():
    pos = torch.arange(5)
    inter = SinePositionalEncoding(8, interleaved=True).encoding(pos)
    concat = SinePositionalEncoding(8, interleaved=False).encoding(pos)
    assert torch.equal(inter[:, 0::2], concat[:, :4]) and torch.equal(inter[:, 1::2], concat[:, 4:])
    fixed = SinePositionalEncoding(8, learned_alpha=False)
    assert not list(fixed.parameters()) and "alpha" in fixed.state_dict()


@pytest.mark.parametrize("tie", ["lifeiteng", "same"])
def test_nar_head_tying(tie):
    model = tiny_model("valle", 1, nar_head_tie=tie)
    h = torch.randn(Q - 1, 3, model.nar_dim)
    stage = torch.arange(1, Q)
    logits = model.nar_head(h, stage)
    table = model.nar_audio_embedding[:, :NUM_AUDIO_TOKENS]
    for j in range(1, Q):
        if tie == "same":
            w = table[j] * model.nar_dim**-0.5
        else:
            w = table[j + 1] if j < Q - 1 else model.nar_predict_last
        torch.testing.assert_close(logits[j - 1], h[j - 1] @ w.T)
    names = {n for n, _ in model.named_parameters()}
    assert ("nar_predict_last" in names) == (tie == "lifeiteng")
    assert "ar_predict_layer.weight" in names  # --share-embedding leaves the AR head untied
    assert "ar_predict_layer.weight" not in {
        n for n, _ in tiny_model(tie_ar_head=True).named_parameters()
    }


def test_bfloat16_decoding_runs_in_bfloat16():
    model, b = tiny_model("valle", 1), make_batch()
    model = model.to(torch.bfloat16).eval()
    prompt, plens = _prompt(b)
    codes, lens = model.inference(b["text_tokens"], b["text_tokens_lens"], prompt, plens,
                                  top_k=1, force_len=8, return_lens=True)  # fmt: skip
    assert codes.shape == (4, 8, Q) and (codes < NUM_AUDIO_TOKENS).all()
    assert model.ar_text_embedding.weight.dtype == torch.bfloat16


def test_nearest_to_expectation_is_the_mmse_code():
    from valle.models.sampling import nearest_to_expectation

    vectors = torch.tensor([[4.0, 0.0], [-4.0, 0.0], [0.3, 0.0], [0.0, 9.0]])
    big = 20.0
    # Sure of code 1: the argmax.
    assert int(nearest_to_expectation(torch.tensor([0.0, big, 0.0, 0.0]), vectors)) == 1
    # Split between the two distant codes: their mean is near code 2, chosen although it is
    # the least likely; the argmax would add a vector 4 away from the truth half the time.
    split = torch.tensor([big, big, 0.0, 0.0])
    assert int(nearest_to_expectation(split, vectors)) == 2
    assert int(split[:4].argmax()) != 2
    # Logits beyond the table's rows (codes not in use, EOS) take no part.
    wide = torch.cat([split, torch.tensor([3 * big])])
    assert int(nearest_to_expectation(wide, vectors)) == 2
    # Batched over any leading shape; equals a brute-force expected squared error.
    logits = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0)) * 3
    picked = nearest_to_expectation(logits, vectors)
    p = logits.softmax(-1)
    cost = (p[..., None, :] * torch.cdist(vectors, vectors).pow(2)[None, None]).sum(-1)  # (3,5,K)
    assert picked.shape == (3, 5) and torch.equal(picked, cost.argmin(-1))


def _far_codes_but_3(width: int = NUM_AUDIO_TOKENS) -> list[torch.Tensor]:
    """Every code far from every other except code 3 at the origin: for any unsure
    distribution (no code above half the mass) the MMSE code is 3."""
    table = 10.0 * torch.eye(width)
    table[3] = 0.0
    return [table] * Q


def test_nar_mmse_decoding_reaches_codebooks_1_to_7_only():
    model, b = tiny_model("valle", 1).eval(), make_batch()
    sharp = model.nar_head
    model.nar_head = lambda h, stage: sharp(h, stage) * 0.01  # an unsure NAR (untrained: sure)
    prompt, plens = _prompt(b)
    args = (b["text_tokens"], b["text_tokens_lens"], prompt, plens)
    common = dict(top_k=5, max_len_ratio=2.0, seed=0, return_lens=True)
    plain, lens = model.inference(*args, **common)
    mmse, lens2 = model.inference(*args, code_vectors=_far_codes_but_3(), **common)
    assert torch.equal(lens, lens2) and torch.equal(plain[..., 0], mmse[..., 0])  # the AR untouched
    for r in range(4):
        n = int(lens[r])
        assert (mmse[r, :n, 1:] == 3).all()
        assert not (plain[r, :n, 1:] == 3).all()
    # The same choice after ground-truth codebook 0.
    cont = model.continual(b["text_tokens"], b["text_tokens_lens"], b["audio_features"],
                           b["audio_features_lens"], code_vectors=_far_codes_but_3())  # fmt: skip
    gen_lens = b["audio_features_lens"] - (b["audio_features_lens"] // 2).clamp(max=225)
    assert all((cont[r, : int(gen_lens[r]), 1:] == 3).all() for r in range(4))
    with pytest.raises(ValueError, match="code_vectors has 2 codebooks"):
        model.inference(*args, code_vectors=_far_codes_but_3()[:2], **common)

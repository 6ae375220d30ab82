"""VALL-E X: the language-ID embedding (--num-languages) in training and decoding."""

from __future__ import annotations

import pytest
import torch
from models_testlib import make_batch, run, tiny_model


def test_language_ids_condition_both_halves():
    model, b = tiny_model("valle", 1, num_languages=2), make_batch()
    with pytest.raises(ValueError, match="pass text_languages"):
        run(model, b, 0, torch.arange(4))
    seeds = torch.arange(4)
    rows = torch.tensor([0, 1, 1, 0])
    loss_rows, _ = model(b["text_tokens"], b["text_tokens_lens"], b["audio_features"],
                         b["audio_features_lens"], sample_seeds=seeds, text_languages=rows)  # fmt: skip
    per_token = rows[:, None].expand_as(b["text_tokens"])
    loss_tokens, _ = model(b["text_tokens"], b["text_tokens_lens"], b["audio_features"],
                           b["audio_features_lens"], sample_seeds=seeds, text_languages=per_token)  # fmt: skip
    torch.testing.assert_close(loss_rows, loss_tokens)
    for stage in (1, 2):  # each half has its own table and it matters
        other, _ = model(b["text_tokens"], b["text_tokens_lens"], b["audio_features"],
                         b["audio_features_lens"], train_stage=stage, sample_seeds=seeds,
                         text_languages=1 - rows)  # fmt: skip
        same, _ = model(b["text_tokens"], b["text_tokens_lens"], b["audio_features"],
                        b["audio_features_lens"], train_stage=stage, sample_seeds=seeds,
                        text_languages=rows)  # fmt: skip
        assert not torch.allclose(other, same)
    ar = {n for n, _ in model.stage_parameters(1)}
    nar = {n for n, _ in model.stage_parameters(2)}
    assert "ar_language_embedding.weight" in ar and "nar_language_embedding.weight" in nar
    with pytest.raises(ValueError, match=r"language ids must be in \[0, 2\)"):
        model(b["text_tokens"], b["text_tokens_lens"], b["audio_features"], b["audio_features_lens"],
              text_languages=torch.tensor([0, 2, 0, 0]))  # fmt: skip


def test_per_token_languages_at_inference_batch_equals_rows():
    model, b = tiny_model("valle", 4, num_languages=2).eval(), make_batch()
    prompt, plens = b["audio_features"][:, :6], torch.tensor([6, 3, 2, 5])
    ptl = torch.tensor([2, 1, 0, 3])
    cols = torch.arange(b["text_tokens"].shape[1])[None, :]
    langs = (cols > ptl[:, None]).long()  # prompt transcript in language 0, the text in 1
    kw = dict(top_k=1, force_len=6)
    batched = model.inference(b["text_tokens"], b["text_tokens_lens"], prompt, plens,
                              prompt_text_lens=ptl, text_languages=langs, **kw)  # fmt: skip
    for r in range(4):
        tl = int(b["text_tokens_lens"][r])
        single = model.inference(b["text_tokens"][r : r + 1, :tl], b["text_tokens_lens"][r : r + 1],
                                 prompt[r : r + 1, : plens[r]], prompt_text_lens=ptl[r : r + 1],
                                 text_languages=langs[r : r + 1, :tl], **kw)  # fmt: skip
        assert torch.equal(single, batched[r : r + 1]), r
    monolingual = model.inference(b["text_tokens"], b["text_tokens_lens"], prompt, plens,
                                  prompt_text_lens=ptl, text_languages=torch.zeros(4, dtype=torch.long),
                                  **kw)  # fmt: skip
    assert not torch.equal(monolingual, batched)

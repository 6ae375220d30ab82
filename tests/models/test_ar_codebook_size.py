"""--ar-codebook-size K: the AR predicts codebook 0's K codes and EOS (a K+1-wide head) while
EOS and padding stay id 1024 everywhere outside the AR."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models_testlib import make_batch, run, tiny_model

from valle.models import NUM_AUDIO_TOKENS, get_model, losses
from valle.models.convert import ours_hparams

K = 16


def _within_codebook(batch: dict) -> dict:
    """The batch with every code folded into 0..K-1 (padding, id 1024, kept)."""
    audio, prompt = batch["audio_features"], batch["prompt_features"]
    fold = lambda codes: torch.where(codes == NUM_AUDIO_TOKENS, codes, codes % K)  # noqa: E731
    return {**batch, "audio_features": fold(audio), "prompt_features": fold(prompt)}


def _rows(table: torch.Tensor, bos: bool) -> torch.Tensor:
    """Rows of a 1024-code AR table for codes 0..K-1, EOS (and BOS), in the small table's order."""
    keep = list(range(K)) + [NUM_AUDIO_TOKENS] + ([NUM_AUDIO_TOKENS + 1] if bos else [])
    return table[keep]


@pytest.mark.parametrize("variant", [{}, {"tie_ar_head": True}, {"prepend_bos": True}])
def test_the_small_head_is_the_full_head_restricted_to_the_codebook(variant, monkeypatch):
    """Same weights on the kept rows: the small model's AR loss is the full model's logits,
    restricted to codes 0..K-1 and EOS, under the cross entropy with EOS as class K."""
    full = tiny_model(**variant).train()
    small = tiny_model(ar_codebook_size=K, **variant).train()
    bos = bool(variant.get("prepend_bos"))
    state = full.state_dict()
    state["ar_audio_embedding.weight"] = _rows(state["ar_audio_embedding.weight"], bos)
    if "ar_predict_layer.weight" in state:
        state["ar_predict_layer.weight"] = _rows(state["ar_predict_layer.weight"], False)
    small.load_state_dict(state)
    assert small.ar_audio_embedding.weight.shape[0] == K + 1 + int(bos)

    captured = {}
    original = losses.loss_and_top10

    def capture(logits, targets):
        captured.update(logits=logits, targets=targets)
        return original(logits, targets)

    batch = _within_codebook(make_batch())
    _, metrics = run(small, batch, train_stage=1)
    monkeypatch.setattr(losses, "loss_and_top10", capture)  # the full model's AR loss only
    run(full, batch, train_stage=1)
    logits, targets = captured["logits"], captured["targets"]
    assert logits.shape[-1] == NUM_AUDIO_TOKENS + 1
    assert (targets == NUM_AUDIO_TOKENS).any()  # EOS targets are in the comparison
    restricted = torch.cat([logits[..., :K], logits[..., NUM_AUDIO_TOKENS:]], dim=-1)
    classes = torch.where(targets == NUM_AUDIO_TOKENS, K, targets)
    expected = F.cross_entropy(restricted.reshape(-1, K + 1), classes.reshape(-1), reduction="sum",
                               ignore_index=-100)  # fmt: skip
    torch.testing.assert_close(metrics["ar_loss"], expected, rtol=1e-5, atol=1e-4)


def test_decoding_yields_codes_of_the_codebook_and_eos_as_1024():
    model = tiny_model(ar_codebook_size=K).eval()
    with torch.no_grad():  # EOS likely enough that some rows stop before the cap
        model.ar_predict_layer.weight.mul_(0.01)
        model.ar_decoder.final_norm.bias.fill_(1.0)
        model.ar_predict_layer.weight[K] = 0.12
    batch = _within_codebook(make_batch())
    lens = torch.tensor([6, 3, 2, 5])
    prompt = batch["audio_features"][:, : int(lens.max())]
    h = torch.randn(2, 3, model.ar_dim)
    by_id = model.ar_logits(h)
    assert by_id.shape == (2, 3, NUM_AUDIO_TOKENS + 1)
    assert torch.isinf(by_id[..., K:NUM_AUDIO_TOKENS]).all()
    torch.testing.assert_close(by_id[..., NUM_AUDIO_TOKENS], model.ar_logits(h, by_id=False)[..., K])
    codes, out_lens = model.inference(
        batch["text_tokens"], batch["text_tokens_lens"], prompt, lens, seed=0, stop_rule="sampled",
        max_len_ratio=4, on_empty="mark", return_lens=True,
    )  # fmt: skip
    caps = (batch["text_tokens_lens"] * 4).tolist()
    assert out_lens.max() > 0 and any(n < cap for n, cap in zip(out_lens.tolist(), caps))
    for row, n in enumerate(out_lens.tolist()):
        assert (codes[row, :n, 0] < K).all()  # codebook 0 from the small head
        assert (codes[row, n:] == NUM_AUDIO_TOKENS).all()  # padding past the row's end


def test_checkpoints_keep_it_and_older_ones_mean_1024():
    model = tiny_model(ar_codebook_size=K)
    assert model.hparams["ar_codebook_size"] == K
    rebuilt = get_model(ours_hparams(model.hparams, model.state_dict()))
    rebuilt.load_state_dict(model.state_dict())  # same shapes
    old = {k: v for k, v in tiny_model().hparams.items() if k != "ar_codebook_size"}
    assert get_model(ours_hparams(old, {})).ar_codebook_size == NUM_AUDIO_TOKENS
    with pytest.raises(ValueError, match="--ar-codebook-size"):
        tiny_model(ar_codebook_size=0)

"""Fine-tuning Plachtaa/VALL-E-X's checkpoint: the training forward adds the language embeddings
exactly as Plachtaa's inference does (its logits, step by step, from tests/fixtures/vallex),
and ``--start-from vallex-checkpoint.pt --lora-rank N`` trains adapters on it.

Plachtaa's ``forward`` raises NotImplementedError (it ships no trainer): the reference is the
logits its ``inference`` computed at each step, recorded by the fixture script.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.scenarios import TINY_MODEL
from valle.models import get_model, losses
from valle.models.convert import load_model_checkpoint
from valle.models.lora import is_adapter_key
from valle.train.checkpoint import load_checkpoint
from valle.train.cli import parse_config
from valle.train.loop import train

pytestmark = pytest.mark.timeout(300)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vallex"
CASES = ("en_prompt_zh_text", "zh_prompt_mixed_text")


@pytest.fixture(scope="module")
def reference():
    state, hp = load_model_checkpoint(FIXTURE / "vallex_tiny.pt")
    model = get_model(hp).eval()
    model.load_state_dict(state)
    return model, hp, torch.load(FIXTURE / "expected.pt")


def _teacher_forced(model, hp, e, case, monkeypatch, train_stage, stage=None):
    """The logits the training forward computes on prompt + Plachtaa's codes, per-token
    languages as its inference adds them (the prompt's ids in the prompt's language)."""
    ref = e[case]
    ids = {lang: i for i, lang in enumerate(hp["languages"])}
    text, enroll = e["text"], e["enroll_x_lens"]
    said = ref["text_language"]
    said = [said] * (text.shape[1] - enroll) if isinstance(said, str) else said
    langs = torch.tensor([[ids[ref["prompt_language"]]] * enroll + [ids[x] for x in said]])
    audio = torch.cat([e["prompt"], ref["codes"]], dim=1)
    p = e["prompt"].shape[1]
    if stage is not None:  # the NAR's stage and its prompt: the prefix of Plachtaa's inference
        monkeypatch.setattr(losses, "randint_per_row", lambda u, lo, hi: torch.tensor([stage]))
        cols = torch.arange(audio.shape[1])[None, :]
        monkeypatch.setattr(losses, "nar_layout", lambda codes, lens, *a: (
            codes, torch.tensor([p]), lens, cols >= p))  # fmt: skip
    seen = []
    real = losses.loss_and_top10
    monkeypatch.setattr(losses, "loss_and_top10", lambda logits, t: seen.append(logits) or real(logits, t))
    model(text, torch.tensor([text.shape[1]]), audio, torch.tensor([audio.shape[1]]),
          train_stage=train_stage, text_languages=langs)  # fmt: skip
    return seen[0][0], p


@pytest.mark.parametrize("case", CASES)
def test_ar_training_logits_equal_plachtaa_inference(reference, case, monkeypatch):
    model, hp, e = reference
    logits, p = _teacher_forced(model, hp, e, case, monkeypatch, train_stage=1)
    # Plachtaa's first 6 decoding steps predict frames p..p+5
    torch.testing.assert_close(logits[p : p + 6], e[case]["ar_logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stage", [1, 4, 7])
def test_nar_training_logits_equal_plachtaa_inference(reference, case, stage, monkeypatch):
    model, hp, e = reference
    logits, p = _teacher_forced(model, hp, e, case, monkeypatch, train_stage=2, stage=stage)
    torch.testing.assert_close(logits[p : p + 6], e[case]["nar_logits"][stage - 1], rtol=1e-4, atol=1e-4)


def test_without_the_languages_the_logits_differ(reference, monkeypatch):
    # what forks that trained it did: the language embeddings left out
    model, hp, e = reference
    logits, p = _teacher_forced(model, hp, e, CASES[0], monkeypatch, train_stage=1)
    model.ar_language_embedding.weight.data, saved = (
        torch.zeros_like(model.ar_language_embedding.weight), model.ar_language_embedding.weight.data)
    try:
        without, _ = _teacher_forced(model, hp, e, CASES[0], monkeypatch, train_stage=1)
    finally:
        model.ar_language_embedding.weight.data = saved
    assert not torch.allclose(without[p : p + 6], e[CASES[0]]["ar_logits"], atol=1e-3)


def test_lora_on_the_vallex_checkpoint(tmp_path):
    base = FIXTURE / "vallex_tiny.pt"
    state, _ = load_model_checkpoint(base)
    summary = train(parse_config(TINY_MODEL + [
        "--exp-dir", str(tmp_path / "exp"), "--synthetic-data", "16", "--synthetic-batch-size", "8",
        "--num-epochs", "1", "--start-from", str(base),
        "--lora-rank", "16", "--optimizer-name", "AdamW", "--base-lr", "0.01", "--warmup-steps", "1",
        "--average-period", "0", "--log-interval", "1"]))  # fmt: skip
    assert summary.steps == 2
    for key, value in state.items():  # the base stays bit-identical
        assert torch.equal(summary.model_state[key], value.to(summary.model_state[key].dtype)), key
    saved = load_checkpoint(tmp_path / "exp" / "epoch-1.pt")
    assert saved["model"] and all(is_adapter_key(k) for k in saved["model"])
    assert saved["lora"]["config"]["lora_rank"] == 16
    # the checkpoint keeps what synthesis needs: the frontend and the language table
    assert saved["config"]["text_frontend"] == "vallex-bpe"
    assert saved["config"]["languages"] == ["en", "zh", "ja"]
    # base + adapters and the merged model speak alike, and both keep the frontend and languages
    from valle.infer import load_model, main

    adapters, merged_path = tmp_path / "exp" / "epoch-1.pt", tmp_path / "merged.pt"
    assert main(["--checkpoint", str(adapters), "--merge-lora", str(merged_path)]) == 0
    e = torch.load(FIXTURE / "expected.pt")
    langs = torch.tensor([[0] * 5 + [1] * 8])
    codes = []
    for path in (adapters, merged_path):
        model, config = load_model(path)
        assert config["text_frontend"] == "vallex-bpe" and config["languages"] == ["en", "zh", "ja"]
        codes.append(model.inference(e["text"], torch.tensor([13]), e["prompt"], text_languages=langs,
                                     top_k=1, max_len_ratio=2.0))  # fmt: skip
    assert torch.equal(codes[0], codes[1])
    base_model, _ = load_model(base)
    base_codes = base_model.inference(e["text"], torch.tensor([13]), e["prompt"], text_languages=langs,
                                      top_k=1, max_len_ratio=2.0)  # fmt: skip
    assert not torch.equal(base_codes, codes[0])  # the adapters changed something

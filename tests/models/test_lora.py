"""LoRA adapters (valle/models/lora.py): start equal to the base, train alone, merge exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from models_testlib import make_batch, run, tiny_model

from valle.models.lora import (
    LoraConfig,
    LoraError,
    apply_lora,
    base_fingerprint,
    base_state_dict,
    has_lora,
    load_lora_state_dict,
    lora_state_dict,
    merge_lora,
    trainable,
)

ALL_TARGETS = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_targets=("attn", "ffn", "embed", "head"))


def _randomise_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero adapters (a fresh B is zero, which would hide a wrong merge)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_state_dict(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("name", ["valle", "vall-f"])
def test_fresh_adapters_compute_what_the_base_computes(name):
    base = tiny_model(name, 1, tie_ar_head=False)
    adapted = copy.deepcopy(base)
    apply_lora(adapted, ALL_TARGETS)
    b, seeds = make_batch(), torch.tensor([3, 1, 4, 1])
    loss_base, _ = run(base.eval(), b, 0, seeds)
    loss_lora, _ = run(adapted.eval(), b, 0, seeds)
    assert torch.equal(loss_base, loss_lora)


def test_only_adapters_train_and_base_keys_are_unchanged():
    model = tiny_model("vall-f", 1, tie_ar_head=False)
    keys = set(model.state_dict())
    plan = apply_lora(model, LoraConfig(lora_rank=2, lora_targets=("attn", "ffn")))
    assert set(base_state_dict(model)) == keys
    named = trainable(model.stage_parameters(0))
    assert named and all(n.endswith((".lora_A", ".lora_B")) for n, _ in named)
    # the cross-attention's q_proj/kv_proj, the fused qkv and out_proj, and the FFN
    assert any(n.endswith("cross_attn.kv_proj") for n in plan.wrapped)
    assert any(n.endswith("self_attn.qkv_proj") for n in plan.wrapped)
    assert any(n.endswith("linear2") for n in plan.wrapped)
    assert not any("embedding" in n for n in plan.wrapped)
    # stage 1 trains the AR's adapters only
    assert all(n.startswith("ar_") for n, _ in trainable(model.stage_parameters(1)))


def test_a_training_step_changes_adapters_only_and_the_base_stays_bit_identical():
    model = tiny_model("valle", 1, tie_ar_head=False, dropout=0.1)
    apply_lora(model, LoraConfig(lora_rank=4, lora_dropout=0.1, lora_targets=("attn", "ffn", "embed")))
    base_before = base_fingerprint(model.state_dict())
    adapters_before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    opt = torch.optim.AdamW([p for _, p in trainable(model.stage_parameters(0))], lr=1e-2)
    for _ in range(3):
        loss, _ = run(model.train(), make_batch(), 0, torch.tensor([3, 1, 4, 1]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert base_fingerprint(model.state_dict()) == base_before
    assert all(p.grad is None for n, p in model.named_parameters() if not n.endswith(("lora_A", "lora_B")))
    changed = [k for k, v in lora_state_dict(model).items() if not torch.equal(v, adapters_before[k])]
    assert any(k.endswith("lora_B") for k in changed)


def test_tied_ar_head_table_is_not_adapted():
    model = tiny_model("valle", 1, tie_ar_head=True)
    plan = apply_lora(model, LoraConfig(lora_rank=2, lora_targets=("embed",)))
    assert "ar_audio_embedding" in plan.skipped
    assert "ar_text_embedding" in plan.wrapped


@pytest.mark.parametrize("name", ["valle", "vall-f"])
def test_merged_model_equals_the_unmerged_one(name):
    model = tiny_model(name, 1, tie_ar_head=False)
    apply_lora(model, ALL_TARGETS)
    _randomise_adapters(model)
    b, seeds = make_batch(), torch.tensor([3, 1, 4, 1])
    loss_lora, metrics_lora = run(model.eval(), b, 0, seeds)
    merged = merge_lora(copy.deepcopy(model))
    assert not has_lora(merged)
    assert set(merged.state_dict()) == set(base_state_dict(model))
    loss_merged, metrics_merged = run(merged.eval(), b, 0, seeds)
    torch.testing.assert_close(loss_merged, loss_lora, rtol=1e-5, atol=1e-4)
    # The merged weights differ from the base's: the adapters did something.
    assert base_fingerprint(merged.state_dict()) != base_fingerprint(model.state_dict())


def test_adapters_round_trip_and_a_wrong_rank_is_named():
    model = tiny_model("valle", 1, tie_ar_head=False)
    apply_lora(model, LoraConfig(lora_rank=4))
    _randomise_adapters(model)
    saved = lora_state_dict(model)
    other = tiny_model("valle", 1, tie_ar_head=False)
    apply_lora(other, LoraConfig(lora_rank=4))
    load_lora_state_dict(other, saved, "adapters.pt")
    assert all(torch.equal(v, lora_state_dict(other)[k]) for k, v in saved.items())
    wrong = tiny_model("valle", 1, tie_ar_head=False)
    apply_lora(wrong, LoraConfig(lora_rank=2))
    with pytest.raises(LoraError, match="adapters.pt.*lora-rank"):
        load_lora_state_dict(wrong, saved, "adapters.pt")
    fewer = tiny_model("valle", 1, tie_ar_head=False)
    apply_lora(fewer, LoraConfig(lora_rank=4, lora_targets=("attn",)))
    with pytest.raises(LoraError, match="adapters.pt.*unexpected"):
        load_lora_state_dict(fewer, saved, "adapters.pt")


def test_greedy_decoding_equal_merged_and_unmerged():
    model = tiny_model("valle", 1, tie_ar_head=False)
    apply_lora(model, ALL_TARGETS)
    _randomise_adapters(model, seed=3)
    merged = merge_lora(copy.deepcopy(model)).eval()
    model.eval()
    b = make_batch()
    prompt, plens = b["audio_features"][:2, :6], torch.tensor([6, 6])
    args = (b["text_tokens"][:2], b["text_tokens_lens"][:2], prompt, plens)
    out_lora = model.inference(*args, top_k=1, seed=0, max_len_ratio=2)
    out_merged = merged.inference(*args, top_k=1, seed=0, max_len_ratio=2)
    assert torch.equal(out_lora, out_merged)


def test_config_checks_name_the_flag():
    with pytest.raises(ValueError, match="--lora-targets"):
        LoraConfig(lora_rank=2, lora_targets=("attn", "conv")).check()
    with pytest.raises(ValueError, match="--lora-dropout"):
        LoraConfig(lora_rank=2, lora_dropout=1.0).check()
    with pytest.raises(LoraError, match="already"):
        model = tiny_model()
        apply_lora(model, LoraConfig(lora_rank=2))
        apply_lora(model, LoraConfig(lora_rank=2))

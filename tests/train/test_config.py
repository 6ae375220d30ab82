"""The config tree (valle/train/config.py): what a checkpoint records of the flags, and the
decoding options of --valid-samples-decode, parsed once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from valle.models.generation import DecodeOptions
from valle.train.cli import parse_config
from valle.train.config import parse_decode_flags

ROOT = Path(__file__).resolve().parents[2]
# Written at a5fee66 from the hand-written parsers: plain_args() of these flags.
BEFORE = json.loads((ROOT / "tests" / "fixtures" / "cli" / "trainer-config.json").read_text())


def test_checkpoint_config_keeps_every_key_and_value_of_before():
    config = parse_config(BEFORE["argv"]).checkpoint_config()
    expected = dict(BEFORE["config"])
    # The one difference: the model's name as ModelConfig reads it (it always lowercased it).
    assert expected.pop("model_name") == "VALLE" and config.pop("model_name") == "valle"
    # Flags added since, new keys at their defaults: --max-duration auto (issue #39), LoRA
    # fine-tuning (issue #41), --max-failed-saves (issue #51), --add-language (issue #47).
    added = {"memory_budget_gb": 0.0, "memory_headroom": -1.0, "activation_checkpointing": False,
             "lora_rank": 0, "lora_alpha": 16.0, "lora_dropout": 0.0, "lora_targets": ["attn", "ffn"],
             "max_failed_saves": 3, "add_language": "", "add_language_init": "mean"}
    assert {k: config.pop(k) for k in added} == added
    assert config == expected
    json.dumps(config)  # plain types only


def test_checkpoint_config_records_what_the_data_source_resolved(tmp_path):
    cfg = parse_config(["--synthetic-data", "4", "--max-text-tokens", "auto"])
    cfg.data.max_text_tokens, cfg.data.text_tokens = 120, tmp_path / "t.k2symbols"
    cfg.data.languages = ["en-us", "de"]
    cfg.corpus_record["audio_codec"] = {"codec": "encodec"}
    config = cfg.checkpoint_config()
    assert config["max_text_tokens"] == 120 and config["text_tokens"] == str(tmp_path / "t.k2symbols")
    assert config["languages"] == ["en-us", "de"] and config["audio_codec"] == {"codec": "encodec"}


def test_sub_configs_are_typed():
    cfg = parse_config(["--synthetic-data", "4", "--decoder-dim", "64", "--max-duration", "7",
                        "--no-shuffle", "--prefix-mode", "4"])
    assert cfg.model.decoder_dim == 64 and int(cfg.model.prefix_mode) == 4
    assert cfg.data.max_duration == 7.0 and cfg.data.shuffle is False
    assert isinstance(cfg.data.manifest_dir, Path)


def test_valid_samples_decode_is_parsed_once_with_bin_infer_defaults():
    assert parse_decode_flags("") == DecodeOptions(seed=42)  # bin/infer.py seeds with 42
    options = parse_decode_flags("--top-k 3 --num-candidates 4 --nar-decoding mmse --seed 1 "
                                 "--stop-rule sampled --static-cache")
    assert options == DecodeOptions(top_k=3, num_candidates=4, nar_decoding="mmse", seed=1,
                                    stop_rule="sampled", static_cache=True)
    cfg = parse_config(["--synthetic-data", "4", "--valid-samples-decode", "--top-p 0.5"])
    assert cfg.valid_samples_decoding == DecodeOptions(top_p=0.5, seed=42)
    assert cfg.checkpoint_config()["valid_samples_decode"] == "--top-p 0.5"  # as given


@pytest.mark.parametrize("text, why", [
    ("--top-k three", "invalid int value"),
    ("--min-len-ratio 20", "--min-len-ratio must be in"),
    ("--num-candidates 0", "--num-candidates must be >= 1"),
    ("--batch-size 2", "not a decoding flag of bin/infer.py: --batch-size 2"),
])
def test_bad_valid_samples_decode_names_the_flag(text, why):
    with pytest.raises(ValueError, match="--valid-samples-decode") as e:
        parse_decode_flags(text)
    assert why in str(e.value)


def test_the_run_builds_its_optimizer_from_the_configs_recipe(tmp_path):
    """The optimizer settings without a flag live in cfg.optimizer_recipe, and the run uses
    them (not build_optimizer's defaults)."""
    import torch

    from tests.support.scenarios import TINY_MODEL
    from valle.train.build import build_run
    from valle.train.dist import DistContext
    from valle.train.optim import OptimizerRecipe

    cfg = parse_config(TINY_MODEL + ["--exp-dir", str(tmp_path), "--synthetic-data", "8",
                                     "--optimizer-name", "AdamW"])
    assert cfg.optimizer_recipe == OptimizerRecipe()
    cfg.optimizer_recipe = OptimizerRecipe(betas=(0.5, 0.6), eps=1e-6)
    run = build_run(cfg, DistContext(device=torch.device("cpu")))
    group = run.optimizer.param_groups[0]
    assert tuple(group["betas"]) == (0.5, 0.6) and group["eps"] == 1e-6

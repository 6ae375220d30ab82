"""ModelConfig: one list of fields makes the flags, the checkpoint hparams and their way back;
--prefix-mode is an enum with int flags and hparams; removed options still load when off."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from models_testlib import tiny_model

from valle.models import (
    MODEL_DEFAULTS,
    TRAINING_HPARAMS,
    ModelConfig,
    PrefixMode,
    add_model_arguments,
    get_model,
    model_hparams,
)
from valle.models.convert import CheckpointError, load_model_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return parser


def test_every_field_is_one_flag_with_its_default():
    parser = _parser()
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    assert sorted(flags) == sorted(names) == sorted(MODEL_DEFAULTS)
    defaults = vars(parser.parse_args([]))
    assert defaults == MODEL_DEFAULTS == ModelConfig().hparams()
    assert TRAINING_HPARAMS == {
        "guided_attention_weight", "guided_attention_sigma", "guided_attention_heads",
        "guided_attention_layers",
    }  # fmt: skip


def test_flags_hparams_and_config_round_trip():
    argv = ("--model-name VALL-F --decoder-dim 48 --nhead 3 --num-decoder-layers 2 "
            "--scale-factor 0.5 --norm-first false --add-prenet true --prefix-mode 4 "
            "--share-embedding false --prepend-bos true --num-quantizers 3 --num-text-tokens 60 "
            "--dropout 0.25 --tie-ar-head true --nar-head-tie same --positions concatenated "
            "--nar-position-scale learned --num-languages 2 --guided-attention-weight 0.5 "
            "--guided-attention-sigma 0.3 --guided-attention-heads 1 --guided-attention-layers 1 "
            "--ar-codebook-size 200 --ar-group-size 2").split()  # fmt: skip
    args = _parser().parse_args(argv)
    config = ModelConfig.from_params(args)
    hp = config.hparams()
    assert hp == model_hparams(args) and ModelConfig.from_params(hp) == config
    assert ModelConfig.from_params(argparse.Namespace(**hp)) == config
    assert hp["model_name"] == "vall-f" and hp["norm_first"] is False and hp["dropout"] == 0.25
    assert all(v == MODEL_DEFAULTS[k] for k, v in ModelConfig.from_params({}).hparams().items())
    # Checkpoints store strings as often as values: both parse by the field's type.
    as_text = ModelConfig.from_params({k: str(v) for k, v in hp.items()})
    assert as_text == config


def test_prefix_mode_is_an_enum_with_int_flags_and_hparams():
    assert [int(m) for m in PrefixMode] == [0, 1, 2, 4]
    args = _parser().parse_args(["--prefix-mode", "4"])
    assert type(args.prefix_mode) is int and args.prefix_mode == 4
    config = ModelConfig.from_params(args)
    assert config.prefix_mode is PrefixMode.OTHER_UTTERANCE
    hp = config.hparams()
    assert type(hp["prefix_mode"]) is int and hp["prefix_mode"] == 4
    model = tiny_model(prefix_mode=2)
    assert model.prefix_mode is PrefixMode.RANDOM_SEGMENT
    assert type(model.hparams["prefix_mode"]) is int
    assert PrefixMode.parse("other_utterance") is PrefixMode.OTHER_UTTERANCE
    assert PrefixMode.parse("1") is PrefixMode.UTTERANCE_PREFIX
    with pytest.raises(SystemExit):
        _parser().parse_args(["--prefix-mode", "3"])
    with pytest.raises(ValueError, match="--prefix-mode must be 0, 1, 2 or 4, got 3"):
        tiny_model(prefix_mode=3)


def test_experimental_options_have_their_own_group():
    parser = _parser()
    group = next(g for g in parser._action_groups if g.title == "model (experimental)")
    assert [a.dest for a in group._group_actions] == ["ar_group_size"]
    assert "experimental" in group._group_actions[0].help


def _save(tmp_path, model, **config_extra):
    path = tmp_path / "old.pt"
    torch.save({"model": model.state_dict(), "config": {**model.hparams, **config_extra}}, path)
    return path


def test_removed_options_load_when_off_and_are_named_when_on(tmp_path):
    model = tiny_model()
    # Checkpoints written before the removal carry paired_prompts (and the trainer's other
    # flags, such as an old run's decoding options): off, they still load.
    path = _save(tmp_path, model, paired_prompts=False, repetition_aware=False, ras_window=10)
    state, hp = load_model_checkpoint(path)
    rebuilt = get_model(hp)
    rebuilt.load_state_dict(state)
    assert "paired_prompts" not in hp and rebuilt.hparams == model.hparams
    on = _save(tmp_path, model, paired_prompts=True)
    with pytest.raises(CheckpointError, match="old.pt.*--paired-prompts True is no longer supported"):
        load_model_checkpoint(on)
    with pytest.raises(ValueError, match="--paired-prompts"):
        get_model({**model.hparams, "paired_prompts": "true"})
    with pytest.raises(SystemExit):
        _parser().parse_args(["--paired-prompts", "false"])


def test_a_model_takes_a_config_or_keywords_not_both():
    config = ModelConfig(decoder_dim=16, nhead=2, num_decoder_layers=1, num_quantizers=2)
    from valle.models import VALLE

    by_config, by_keywords = VALLE(config), VALLE(**config.hparams())
    shapes = lambda m: {k: v.shape for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(by_config) == shapes(by_keywords)
    with pytest.raises(TypeError, match="not both"):
        VALLE(config, decoder_dim=32)

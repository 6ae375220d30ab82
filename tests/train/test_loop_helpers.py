"""Small pieces of the training loop and its config, tested alone."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from valle.train.cli import parse_config
from valle.train.config import TrainConfig
from valle.train.loop import GRAD_SCALE_COLLAPSED, grad_scale, grad_scale_just_collapsed


class FakeScaler:
    def __init__(self, scale: float, enabled: bool = True):
        self.scale, self.enabled = scale, enabled

    def get_scale(self) -> float:
        return self.scale

    def is_enabled(self) -> bool:
        return self.enabled


def fake_run(scaler) -> SimpleNamespace:
    return SimpleNamespace(scaler=scaler, scale_warned=False, step=7)


def test_a_collapsed_grad_scale_is_reported_once(caplog):
    run = fake_run(FakeScaler(GRAD_SCALE_COLLAPSED / 10))
    with caplog.at_level(logging.WARNING, logger="valle.train.loop"):
        assert grad_scale_just_collapsed(run)
        assert not grad_scale_just_collapsed(run)  # the checkpoint is saved once per run
    assert run.scale_warned
    assert [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()] == [
        "grad scale collapsed to 1e-05 at step 7: saving a checkpoint; consider --dtype "
        "bfloat16 or a lower --base-lr"]


@pytest.mark.parametrize("scaler", [None, FakeScaler(1e-9, enabled=False),
                                    FakeScaler(GRAD_SCALE_COLLAPSED)])
def test_no_scaler_or_a_healthy_scale_is_not_collapsed(scaler):
    run = fake_run(scaler)
    assert not grad_scale_just_collapsed(run) and not run.scale_warned
    assert grad_scale(run) == (scaler.scale if scaler and scaler.enabled else None)


def test_the_flags_defaults_are_the_config_defaults():
    cfg = parse_config(["--synthetic-data", "1"])
    parsed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)}
    defaults = {f.name: getattr(TrainConfig(), f.name) for f in dataclasses.fields(TrainConfig)}
    for name in ("synthetic_data", "corpus_record"):
        parsed.pop(name), defaults.pop(name)
    assert parsed == defaults

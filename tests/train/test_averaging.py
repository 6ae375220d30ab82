"""Tests for valle.train.averaging.ModelAverager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from valle.train.averaging import ModelAverager


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ar = nn.Linear(3, 2)
        self.nar = nn.Linear(2, 2)
        self.register_buffer("counter", torch.tensor(7))


def _ar_params(m: _Net):
    return [(n, p) for n, p in m.named_parameters() if n.startswith("ar.")]


def _set_all(m: _Net, value: float) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)


def test_update_follows_icefall_rule_against_hand_computation():
    m = _Net()
    avg = ModelAverager(_ar_params(m), average_period=2)
    values = {}
    for step in range(1, 9):
        _set_all(m, float(step))  # the "trained" value after `step` steps
        values[step] = float(step)
        updated = avg.update(step)
        assert updated == (step % 2 == 0)
    # Hand computation of the rule: w = period / step at steps 2, 4, 6, 8.
    expected = 0.0
    for s in (2, 4, 6, 8):
        w = 2 / s
        expected = expected * (1 - w) + values[s] * w
    # = mean of the values at steps 2, 4, 6, 8 = 5.0
    assert expected == pytest.approx(5.0)
    for t in avg.tensors():
        torch.testing.assert_close(t, torch.full_like(t, expected))
        assert t.dtype == torch.float32
    assert avg.last_step == 8


def test_update_is_in_place_and_covers_only_given_params():
    m = _Net()
    avg = ModelAverager(_ar_params(m), average_period=1)
    ptrs = [t.data_ptr() for t in avg.tensors()]
    _set_all(m, 3.0)
    avg.update(1)
    _set_all(m, 5.0)
    avg.update(2)
    assert [t.data_ptr() for t in avg.tensors()] == ptrs
    sd = avg.averaged_state_dict(m)
    assert set(sd) == set(m.state_dict())
    torch.testing.assert_close(sd["ar.weight"], torch.full((2, 3), 4.0))
    # Not averaged: the model's current values and buffers.
    torch.testing.assert_close(sd["nar.weight"], torch.full((2, 2), 5.0))
    assert sd["counter"].item() == 7


def test_bf16_params_averaged_in_fp32():
    m = _Net().to(torch.bfloat16)
    avg = ModelAverager(_ar_params(m), average_period=1)
    _set_all(m, 1.0)
    avg.update(1)
    _set_all(m, 2.0)
    avg.update(2)
    _set_all(m, 2.0)
    avg.update(3)  # mean(1, 2, 2) = 5/3, not representable in bf16
    t = avg.tensors()[0]
    assert t.dtype == torch.float32
    torch.testing.assert_close(t, torch.full_like(t, 5.0 / 3.0))
    assert avg.averaged_state_dict(m)["ar.weight"].dtype == torch.bfloat16


def test_state_dict_round_trip_and_copy_to():
    m = _Net()
    avg = ModelAverager(_ar_params(m), average_period=3)
    for step in range(1, 10):
        _set_all(m, float(step) ** 0.5)
        avg.update(step)
    state = avg.state_dict()
    m2 = _Net()
    avg2 = ModelAverager(_ar_params(m2), average_period=3)
    avg2.load_state_dict(state)
    for a, b in zip(avg.tensors(), avg2.tensors()):
        assert torch.equal(a, b)
    assert avg2.last_step == 9
    # Continue both identically.
    for step in range(10, 13):
        _set_all(m, 1.0)
        _set_all(m2, 1.0)
        avg.update(step)
        avg2.update(step)
    for a, b in zip(avg.tensors(), avg2.tensors()):
        assert torch.equal(a, b)
    avg2.copy_to(m2)
    torch.testing.assert_close(m2.ar.weight, avg.tensors()[0])
    torch.testing.assert_close(m2.nar.weight, torch.ones(2, 2))


def test_load_from_model_state_dict_and_mismatch():
    m = _Net()
    _set_all(m, 2.5)
    full = m.state_dict()
    m2 = _Net()
    avg = ModelAverager(_ar_params(m2), average_period=1)
    assert avg.load_from_model_state_dict(full) == []
    torch.testing.assert_close(avg.tensors()[0], torch.full((2, 3), 2.5))
    with pytest.raises(KeyError):
        avg.load_from_model_state_dict({"ar.weight": full["ar.weight"]})
    bad = dict(full, **{"ar.bias": torch.zeros(5)})
    with pytest.raises(ValueError):
        avg.load_from_model_state_dict(bad)


def test_wrapped_model_keys_matched_by_identity():
    m = _Net()
    wrapper = nn.Module()
    wrapper.module = m
    avg = ModelAverager(_ar_params(m), average_period=1)
    _set_all(m, 4.0)
    avg.update(1)
    _set_all(m, 0.0)
    sd = avg.averaged_state_dict(wrapper)
    torch.testing.assert_close(sd["module.ar.weight"], torch.full((2, 3), 4.0))
    torch.testing.assert_close(sd["module.nar.weight"], torch.zeros(2, 2))


def test_rejects_bad_period():
    with pytest.raises(ValueError):
        ModelAverager(_ar_params(_Net()), average_period=0)

"""The multi-tensor (foreach/fused) optimizer paths compute what the per-parameter
reference computes, within float tolerance, over several steps (size updates, a
clipping-threshold re-estimate, a parameter without gradient, scalars, several
chunks), and resume after an OOM part-way through a step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.train.scaled_adam_reference import ReferenceScaledAdam
from valle.train.optim import Adam, ScaledAdam
from valle.train.resilience.faults import FaultInjector, parse_fault


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.gain = nn.Parameter(torch.tensor(0.7))  # a scalar: plain Adam in ScaledAdam
        self.unused = nn.Parameter(torch.randn(4, 2))  # never gets a gradient


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for name, p in model.named_parameters():
        if name != "unused":
            p.grad = torch.randn(p.shape, generator=g) * (3.0 if step == 5 else 1.0)


def _scaled_adam(model: nn.Module, foreach: bool) -> ScaledAdam:
    """foreach: the chunked product path; else the per-parameter reference."""
    kind = ScaledAdam if foreach else ReferenceScaledAdam
    return kind(list(model.named_parameters()), lr=0.05, clipping_scale=2.0,
                clipping_update_period=4, size_update_period=2,
                chunk_mb=1e-4)  # tiny chunks: several per step


def _assert_same_state(m1, o1, m2, o2, **tol) -> None:
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, msg=name, **tol)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        s1, s2 = o1.state[p1], o2.state[p2]
        assert s1.keys() == s2.keys()
        for key in s1:
            a, b = s1[key], s2[key]
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, msg=key, equal_nan=True, **tol)
            else:
                assert a == b, key


def test_scaled_adam_foreach_equals_the_per_parameter_loop():
    loop_model, foreach_model = _net(), _net()
    loop, foreach = _scaled_adam(loop_model, False), _scaled_adam(foreach_model, True)
    assert len(foreach._units(list(foreach_model.parameters()))) > 2
    for step in range(9):  # size updates at steps 1, 3, 5, 7; threshold at 4 and 8
        _grads(loop_model, step)
        _grads(foreach_model, step)
        loop.step()
        foreach.step()
    assert foreach.clipping_stats()["num_clipped"].item() > 0  # clipping took part
    _assert_same_state(loop_model, loop, foreach_model, foreach, rtol=1e-5, atol=1e-6)


def test_scaled_adam_foreach_ignores_a_nonfinite_gradient_like_the_loop():
    loop_model, foreach_model = _net(), _net()
    loop, foreach = _scaled_adam(loop_model, False), _scaled_adam(foreach_model, True)
    for step in range(3):
        for m, o in ((loop_model, loop), (foreach_model, foreach)):
            _grads(m, step)
            if step == 1:
                m.a.weight.grad[0, 0] = float("inf")
            o.step()
    assert foreach.clipping_stats()["clip_factor"].item() > 0
    assert all(torch.isfinite(p).all() for p in foreach_model.parameters())
    _assert_same_state(loop_model, loop, foreach_model, foreach, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nth", [3, 30, 60, 100, 150])
def test_scaled_adam_foreach_resumes_in_the_middle_of_a_step(nth):
    clean_model, model = _net(), _net()
    clean, opt = _scaled_adam(clean_model, True), _scaled_adam(model, True)
    for step in range(5):
        _grads(clean_model, step)
        clean.step()
    faults = FaultInjector([parse_fault(f"alloc@3:{nth}")], 0)
    units_done = []
    faults.start()
    try:
        for step in range(5):
            _grads(model, step)
            faults.phases.begin_attempt(step, 0)
            try:
                opt.step()
            except torch.OutOfMemoryError:
                assert step == 3 and opt.resuming
                units_done.append(opt.progress.unit)
                opt.step()  # finish where it stopped
    finally:
        faults.stop()
    assert faults.fired and len(units_done) == 1
    if nth >= 60:
        assert units_done[0] > 0  # some chunks were committed before the OOM
    _assert_same_state(clean_model, clean, model, opt, rtol=0, atol=0)


@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_adam_equals_the_foreach_adam(decoupled):
    if not Adam.fused_supported(torch.device("cpu")):
        pytest.skip("this torch has no fused Adam kernel on CPU")
    models = [_net(), _net()]
    opts = [Adam(list(m.parameters()), lr=0.01, betas=(0.9, 0.95), weight_decay=0.05,
                 decoupled=decoupled, chunk_mb=1e-4, fused=fused)
            for m, fused in zip(models, (False, True))]
    for step in range(6):
        for m, o in zip(models, opts):
            _grads(m, step)
            o.step()
    _assert_same_state(models[0], opts[0], models[1], opts[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipped, and not
def test_scale_and_clip_equals_scaling_then_clipping(max_norm):
    from valle.train.optim import scale_and_clip_

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    params = [nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads):
        p.grad = t * 0.01  # scaled first, then clipped by torch
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    reference = [p.grad for p in params]
    for given_norms in (None, torch._foreach_norm(grads)):  # the norms reused, or computed
        ours = [t.clone() for t in grads]
        total = scale_and_clip_(ours, 0.01, max_norm, norms=given_norms)
        torch.testing.assert_close(total, torch.linalg.vector_norm(torch.cat(
            [t.reshape(-1) * 0.01 for t in grads])))
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

"""Updates are transactions: an OOM at any allocation inside step() leaves each
parameter updated or untouched, and calling step() again gives exactly the
clean result (ScaledAdam, Adam/AdamW); our Adam/AdamW compute torch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.train.scaled_adam_reference import ReferenceScaledAdam
from valle.train.optim import Adam, ScaledAdam, build_optimizer
from valle.train.resilience.faults import FaultInjector, parse_fault


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.LayerNorm(3))


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _make(name: str, model: nn.Module):
    # "<name>-loop": the per-parameter reference ScaledAdam (tests/train); "<name>-foreach": Adam without the
    # fused kernel. The plain names take the default (foreach ScaledAdam, fused Adam).
    name, _, variant = name.partition("-")
    if name == "ScaledAdam":
        # A short clipping period so the threshold update runs inside the steps too.
        kind = ReferenceScaledAdam if variant == "loop" else ScaledAdam
        return kind(list(model.named_parameters()), lr=0.05, clipping_scale=2.0,
                    clipping_update_period=2, size_update_period=2, chunk_mb=1e-4)
    opt = build_optimizer(name, list(model.named_parameters()), base_lr=0.05, weight_decay=0.1)
    opt.chunk_bytes = 100  # several chunks per step: an OOM can land between commits
    if variant == "foreach":
        opt.fused = False
    return opt


def _state(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        out += [v.clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                for _, v in sorted(s.items())]
    return out


def _allocations_of_one_step(name: str) -> int:
    model = _model()
    opt = _make(name, model)
    for step in range(3):
        _grads(model, step)
        opt.step()
    counter = FaultInjector([], 0)
    counter.count_allocations()
    counter.phases.begin_attempt(3, 0)
    counter.start()
    try:
        _grads(model, 3)
        opt.step()
    finally:
        counter.stop()
    return len(counter.census[3]) - sum(1 for _ in model.parameters())  # minus the grads


@pytest.mark.parametrize("name", ["ScaledAdam", "ScaledAdam-loop", "AdamW", "AdamW-foreach",
                                  "Adam", "Adam-foreach"])
def test_an_oom_at_any_allocation_of_step_then_a_retry_equals_a_clean_step(name):
    clean_model = _model()
    clean = _make(name, clean_model)
    for step in range(5):
        _grads(clean_model, step)
        clean.step()
    expected = _state(clean_model, clean)
    total = _allocations_of_one_step(name)
    # The fused Adam kernel allocates nothing: only its step counts (one per chunk) can
    # fail, each before its chunk's in-place update.
    assert total >= (1 if name in ("AdamW", "Adam") else 8)
    # Fail every allocation of step 3 in turn (after the gradients were made).
    grads_allocations = sum(1 for _ in clean_model.parameters())
    for n in range(1, total + 1):
        model = _model()
        opt = _make(name, model)
        faults = FaultInjector([parse_fault(f"alloc@3:{n + grads_allocations}")], 0)
        faults.start()
        try:
            for step in range(5):
                faults.phases.begin_attempt(step, 0)
                _grads(model, step)
                try:
                    opt.step()
                except torch.OutOfMemoryError:
                    assert step == 3 and opt.resuming
                    opt.step()  # finish where it stopped
        finally:
            faults.stop()
        assert faults.fired, n
        for a, b in zip(_state(model, opt), expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"allocation {n}")


@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_computes_what_torch_computes(decoupled):
    ours_model, torch_model = _model(), _model()
    ours = Adam(list(ours_model.parameters()), lr=0.01, betas=(0.9, 0.95), weight_decay=0.05,
                decoupled=decoupled, chunk_mb=1e-4)  # tiny chunks: several per step
    reference = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        torch_model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.05)
    for step in range(6):
        _grads(ours_model, step)
        _grads(torch_model, step)
        ours.step()
        reference.step()
    for a, b in zip(ours_model.parameters(), torch_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

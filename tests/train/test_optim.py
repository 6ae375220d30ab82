"""Tests for valle.train.optim: ScaledAdam, clipping, schedules, factories."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from valle.train.optim import ScaledAdam, build_optimizer, clip_grad_norm_
from valle.train.schedulers import CosineScheduler, Eden, NoamScheduler, build_scheduler


def _regression_data(seed: int = 0, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 4, generator=g)
    y = torch.tanh(x @ w) + 0.5
    return x, y


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    # A scalar parameter exercises ScaledAdam's plain-Adam branch.
    m.register_parameter("gain", nn.Parameter(torch.tensor(1.0)))
    return m


def _forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * m.gain


def _loss(m, x, y):
    return ((_forward(m, x) - y) ** 2).mean()


def _train(m, opt, sched=None, steps=150, seed=0):
    x, y = _regression_data(seed)
    first = _loss(m, x, y).item()
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        _loss(m, x, y).backward()
        opt.step()
        if sched is not None:
            sched.step_batch(step + 1)
    return first, _loss(m, x, y).item()


def test_scaled_adam_decreases_loss():
    m = _model()
    opt = build_optimizer("ScaledAdam", list(m.named_parameters()), base_lr=0.05)
    sched = build_scheduler("Eden", opt, warmup_steps=10, lr_batches=100, lr_epochs=4)
    first, last = _train(m, opt, sched)
    assert last < 0.2 * first, (first, last)


@pytest.mark.parametrize("sched_name", ["Noam", "Cosine"])
@pytest.mark.parametrize("opt_name", ["AdamW", "Adam"])
def test_adam_family_with_schedules_decreases_loss(opt_name, sched_name):
    m = _model()
    opt = build_optimizer(opt_name, list(m.named_parameters()), base_lr=0.02)
    sched = build_scheduler(sched_name, opt, warmup_steps=10, total_steps=150)
    first, last = _train(m, opt, sched)
    assert last < 0.2 * first, (first, last)


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad.copy_(g)


def _random_grads(params, gen, scale=1.0):
    return [torch.randn(p.shape, generator=gen) * scale for p in params]


def test_scaled_adam_state_dict_round_trip_gives_identical_steps():
    m1 = _model()
    params1 = list(m1.parameters())
    for p in params1:
        p.grad = torch.zeros_like(p)
    opt1 = ScaledAdam(list(m1.named_parameters()), lr=0.03, clipping_scale=2.0, clipping_update_period=8)
    gen = torch.Generator().manual_seed(1)
    for _ in range(13):  # past a size update and a threshold estimate
        _set_grads(params1, _random_grads(params1, gen))
        opt1.step()

    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)

    m2 = _model(seed=5)  # different init: everything must come from the checkpoint
    m2.load_state_dict(saved["model"])
    params2 = list(m2.parameters())
    for p in params2:
        p.grad = torch.zeros_like(p)
    opt2 = ScaledAdam(list(m2.named_parameters()), lr=0.03, clipping_scale=2.0, clipping_update_period=8)
    opt2.load_state_dict(saved["opt"])

    for i in range(6):
        grads = _random_grads(params1, gen, scale=10.0 if i == 3 else 1.0)  # one clipped step
        _set_grads(params1, grads)
        _set_grads(params2, grads)
        opt1.step()
        opt2.step()
    for a, b in zip(params1, params2):
        assert torch.equal(a, b)
    s1, s2 = opt1.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        assert s1[k].keys() == s2[k].keys()
        for key in s1[k]:
            v1, v2 = s1[k][key], s2[k][key]
            if isinstance(v1, torch.Tensor):
                assert v1.dtype == v2.dtype and torch.equal(v1, v2), key
            else:
                assert v1 == v2, key


def _flat_grad_views(params):
    """Make every p.grad a view into one flat buffer, as the trainer does."""
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


@pytest.mark.parametrize("name,clipping_scale", [("ScaledAdam", 2.0), ("ScaledAdam", None), ("AdamW", None)])
def test_grads_stay_the_same_views_and_match_ordinary_grads(name, clipping_scale):
    m_view, m_plain = _model(), _model()
    p_view, p_plain = list(m_view.parameters()), list(m_plain.parameters())
    flat = _flat_grad_views(p_view)
    ids = [id(p.grad) for p in p_view]
    ptrs = [p.grad.data_ptr() for p in p_view]
    kw = {"clipping_scale": clipping_scale, "clipping_update_period": 4} if name == "ScaledAdam" else {}
    opt_view = build_optimizer(name, list(m_view.named_parameters()), base_lr=0.03, **kw)
    opt_plain = build_optimizer(name, list(m_plain.named_parameters()), base_lr=0.03, **kw)
    x, y = _regression_data()
    for _ in range(12):
        flat.zero_()
        _loss(m_view, x, y).backward()
        opt_plain.zero_grad()
        _loss(m_plain, x, y).backward()
        before = flat.clone()
        opt_view.step()
        opt_plain.step()
        # Same tensor objects, same storage, and (ScaledAdam/AdamW) contents untouched.
        assert [id(p.grad) for p in p_view] == ids
        assert [p.grad.data_ptr() for p in p_view] == ptrs
        assert torch.equal(flat, before)
    for a, b in zip(p_view, p_plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_scaled_adam_clipping_matches_reference():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7) * 0.1), nn.Parameter(torch.tensor(0.5))]
    flat = _flat_grad_views(params)
    period, scale, scalar_lr_scale = 4, 2.0, 0.1
    opt = ScaledAdam(params, lr=0.01, clipping_scale=scale, clipping_update_period=period,
                     scalar_lr_scale=scalar_lr_scale)
    gen = torch.Generator().manual_seed(3)
    history = []
    for step in range(8):
        # Step 6 has a gradient 50x larger than usual: it must be clipped.
        flat.copy_(torch.randn(flat.shape, generator=gen) * (50.0 if step == 6 else 1.0))
        rms = [opt.state[p]["param_rms"].clone() if opt.state[p] else p.detach().pow(2).mean().sqrt()
               for p in params[:2]]
        norm = math.sqrt(
            sum((p.grad.norm() * r).item() ** 2 for p, r in zip(params[:2], rms))
            + (params[2].grad.abs().item() * scalar_lr_scale) ** 2
        )
        history.append(norm)
        opt.step()
        stats = opt.clipping_stats()
        assert stats["grad_norm"].item() == pytest.approx(norm, rel=1e-5)
        if step < period:
            # No threshold before the first estimate at step == period.
            assert stats["clip_factor"].item() == 1.0
        else:
            # Estimated at step == period from the norms of steps 1..period
            # (step 0's slot was overwritten), then held until step 2*period.
            window = sorted(history[1 : period + 1])
            threshold = scale * window[(len(window) - 1) // 2]
            expected = min(1.0, threshold / norm)
            assert stats["clip_threshold"].item() == pytest.approx(threshold, rel=1e-5)
            assert stats["clip_factor"].item() == pytest.approx(expected, rel=1e-5)
            if step == 6:
                assert expected < 0.2  # the 50x step was clipped
    assert opt.clipping_stats()["num_clipped"].item() >= 1


def test_scaled_adam_clipped_step_equals_prescaled_gradient_step():
    """The clipping factor is applied to the gradient the update uses."""
    torch.manual_seed(0)
    base = [torch.randn(6, 4), torch.randn(4)]
    p_clip = [nn.Parameter(t.clone()) for t in base]
    p_ref = [nn.Parameter(t.clone()) for t in base]
    flat_clip, flat_ref = _flat_grad_views(p_clip), _flat_grad_views(p_ref)
    opt_clip = ScaledAdam(p_clip, lr=0.01, clipping_scale=1.0, clipping_update_period=2)
    opt_ref = ScaledAdam(p_ref, lr=0.01, clipping_scale=None)
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        g = torch.randn(flat_clip.shape, generator=gen) * (20.0 if step == 4 else 1.0)
        flat_clip.copy_(g)
        opt_clip.step()
        factor = opt_clip.clipping_stats()["clip_factor"]
        flat_ref.copy_(g * factor)
        opt_ref.step()
    assert factor.item() < 0.5
    for a, b in zip(p_clip, p_ref):
        torch.testing.assert_close(a, b)


def test_scaled_adam_nonfinite_grad_is_ignored_without_sync():
    params = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))]
    flat = _flat_grad_views(params)
    opt = ScaledAdam(params, lr=0.01, clipping_scale=2.0)
    flat.normal_()
    opt.step()
    flat.normal_()
    flat[3] = float("inf")
    opt.step()
    assert opt.clipping_stats()["clip_factor"].item() == 0.0
    assert all(torch.isfinite(p).all() for p in params)
    for p in params:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1 and v is not opt.state[params[0]].get("model_norms"):
                assert torch.isfinite(v).all()


def test_scaled_adam_state_created_for_params_without_grad():
    m = _model()
    opt = ScaledAdam(list(m.named_parameters()), lr=0.01)
    x, y = _regression_data()
    (m(x) - y).pow(2).mean().backward()  # m.gain gets no gradient
    assert m.gain.grad is None
    opt.step()
    assert all(len(opt.state[p]) > 0 for p in m.parameters())
    assert m.gain.grad is None  # never assigned


def test_scaled_adam_with_grad_scaler():
    m_amp, m_ref = _model(), _model()
    opt_amp = ScaledAdam(list(m_amp.named_parameters()), lr=0.03, clipping_scale=2.0)
    opt_ref = ScaledAdam(list(m_ref.named_parameters()), lr=0.03, clipping_scale=2.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = _regression_data()
    for _ in range(5):
        opt_amp.zero_grad()
        scaler.scale(_loss(m_amp, x, y)).backward()
        scaler.unscale_(opt_amp)
        scaler.step(opt_amp)
        scaler.update()
        opt_ref.zero_grad()
        _loss(m_ref, x, y).backward()
        opt_ref.step()
    for a, b in zip(m_amp.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # An overflowing step is skipped by the scaler.
    before = [p.detach().clone() for p in m_amp.parameters()]
    opt_amp.zero_grad()
    scaler.scale(_loss(m_amp, x, y) * float("inf")).backward()
    scaler.unscale_(opt_amp)
    scaler.step(opt_amp)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, m_amp.parameters()))


def test_clip_grad_norm_matches_torch_and_keeps_views():
    m1, m2 = _model(), _model()
    p1, p2 = list(m1.parameters()), list(m2.parameters())
    flat = _flat_grad_views(p1)
    ptrs = [p.grad.data_ptr() for p in p1]
    x, y = _regression_data()
    (100 * _loss(m1, x, y)).backward()
    (100 * _loss(m2, x, y)).backward()
    norm = clip_grad_norm_(p1, max_norm=0.5)
    ref = torch.nn.utils.clip_grad_norm_(p2, max_norm=0.5)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    torch.testing.assert_close(norm, ref)
    assert norm.item() > 0.5  # the test clips for real
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a.grad, b.grad)
    assert [p.grad.data_ptr() for p in p1] == ptrs
    torch.testing.assert_close(flat.norm(), torch.tensor(0.5), rtol=1e-4, atol=1e-6)


def _opt(lr=1.0):
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)


def test_eden_values():
    opt = _opt(0.05)
    s = Eden(opt, lr_batches=100, lr_epochs=4, warmup_batches=10, warmup_start=0.5)
    assert s.get_last_lr()[0] == pytest.approx(0.05 * 0.5)  # batch 0: warm-up start
    s.step_batch(5)
    f5 = ((25 + 100**2) / 100**2) ** -0.25
    assert s.get_last_lr()[0] == pytest.approx(0.05 * f5 * 0.75)
    s.step_batch(100)
    s.step_epoch(4)
    assert s.get_last_lr()[0] == pytest.approx(0.05 * 2**-0.25 * 2**-0.25)
    assert opt.param_groups[0]["lr"] == s.get_last_lr()[0]


def test_noam_values():
    opt = _opt(1e-3)
    s = NoamScheduler(opt, warmup_steps=100)
    assert s.get_last_lr()[0] == pytest.approx(1e-3 / 100)
    s.step_batch(99)  # the 100th step: peak
    assert s.get_last_lr()[0] == pytest.approx(1e-3)
    s.step_batch(399)
    assert s.get_last_lr()[0] == pytest.approx(0.5e-3)
    s2 = NoamScheduler(_opt(0.05), warmup_steps=100, model_dim=256)
    s2.step_batch(399)
    assert s2.get_last_lr()[0] == pytest.approx(0.05 * 256**-0.5 * 400**-0.5)


def test_cosine_values():
    opt = _opt(1.0)
    s = CosineScheduler(opt, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert s.get_last_lr()[0] == pytest.approx(0.1)
    s.step_batch(9)
    assert s.get_last_lr()[0] == pytest.approx(1.0)
    s.step_batch(59)  # halfway through the decay
    assert s.get_last_lr()[0] == pytest.approx(0.1 + 0.9 * 0.5)
    s.step_batch(109)
    assert s.get_last_lr()[0] == pytest.approx(0.1)
    s.step_batch(500)
    assert s.get_last_lr()[0] == pytest.approx(0.1)


@pytest.mark.parametrize("name", ["Eden", "Noam", "Cosine"])
def test_scheduler_state_dict_round_trip(name):
    opt1 = _opt(0.1)
    s1 = build_scheduler(name, opt1, warmup_steps=20, total_steps=200)
    s1.step_epoch(2)
    s1.step_batch(37)
    state = copy.deepcopy(s1.state_dict())
    opt2 = _opt(0.1)
    s2 = build_scheduler(name, opt2, warmup_steps=20, total_steps=200)
    s2.load_state_dict(state)
    assert s2.get_last_lr() == s1.get_last_lr()
    assert opt2.param_groups[0]["lr"] == opt1.param_groups[0]["lr"]
    s1.step_batch(38)
    s2.step_batch(38)
    assert s2.get_last_lr() == s1.get_last_lr()


def test_factories_reject_unknown_names():
    m = _model()
    with pytest.raises(ValueError):
        build_optimizer("SGD", list(m.named_parameters()), base_lr=0.1)
    with pytest.raises(ValueError):
        build_optimizer("Adam", [], base_lr=0.1)
    opt = _opt()
    with pytest.raises(ValueError):
        build_scheduler("Step", opt, warmup_steps=1)
    with pytest.raises(ValueError):
        build_scheduler("Cosine", opt, warmup_steps=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sync detection needs CUDA")
def test_no_host_sync_in_step_on_cuda():
    dev = torch.device("cuda")
    from valle.train.averaging import ModelAverager

    for name in ("ScaledAdam", "AdamW"):
        m = _model().to(dev)
        params = list(m.parameters())
        flat = torch.zeros(sum(p.numel() for p in params), device=dev)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        opt = build_optimizer(name, list(m.named_parameters()), base_lr=0.01,
                              clipping_update_period=4)
        avg = ModelAverager(list(m.named_parameters()), average_period=2)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(1, 13):  # covers state init, size updates, threshold estimates
                flat.normal_()
                if name != "ScaledAdam":
                    clip_grad_norm_(params, 1.0)
                opt.step()
                avg.update(step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(torch.isfinite(p).all() for p in params)

"""Single-rank paths of the OOM machinery: the backward reserve is held exactly
around the NAR forward, reports read memory before it is freed, a lone cut is
retried before quarantine, and OOMs that are not the data's stop the run."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.support.scenarios import TINY_MODEL
from valle.train.cli import parse_config
from valle.train.dist import DistContext
from valle.train.optim import build_optimizer
from valle.train.resilience import guard as guard_module
from valle.train.resilience import step as step_module
from valle.train.resilience.faults import InjectedOutOfMemoryError
from valle.train.resilience.gradsync import LocalGradSync
from valle.train.resilience.quarantine import OomPolicy
from valle.train.resilience.step import ResilientStep, StepConfig
from valle.train.synthetic import SyntheticCorpus, SyntheticSpec, collate

pytestmark = pytest.mark.timeout(120)


def _stepper(tmp_path, reserve_mb: int = 0, **cfg) -> ResilientStep:
    from valle.models import get_model

    config = parse_config(TINY_MODEL + ["--exp-dir", str(tmp_path), "--synthetic-data", "8"])
    torch.manual_seed(0)
    model = get_model(config.model)
    named = model.stage_parameters(0)
    optimizer = build_optimizer("ScaledAdam", named, 0.01)
    sync = LocalGradSync([p for _, p in named])
    return ResilientStep(model, optimizer, sync, DistContext(),
                         StepConfig(backward_reserve_mb=reserve_mb, **cfg))


def _batch(n: int = 4, seed: int = 1):
    return collate(SyntheticCorpus(SyntheticSpec(num_cuts=n, seed=seed)).cuts)


def test_the_reserve_is_held_around_the_nar_forward_only_and_released_on_every_path(tmp_path):
    stepper = _stepper(tmp_path, reserve_mb=1)
    model, reserve = stepper.model, stepper.reserve
    seen: list[tuple[str, bool]] = []
    fail_nar = {"armed": False}

    def spy(name):
        def hook(module, args, output):
            seen.append((name, reserve.is_held))
            if name == "nar" and fail_nar["armed"]:
                fail_nar["armed"] = False
                raise InjectedOutOfMemoryError("out of memory inside the NAR forward")
        return hook

    model.ar_decoder.register_forward_hook(spy("ar"))
    model.nar_decoder.register_forward_hook(spy("nar"))
    model.nar_decoder.register_full_backward_hook(
        lambda module, gi, go: seen.append(("nar backward", reserve.is_held)))

    result = stepper.run(0, _batch())
    assert result.applied and not reserve.is_held
    assert seen == [("ar", False), ("nar", True), ("nar backward", False)]
    assert reserve.holds == 1

    seen.clear()
    fail_nar["armed"] = True  # an OOM while the reserve is held: released, step retried
    result = stepper.run(1, _batch(seed=2))
    assert result.applied and result.ooms == 1 and not reserve.is_held
    # held by the failed attempt, then by its retry (as it was: the failure was transient)
    assert ("nar", True) in seen and reserve.holds == 3

    seen.clear()
    stepper.validate([_batch(seed=3)])  # no backward follows: no reserve
    assert seen == [("ar", False), ("nar", False)] and reserve.holds == 3

    seen.clear()
    stepper.trial(_batch(seed=4))  # the scan runs exactly as training does
    assert seen == [("ar", False), ("nar", True), ("nar backward", False)]
    assert not reserve.is_held and reserve.holds == 4


def test_a_report_reads_memory_at_the_failure_before_anything_is_freed(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(guard_module, "memory_figures",
                        lambda device: calls.append("figures") or {"allocated": 123})
    monkeypatch.setattr(guard_module, "free_memory", lambda device: calls.append("free"))
    stepper = _stepper(tmp_path)

    def fail():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    failure = stepper.guard.run(0, fail)
    assert calls == ["figures", "free"]
    assert failure.memory == {"allocated": 123}
    assert stepper.guard.reporter.events[0].memory == failure.memory


def test_a_lone_cut_that_fails_once_is_trained_not_quarantined(tmp_path, monkeypatch):
    stepper = _stepper(tmp_path)
    batch = _batch(n=1)
    failures = {"left": 1}
    original = step_module.forward_loss

    def flaky_forward(model, micro, settings, step):
        if failures["left"]:
            failures["left"] -= 1
            raise InjectedOutOfMemoryError("transient")
        return original(model, micro, settings, step)

    monkeypatch.setattr(step_module, "forward_loss", flaky_forward)
    result = stepper.run(0, batch)
    assert result.applied and result.cuts_trained == batch["cut_ids"]
    assert result.cuts_quarantined == [] and len(stepper.quarantine) == 0 and result.ooms == 1


def test_policy_stops_when_ooms_are_not_the_datas():
    policy = OomPolicy(max_quarantined=100, max_fitted_before=1)
    policy.begin_step()
    assert not policy.quarantine_now("a") and policy.quarantine_now("a")
    policy.note_trained([500, 300], [80, 40])
    assert policy.fitted_before_here(400, 50) and not policy.fitted_before_here(600, 10)
    policy.note_quarantined([{"fitted_before": True}])
    assert policy.verdict() is None
    policy.note_quarantined([{"fitted_before": True}])
    assert "larger cuts had trained before" in policy.verdict()
    piled = OomPolicy(max_quarantined=2)
    piled.note_quarantined([{}, {}, {}])
    assert "3 cuts quarantined" in piled.verdict()


def test_a_gpu_that_fails_every_cut_stops_with_exit_15_and_says_why(tmp_path, caplog):
    """Cuts failing alone although larger ones trained: the GPU, not the data."""
    from valle.train.loop import EXIT_CODES, main_from_config

    corpus = SyntheticCorpus(SyntheticSpec(num_cuts=12, seed=42))
    sizes = {c["id"]: (len(c["codes"]), len(c["text"])) for c in corpus.cuts}
    largest = max(sizes, key=lambda c: sizes[c][0] + sizes[c][1])
    small = [c for c in sizes if c != largest
             and sizes[c][0] <= sizes[largest][0] and sizes[c][1] <= sizes[largest][1]]
    assert len(small) >= 3
    faults = [x for c in small for x in ("--inject-fault", f"forward@cut={c}")]
    cfg = parse_config(TINY_MODEL + ["--exp-dir", str(tmp_path), "--synthetic-data", "12",
                                     "--synthetic-batch-size", "1", "--num-epochs", "1",
                                     "--synthetic-partition", "rows",
                                     "--max-fitted-before-quarantines", "2", *faults])
    # Train the largest cut first so every later failure is "fitted before".
    from valle.train import synthetic

    original = synthetic.SyntheticSampler._order
    synthetic.SyntheticSampler._order = lambda self: sorted(
        range(len(self.corpus)), key=lambda i: self.corpus.cuts[i]["id"] != largest)
    try:
        with caplog.at_level(logging.ERROR):
            code = main_from_config(cfg)
    finally:
        synthetic.SyntheticSampler._order = original
    assert code == EXIT_CODES["OomNotDataError"] == 15
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "The GPU, not the data, is the problem" in text
    quarantined = [json.loads(x) for x in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert len(quarantined) == 3 and all(q["fitted_before"] for q in quarantined)


def test_a_half_done_scaler_step_is_forgotten_after_a_reset():
    from valle.train.resilience.repair import reset_scaler_stage

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((p * 2).sum()).backward()
    scaler.unscale_(opt)  # ... and then an OOM before step()/update()
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(opt)
    reset_scaler_stage(scaler)
    opt.zero_grad()  # the repaired rank's next attempt computes its gradient afresh
    scaler.scale((p * 2).sum()).backward()
    scaler.unscale_(opt)  # ... and its update starts clean
    scaler.step(opt)
    scaler.update()
    assert torch.allclose(p.detach(), torch.full((3,), 1 - 0.1 * 2))


# Allocation failures that arrive as other exception types. The first is what the NAR backward
# raised on a fragmented H200 pool without the reserve (`make gpu-check`, docs/benchmarks.md).
GPU_OOMS = [
    torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                           "reported at some other API call"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
]


@pytest.mark.parametrize("phase", ["nar forward", "nar backward"])
@pytest.mark.parametrize("error", GPU_OOMS, ids=["AcceleratorError", "cuBLAS"])
def test_ooms_that_are_not_OutOfMemoryError_are_recovered_and_other_errors_are_not(tmp_path, phase, error):
    stepper = _stepper(tmp_path, reserve_mb=1)
    armed = {"error": error}

    def raise_once(*_):
        if armed["error"] is not None:
            exc, armed["error"] = armed["error"], None
            raise exc

    if phase == "nar forward":
        stepper.model.nar_decoder.register_forward_hook(raise_once)
    else:
        stepper.model.nar_decoder.register_full_backward_hook(raise_once)
    result = stepper.run(0, _batch())
    assert result.applied and result.ooms == 1 and not stepper.reserve.is_held
    assert result.cuts_quarantined == [] and len(result.cuts_trained) == 4
    # A CUDA error that is not about memory is not retried: it stops the run.
    armed["error"] = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        stepper.run(1, _batch(seed=2))

"""The CPU memory meter: live bytes per storage, peaks, and a budget it enforces as a device would."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from tests.support.scenarios import TINY_MODEL
from valle.train.resilience.meter import CensusMeter, build_meter, rounded

pytestmark = pytest.mark.timeout(300)


def test_a_storage_counts_once_and_is_taken_off_when_it_dies():
    meter = CensusMeter()
    with meter.active():
        x = torch.zeros(1000)  # 4000 bytes, rounded up to 4096 as CUDA's allocator does
        assert meter.live_bytes() == rounded(4000) == 4096
        view = x.view(10, 100)
        y = x.add_(1)  # in place: no new storage
        assert meter.live_bytes() == 4096
        del x, y
        assert meter.live_bytes() == 4096  # the view keeps the storage alive
        del view
        assert meter.live_bytes() == 0
        assert meter.peak_bytes() == 4096
        meter.reset_peak()
        assert meter.peak_bytes() == 0


def test_only_the_window_is_counted_and_tracked_tensors_count_from_the_start():
    model = torch.nn.Linear(64, 64)
    meter = CensusMeter()
    meter.track(model.parameters())
    assert meter.live_bytes() == rounded(64 * 64 * 4) + rounded(64 * 4)
    outside = torch.zeros(10_000)
    assert meter.live_bytes() == rounded(64 * 64 * 4) + rounded(64 * 4)
    del outside


def test_a_budget_is_enforced_and_a_failed_backward_pins_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    meter = CensusMeter(budget_bytes=600_000, enforce=True)
    meter.track(model.parameters())
    before = meter.live_bytes()

    def step(rows: int) -> None:
        model(torch.randn(rows, 128)).relu().sum().backward()

    with meter.active():
        step(8)  # fits
        assert meter.peak_bytes() <= 600_000
        for p in model.parameters():
            p.grad = None
        with pytest.raises(torch.OutOfMemoryError, match="--memory-budget-gb"):
            step(512)
        for p in model.parameters():
            p.grad = None
        torch.ones(1, requires_grad=True).sum().backward()  # the engine lets go of its buffers
        gc.collect()
        assert meter.live_bytes() == before
        assert meter.peak_bytes() <= 600_000  # the failing allocation was never counted


def test_cpu_meter_has_no_budget_unless_given():
    assert build_meter(torch.device("cpu"), 0.0).budget_bytes == 0
    meter = build_meter(torch.device("cpu"), 0.5)
    assert meter.budget_bytes == 1 << 29 and meter.enforce


def test_the_scan_prints_real_peaks_on_cpu(tmp_path, caplog):
    from valle.train.build import build_run
    from valle.train.cli import parse_config
    from valle.train.dist import init_distributed
    from valle.train.resilience.scan import scan_pessimistic_batches

    cfg = parse_config(TINY_MODEL + ["--exp-dir", str(tmp_path), "--synthetic-data", "16",
                                     "--synthetic-batch-size", "4"])
    run = build_run(cfg, init_distributed("cpu"))
    with caplog.at_level(logging.INFO):
        rows = scan_pessimistic_batches(run.stepper, run.data.pessimistic_batches(), cfg)
    parameters = sum(p.numel() * 4 for p in run.model.parameters())
    # The peak holds the parameters, optimizer state, gradients and activations.
    assert all(r.peak_bytes > 2 * parameters for r in rows)
    assert "n/a (CPU)" not in caplog.text and " MiB" in caplog.text

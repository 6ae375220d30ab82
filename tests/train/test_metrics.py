"""Tests for valle.train.metrics."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from valle.train.metrics import (
    MetricsTracker,
    TensorBoardLogger,
    ThroughputMeter,
    format_duration,
    plot_loss_curve,
    setup_logging,
)


def _rank_metrics(rank: int) -> MetricsTracker:
    t = MetricsTracker()
    # Tensors and Python numbers mixed, as the trainer accumulates them.
    t.add("loss", torch.tensor(10.0 * (rank + 1)))
    t.add("ar_loss", torch.tensor(4.0 * (rank + 1)))
    t.add("ar_frames", torch.tensor(8.0 + rank))
    t.add("ar_top10_correct", torch.tensor(6.0))
    t.add("frames", 20 + rank)
    t.add("cuts", 2)
    return t


def _reduce_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        t = _rank_metrics(rank).reduce()
        torch.save(t.normalized() | {"raw_loss": t["loss"]}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_reduce_across_two_gloo_ranks(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_reduce_worker, args=(r, 2, str(tmp_path / "init"), str(tmp_path)))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=45)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(5)
    assert not alive, "a rank hung in reduce()"
    assert [p.exitcode for p in procs] == [0, 0]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results[0] == results[1]
    r = results[0]
    assert r["raw_loss"] == 30.0
    assert r["frames"] == 41
    assert r["cuts"] == 4
    assert r["ar_frames"] == 17
    assert r["loss"] == pytest.approx(30.0 / 41)
    assert r["ar_loss"] == pytest.approx(12.0 / 17)
    assert r["ar_top10_acc"] == pytest.approx(12.0 / 17)


def test_reduce_without_process_group_is_identity():
    t = _rank_metrics(0)
    assert t.reduce() is t
    assert t["loss"] == 10.0


def test_normalized_and_str():
    t = _rank_metrics(0) + _rank_metrics(1)
    n = t.normalized()
    assert n["loss"] == pytest.approx(30.0 / 41)
    assert n["ar_loss"] == pytest.approx(12.0 / 17)
    assert n["ar_top10_acc"] == pytest.approx(12.0 / 17)
    assert "ar_top10_correct" not in n
    s = str(t)
    assert s.startswith("ar_loss=0.7059, ar_top10_acc=0.7059, loss=0.7317")
    assert "frames=41" in s and "cuts=4" in s
    # Decaying running totals (icefall style).
    d = t * 0.5
    assert d["loss"] == 15.0 and d.normalized()["loss"] == pytest.approx(30.0 / 41)
    # Zero frames: NaN, not a ZeroDivisionError.
    assert math.isnan(MetricsTracker({"loss": 1.0, "frames": 0}).normalized()["loss"])


def test_to_tensor_packs_in_sorted_order():
    names, packed = _rank_metrics(0).to_tensor()
    assert names == sorted(names)
    assert packed.dtype == torch.float64 and packed.shape == (len(names),)
    assert packed[names.index("frames")].item() == 20


def test_tensorboard_logger_writes_on_rank0_only(tmp_path):
    pytest.importorskip("tensorboard")
    on = TensorBoardLogger(tmp_path / "tb0", enabled=True, rank=0)
    off = TensorBoardLogger(tmp_path / "tb1", enabled=True, rank=1)
    disabled = TensorBoardLogger(tmp_path / "tb2", enabled=False, rank=0)
    for step, loss in enumerate([3.0, 2.0, 1.5]):
        for lg in (on, off, disabled):
            lg.scalars(step, {"train/loss": torch.tensor(loss), "lr": 0.1, "skip": None})
    for lg in (on, off, disabled):
        lg.close()
    assert list((tmp_path / "tb0").glob("events.out.tfevents.*"))
    assert not (tmp_path / "tb1").exists() and not (tmp_path / "tb2").exists()
    png = plot_loss_curve(tmp_path / "tb0", tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_loss_curve_from_points(tmp_path):
    pytest.importorskip("matplotlib")
    png = plot_loss_curve([(0, 5.0), (10, 3.0), (20, 2.0)], tmp_path / "sub" / "loss.png")
    assert png.stat().st_size > 1000
    with pytest.raises(ValueError):
        plot_loss_curve([], tmp_path / "empty.png")


def test_setup_logging_file_name_and_rank_format(tmp_path, capsys):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        path = setup_logging(tmp_path / "log", rank=1, world_size=2, level="INFO")
        assert path.parent == tmp_path / "log"
        assert path.name.startswith("log-train-") and path.name.endswith("-1")
        logging.getLogger("valle.test").info("hello %d", 42)
        # Calling again replaces, not duplicates, the handlers.
        path2 = setup_logging(tmp_path / "log", rank=0, world_size=1)
        assert not path2.name.endswith("-0")
        logging.getLogger("valle.test").info("second")
        for h in root.handlers:
            h.flush()
        text = path.read_text()
        assert "(1/2) hello 42" in text and "test_metrics.py" in text
        assert "second" not in text
        assert path2.read_text().count("(0/1) second") == 1
        assert capsys.readouterr().err.count("second") == 1
    finally:
        for h in list(root.handlers):
            if h not in saved[0]:
                root.removeHandler(h)
                h.close()
        root.setLevel(saved[1])


def test_throughput_meter_rate_and_eta():
    now = [100.0]
    meter = ThroughputMeter(window=10, clock=lambda: now[0])
    assert meter.rate == 0.0 and meter.eta(0, 10) == "?"
    for _ in range(4):
        now[0] += 0.5
        meter.step()
    assert meter.rate == pytest.approx(2.0)
    assert meter.eta(4, 124) == "1m00s"
    assert str(meter) == "2.00 it/s"
    assert format_duration(3725) == "1h02m05s"
    assert format_duration(7) == "7s"


def test_import_with_torch_alone():
    import subprocess

    code = (
        "import sys, valle.train.metrics, valle.train.optim, valle.train.averaging, "
        "valle.train.checkpoint; "
        "bad = [m for m in ('tensorboard', 'matplotlib', 'torch.utils.tensorboard') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stdout + out.stderr

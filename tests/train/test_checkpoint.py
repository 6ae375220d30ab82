"""Tests for valle.train.checkpoint."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import pytest
import torch

from valle.train import checkpoint as ckpt
from valle.train.checkpoint import (
    CorruptCheckpointError,
    apply_stage_switch,
    capture_rng_state,
    find_latest_checkpoint,
    load_checkpoint,
    make_payload,
    remove_old_checkpoints,
    restore_rng_state,
    save_best,
    save_checkpoint,
)


def _payload(step: int, epoch: int = 1, stage: int = 1, **kw) -> dict:
    base = dict(
        model={"w": torch.full((64, 64), float(step))},
        model_avg={"w": torch.full((64, 64), step / 2)},
        optimizer={"state": {0: {"step": step}}, "param_groups": [{"lr": 0.01}]},
        scheduler={"batch": step, "epoch": epoch},
        scaler={"scale": 1024.0},
        sampler={"epoch": epoch, "position": 3},
        step=step,
        epoch=epoch,
        batch_in_epoch=step % 7,
        train_stage=stage,
        config={"model_name": "valle", "base_lr": 0.05},
        quarantine=[{"cut_id": "c1"}],
    )
    base.update(kw)
    return make_payload(**base)


def _truncate(path, keep_fraction: float = 0.5) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep_fraction))


def test_save_load_round_trip(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoint-10.pt", _payload(10))
    loaded = load_checkpoint(path)
    assert loaded["format"] == ckpt.FORMAT
    assert loaded["step"] == 10 and loaded["train_stage"] == 1
    assert torch.equal(loaded["model"]["w"], torch.full((64, 64), 10.0))
    assert loaded["config"]["model_name"] == "valle"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


def test_crash_mid_write_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint-5.pt"
    save_checkpoint(path, _payload(5))
    before = path.read_bytes()
    real_save = torch.save

    def crashing_save(obj, f, *args, **kwargs):
        # Write part of a real checkpoint, then die as a killed process would.
        real_save(obj, f, *args, **kwargs)
        f.truncate(100)
        raise KeyboardInterrupt("simulated crash mid-write")

    monkeypatch.setattr(ckpt.torch, "save", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, _payload(6))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert load_checkpoint(path)["step"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-5.pt"]


def test_leftover_temp_file_is_ignored(tmp_path):
    save_checkpoint(tmp_path / "checkpoint-5.pt", _payload(5))
    # What a process killed before os.replace leaves behind.
    (tmp_path / ".checkpoint-9.pt.abc123.tmp").write_bytes(b"partial")
    found = find_latest_checkpoint(tmp_path)
    assert found is not None and found[0].name == "checkpoint-5.pt"


def test_load_rejects_truncated_and_foreign_files(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoint-3.pt", _payload(3))
    _truncate(path)
    with pytest.raises(CorruptCheckpointError, match="checkpoint-3.pt"):
        load_checkpoint(path)
    foreign = tmp_path / "foreign.pt"
    torch.save({"model": {}, "step": 1}, foreign)
    with pytest.raises(CorruptCheckpointError, match="format"):
        load_checkpoint(foreign)
    missing = tmp_path / "missing.pt"
    torch.save({"format": ckpt.FORMAT, "model": {}, "step": 1}, missing)
    with pytest.raises(CorruptCheckpointError, match="missing keys"):
        load_checkpoint(missing)
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path / "bad.pt", {"format": ckpt.FORMAT, "model": {}})


def test_find_latest_orders_by_payload_step_then_epoch(tmp_path):
    assert find_latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path / "checkpoint-100.pt", _payload(100, epoch=2))
    save_checkpoint(tmp_path / "epoch-2.pt", _payload(120, epoch=2))
    save_checkpoint(tmp_path / "checkpoint-90.pt", _payload(90, epoch=2))
    save_best(tmp_path, "valid", _payload(999))  # best-* never resumes
    path, payload = find_latest_checkpoint(tmp_path)
    assert path.name == "epoch-2.pt" and payload["step"] == 120
    # Same step: the later epoch wins.
    save_checkpoint(tmp_path / "epoch-3.pt", _payload(120, epoch=3))
    path, payload = find_latest_checkpoint(tmp_path)
    assert path.name == "epoch-3.pt"


def test_truncated_newest_checkpoint_falls_back_with_warning(tmp_path, caplog):
    save_checkpoint(tmp_path / "checkpoint-100.pt", _payload(100))
    save_checkpoint(tmp_path / "checkpoint-200.pt", _payload(200))
    _truncate(tmp_path / "checkpoint-200.pt")
    with caplog.at_level(logging.WARNING, logger="valle.train.checkpoint"):
        found = find_latest_checkpoint(tmp_path)
    assert found is not None
    path, payload = found
    assert path.name == "checkpoint-100.pt" and payload["step"] == 100
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checkpoint-200.pt" in w for w in warnings), warnings


def test_newest_that_fails_full_load_falls_back(tmp_path, caplog, monkeypatch):
    """A file whose header reads but whose full load fails is also skipped."""
    save_checkpoint(tmp_path / "checkpoint-100.pt", _payload(100))
    save_checkpoint(tmp_path / "checkpoint-200.pt", _payload(200))
    real_load = torch.load

    def flaky_load(path, *args, **kwargs):
        if not kwargs.get("mmap") and str(path).endswith("checkpoint-200.pt"):
            raise RuntimeError("PytorchStreamReader failed reading file data/0")
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "load", flaky_load)
    with caplog.at_level(logging.WARNING, logger="valle.train.checkpoint"):
        path, _ = find_latest_checkpoint(tmp_path)
    assert path.name == "checkpoint-100.pt"
    assert any("checkpoint-200.pt" in r.getMessage() for r in caplog.records)


def test_remove_old_checkpoints_keeps_last_k(tmp_path):
    for step in (10, 20, 30, 40, 100):
        save_checkpoint(tmp_path / f"checkpoint-{step}.pt", _payload(step))
    save_checkpoint(tmp_path / "epoch-1.pt", _payload(5))
    removed = remove_old_checkpoints(tmp_path, keep_last_k=2)
    assert sorted(p.name for p in removed) == ["checkpoint-10.pt", "checkpoint-20.pt", "checkpoint-30.pt"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["checkpoint-100.pt", "checkpoint-40.pt", "epoch-1.pt"]
    assert remove_old_checkpoints(tmp_path, keep_last_k=0) == []
    assert len(list(tmp_path.iterdir())) == 3


def test_save_best(tmp_path):
    assert save_best(tmp_path, "train", _payload(7)).name == "best-train-loss.pt"
    assert load_checkpoint(tmp_path / "best-train-loss.pt")["step"] == 7
    with pytest.raises(ValueError):
        save_best(tmp_path, "test", _payload(7))


@pytest.mark.parametrize("old,new", [(1, 2), (1, 0), (2, 0), (2, 1), (0, 1), (0, 2)])
def test_stage_switch_keeps_weights_drops_the_rest(old, new):
    payload = _payload(500, epoch=4, stage=old)
    out, dropped = apply_stage_switch(payload, new)
    assert out["train_stage"] == new
    assert out["model"] is payload["model"] and out["model_avg"] is payload["model_avg"]
    for key in ("optimizer", "scheduler", "scaler", "sampler"):
        assert out[key] is None
    assert (out["step"], out["epoch"], out["batch_in_epoch"]) == (0, 1, 0)
    assert out["quarantine"] == []
    assert sorted(dropped) == sorted(
        ["optimizer", "scheduler", "scaler", "sampler", "step", "epoch", "batch_in_epoch", "quarantine"]
    )
    assert out["config"] == payload["config"] and out["rng"] is payload["rng"]
    assert payload["train_stage"] == old and payload["optimizer"] is not None  # input untouched


def test_stage_switch_reports_only_what_held_something():
    payload = _payload(0, epoch=1, stage=1, scaler=None, sampler=None, quarantine=[])
    _, dropped = apply_stage_switch(payload, 2)
    assert sorted(dropped) == ["optimizer", "scheduler"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_same_stage_is_unchanged(stage):
    payload = _payload(500, epoch=4, stage=stage)
    out, dropped = apply_stage_switch(payload, stage)
    assert dropped == []
    assert out == payload


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = capture_rng_state()
    save_checkpoint(tmp_path / "checkpoint-1.pt", _payload(1, rng=state))
    expected = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    # Disturb every generator, then restore from the file (weights_only works too).
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    loaded = load_checkpoint(tmp_path / "checkpoint-1.pt", weights_only=True)
    restore_rng_state(loaded["rng"])
    got = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert got[0] == expected[0]
    assert got[1] == expected[1]
    assert torch.equal(got[2], expected[2])


def test_checkpoint_file_is_fsynced(tmp_path, monkeypatch):
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    save_checkpoint(tmp_path / "checkpoint-1.pt", _payload(1))
    assert len(calls) >= 1

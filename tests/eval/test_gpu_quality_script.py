"""scripts/gpu_quality.py: what the GPU run packs comes back whole.

The GPU machine returns at most 8 files of 16 MiB, so checkpoints travel split and AR weights
travel as snapshots; scoring reassembles them. A part lost on the way must stop the scoring
with the file's name, not score a model with missing weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_quality", ROOT / "scripts" / "gpu_quality.py")
gpu_quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_quality)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"ar_embedding.weight": torch.randn(64, 32, generator=g),
            "ar_layer.weight": torch.randn(32, 32, generator=g),
            "nar_embedding.weight": torch.randn(64, 32, generator=g),
            "nar_layer.weight": torch.randn(32, 32, generator=g)}


def _checkpoint(seed: int, step: int, stage: int) -> dict:
    return {"format": "valle-checkpoint-1", "model": _weights(seed), "model_avg": _weights(seed + 100),
            "optimizer": {"state": "large"}, "config": {"decoder_dim": 32, "num_decoder_layers": 1,
                                                        "dtype": "float32"},
            "step": step, "epoch": 1, "train_stage": stage}


def _fake_run(exp: Path) -> None:
    """Model A with AR checkpoints every 250 steps to 6750 (best at 6750), model B without."""
    for name, seed in (("A", 1), ("B", 50)):
        (exp / name / "ar").mkdir(parents=True)
        (exp / name / "nar").mkdir()
        torch.save(_checkpoint(seed, 6750, 1), exp / name / "ar" / "best-valid-loss.pt")
        torch.save(_checkpoint(seed + 1, 2750, 2), exp / name / "nar" / "best-valid-loss.pt")
    for step in range(250, 6751, 250):
        torch.save(_checkpoint(1000 + step, step, 1), exp / "A" / "ar" / f"checkpoint-{step}.pt")


def test_snapshots_are_the_saved_steps_nearest_the_cpu_demo_and_its_doublings():
    assert gpu_quality.pick_snapshots(list(range(250, 6751, 250))) == [1750, 3750, 6750]
    assert gpu_quality.pick_snapshots([100, 200]) == []  # the run got nowhere near 1820
    assert gpu_quality.pick_snapshots([]) == []


def test_split_parts_stay_under_the_limit_and_join_back():
    ckpt = _checkpoint(3, 10, 2)
    parts = gpu_quality.split_checkpoint(ckpt, ar_step=7, limit=12288)  # tensors of 8, 4, 8, 4 KiB
    assert len(parts) == 2
    for part in parts:
        assert sum(t.numel() * t.element_size() for t in part["model"].values()) <= 12288
    assert parts[0]["ar_step"] == 7 and parts[0]["step"] == 10 and "optimizer" not in parts[0]
    joined = gpu_quality.join_parts(parts)
    assert joined["model"].keys() == ckpt["model"].keys()
    for name, tensor in ckpt["model"].items():
        assert torch.equal(joined["model"][name], tensor)


def test_pack_then_gather_round_trip(tmp_path):
    exp, out = tmp_path / "exp", tmp_path / "out"
    _fake_run(exp)
    written = gpu_quality.pack(exp, out, {"A"})
    assert sorted(p.name for p in written) == ["A_ar_snaps.pt", "A_nar_0.pt", "B_nar_0.pt"]
    full, snaps = gpu_quality.gather([out])
    assert set(full) == {"A", "B"} and set(snaps) == {"A"}
    assert full["A"]["ar_step"] == 6750 and full["A"]["step"] == 2750
    for name, tensor in _weights(2).items():  # A's NAR-stage weights, whole
        assert torch.equal(full["A"]["model"][name], tensor)
    assert sorted(snaps["A"]) == [1750, 3750, 6750]
    at_1750 = snaps["A"][1750]
    assert set(at_1750) == {"ar_embedding.weight", "ar_layer.weight"}  # AR weights only
    assert torch.equal(at_1750["ar_layer.weight"], _weights(1000 + 1750)["ar_layer.weight"])


def test_a_part_lost_on_the_way_is_named(tmp_path):
    exp, out = tmp_path / "exp", tmp_path / "out"
    _fake_run(exp)
    gpu_quality.pack(exp, out, set())
    parts = gpu_quality.split_checkpoint(torch.load(exp / "B" / "nar" / "best-valid-loss.pt",
                                                    weights_only=False), 6750, limit=9000)
    for i, part in enumerate(parts):
        torch.save(part, out / f"B_nar_{i}.pt")
    (out / "B_nar_1.pt").unlink()
    with pytest.raises(SystemExit, match="B_nar_1.pt did not come back"):
        gpu_quality.gather([out])

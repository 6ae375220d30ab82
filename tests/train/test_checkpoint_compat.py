"""A checkpoint written by an earlier version of the trainer still loads, decodes and trains.

tests/fixtures/checkpoint-v1 (README.md there: the commit and command that wrote it) holds a
stage-1 checkpoint of a tiny model with its averaged model, optimizer, scheduler and sampler
state, and what that version computed with it (expected.json). Only public entry points are
used: `valle.infer.load_model` (bin/infer.py) and bin/trainer.py, so the test keeps its meaning
whatever moves inside valle/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from valle.infer import load_model

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint-v1"
CHECKPOINT = FIXTURE / "checkpoint-2.pt"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())

# The flags that wrote the fixture (README.md), less those the resumed runs set themselves.
FIXTURE_FLAGS = ["--synthetic-data", "16", "--synthetic-batch-size", "4", "--average-period", "1",
                 "--seed", "7", "--decoder-dim", "2", "--nhead", "1", "--num-decoder-layers", "1",
                 "--num-quantizers", "2", "--num-text-tokens", "64", "--dropout", "0",
                 "--device", "cpu", "--tensorboard", "false", "--oom-check", "false"]


def _probe_batch() -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(FIXTURE))
    try:
        from probe import probe_batch
    finally:
        sys.path.remove(str(FIXTURE))
    return probe_batch()


@pytest.mark.parametrize("weights", ["weights", "averaged"])
def test_old_checkpoint_computes_what_it_did(weights):
    model, config = load_model(CHECKPOINT, use_averaged_model=weights == "averaged")
    assert (config["model_name"], config["decoder_dim"], config["nhead"],
            config["num_decoder_layers"], config["num_quantizers"],
            config["num_text_tokens"]) == ("valle", 2, 1, 1, 2, 64)
    assert not model.training
    batch = _probe_batch()
    expected = EXPECTED[weights]
    with torch.no_grad():
        loss, metrics = model(batch["text"], batch["text_lens"], batch["audio"],
                              batch["audio_lens"], train_stage=0,
                              sample_seeds=batch["sample_seeds"])
    torch.testing.assert_close(float(loss), expected["loss"], rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(float(metrics["ar_loss"]), expected["ar_loss"], rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(float(metrics["nar_loss"]), expected["nar_loss"], rtol=1e-5,
                               atol=1e-3)
    codes = model.inference(batch["text"][:1], batch["text_lens"][:1], batch["audio"][:1, :6],
                            top_k=1, force_len=4)
    assert codes.tolist() == expected["greedy_codes"]


def test_averaged_weights_are_not_the_plain_ones():
    # The fixture's averaged model is a real average (period 1 over 2 steps), so the test
    # above tells the two apart: loading one for the other would fail it.
    assert EXPECTED["weights"]["ar_loss"] != EXPECTED["averaged"]["ar_loss"]


def _train(exp_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "bin" / "trainer.py"), *FIXTURE_FLAGS,
         "--exp-dir", str(exp_dir), "--save-every-n", "1", *flags],
        env=env, capture_output=True, text=True, timeout=300)


def _resumable_copy(tmp_path: Path) -> Path:
    exp_dir = tmp_path / "exp"
    exp_dir.mkdir()
    shutil.copy(CHECKPOINT, exp_dir / CHECKPOINT.name)
    return exp_dir


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_training_resumes_from_old_checkpoint(tmp_path):
    exp_dir = _resumable_copy(tmp_path)
    done = _train(exp_dir, "--train-stage", "1", "--max-steps", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr + done.stdout
    old, new = _load(CHECKPOINT), _load(exp_dir / "checkpoint-3.pt")
    # One more step on top of the saved ones: step, optimizer, scheduler and sampler carry on.
    assert (new["step"], new["epoch"], new["train_stage"]) == (3, 1, 1)
    assert {int(s["step"]) for s in new["optimizer"]["state"].values()} == {3}
    assert new["scheduler"]["batch"] == old["scheduler"]["batch"] + 1
    assert new["sampler"]["per_rank"][0]["consumed"] == 3
    assert new["model_avg"] is not None
    assert new["model"].keys() == old["model"].keys(), "the weights' names changed"
    changed = [k for k, v in old["model"].items() if not torch.equal(v, new["model"][k])]
    assert changed and all(k.startswith("ar_") for k in changed)


def test_next_stage_starts_from_old_checkpoint(tmp_path):
    exp_dir = _resumable_copy(tmp_path)
    done = _train(exp_dir, "--train-stage", "2", "--max-steps", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    old, new = _load(CHECKPOINT), _load(exp_dir / "checkpoint-1.pt")
    # A stage switch: the weights carry over, the optimisation starts afresh.
    assert (new["step"], new["train_stage"]) == (1, 2)
    assert {int(s["step"]) for s in new["optimizer"]["state"].values()} == {1}
    assert new["model"].keys() == old["model"].keys(), "the weights' names changed"
    changed = {k for k, v in old["model"].items() if not torch.equal(v, new["model"][k])}
    assert changed and all(k.startswith("nar_") for k in changed)

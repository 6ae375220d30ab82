"""egs/tiny/lora.sh on CPU: a base trained on egs/tiny's 4 eSpeak voices, LoRA adapters fitted
to a voice it never heard. The new voice's validation loss drops, the adapters belong to the
unchanged base, the adapter file is a small fraction of a checkpoint, and merged and unmerged
models decode the same."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-demo")
    proc = subprocess.run(
        ["bash", str(ROOT / "egs/tiny/lora.sh"), "--python", sys.executable, "--data-dir",
         str(tmp / "data"), "--exp-dir", str(tmp / "exp"), "--limit", "32", "--base-steps", "80",
         "--lora-steps", "40"],
        cwd=tmp, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tmp / "exp", proc.stdout


def test_the_new_voices_validation_loss_drops_and_the_adapters_are_small(demo):
    exp, out = demo
    found = re.search(r"validation loss per frame ([\d.]+) \(base\) -> ([\d.]+)", out)
    assert found, out[-3000:]
    before, after = map(float, found.groups())
    assert after < before
    adapters = (exp / "lora" / "best-valid-loss.pt").stat().st_size
    assert adapters < 0.05 * (exp / "lora" / "merged.pt").stat().st_size
    assert list((exp / "lora" / "tensorboard").rglob("events.out.tfevents.*"))


def test_adapters_belong_to_the_unchanged_base_and_merging_changes_no_output(demo):
    from valle.infer import load_model
    from valle.models.convert import load_model_checkpoint
    from valle.models.lora import base_fingerprint

    exp, _ = demo
    base_path, adapters_path = exp / "base" / "best-valid-loss.pt", exp / "lora" / "best-valid-loss.pt"
    adapters = torch.load(adapters_path, map_location="cpu", weights_only=False)
    base_state, _ = load_model_checkpoint(base_path)
    assert adapters["lora"]["base_sha256"] == base_fingerprint(base_state)
    assert all(k.endswith(("lora_A", "lora_B")) for k in adapters["model"])
    unmerged, _ = load_model(base_path, lora=adapters_path)
    merged, _ = load_model(exp / "lora" / "merged.pt")
    g = torch.Generator().manual_seed(0)
    text = torch.randint(4, 20, (2, 12), generator=g)
    prompt = torch.randint(0, 1024, (2, 20, 8), generator=g)
    args = (text, torch.tensor([12, 10]), prompt, torch.tensor([20, 16]))
    kw = dict(prompt_text_lens=torch.tensor([5, 4]), top_k=1, seed=0, max_len_ratio=2)
    assert torch.equal(unmerged.inference(*args, **kw), merged.inference(*args, **kw))

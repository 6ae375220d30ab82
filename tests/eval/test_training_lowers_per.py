"""The quality bar: a short training on the offline codec makes held-out speech that the phoneme
judge understands far better than an untrained model's. Asserts the drop, not a tuned number."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN_STEPS = int(os.environ.get("VALLE_QUALITY_STEPS", "150"))
MODEL = ["--model-name", "valle", "--decoder-dim", "128", "--nhead", "4", "--num-decoder-layers", "2",
         "--prefix-mode", "1", "--dropout", "0.0"]


def _train(data: Path, exp: Path) -> Path:
    cmd = [sys.executable, str(ROOT / "bin/trainer.py"), *MODEL, "--manifest-dir", str(data),
           "--dataset", "tiny", "--max-duration", "24", "--max-text-tokens", "600", "--num-workers", "0",
           "--device", "cpu", "--dtype", "float32", "--exp-dir", str(exp), "--num-epochs", "1000",
           "--max-steps", str(TRAIN_STEPS), "--base-lr", "0.05", "--warmup-steps", "20",
           "--lr-batches", "200", "--log-interval", "50", "--valid-interval", "100000",
           "--save-every-n", str(TRAIN_STEPS), "--average-period", "5", "--train-stage", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return max(exp.glob("checkpoint-*.pt"), key=lambda p: int(p.stem.split("-")[1]))


def _untrained_copy(checkpoint: Path, out: Path) -> Path:
    """The trained checkpoint with freshly initialised weights: same config, codec and symbols."""
    from valle.models import get_model

    payload = torch.load(checkpoint, map_location="cpu", weights_only=False)
    torch.manual_seed(0)
    payload["model"] = get_model(payload["config"]).state_dict()
    payload["model_avg"] = None
    torch.save(payload, out)
    return out


def _synthesise_and_score(checkpoint: Path, items: Path, evaluated: Path, out_dir: Path) -> float:
    import json

    from valle.eval.evaluate import main as evaluate
    from valle.infer import main as infer

    # --max-len-ratio 6: about 2.5x the frames the texts need, so a babbling model stays cheap
    infer(["--checkpoint", str(checkpoint), "--device", "cpu", "--tsv", str(items), "--output-dir",
           str(out_dir), "--top-k", "10", "--seed", "1", "--batch-size", "8", "--max-len-ratio", "6"])
    assert evaluate(["--tsv", str(evaluated), "--output-dir", str(out_dir), "--checkpoint", str(checkpoint),
                     "--no-references", "--speaker-model", "none", "--max-len-ratio", "6", "--missing-as-empty",
                     "--output-json", str(out_dir / "eval.json")]) == 0
    report = json.loads((out_dir / "eval.json").read_text())
    return report["summary"]["output"]["per"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_training_lowers_held_out_per(heldout_data, tmp_path):
    trained = _train(heldout_data, tmp_path / "exp")
    untrained = _untrained_copy(trained, tmp_path / "untrained.pt")
    items, evaluated = tmp_path / "infer.tsv", tmp_path / "eval.tsv"
    subprocess.run([sys.executable, str(ROOT / "egs/tiny/local/test_items.py"), "--cuts",
                    str(heldout_data / "tiny_cuts_test.jsonl.gz"), "--num-items", "8",
                    "--infer-tsv", str(items), "--eval-tsv", str(evaluated)], check=True, cwd=ROOT)
    per_untrained = _synthesise_and_score(untrained, items, evaluated, tmp_path / "untrained")
    per_trained = _synthesise_and_score(trained, items, evaluated, tmp_path / "trained")
    # held-out sentences in held-out voices; an untrained model babbles (PER about 1 or more)
    assert per_trained < 0.75 * per_untrained and per_untrained - per_trained > 0.2, (per_trained, per_untrained)
    _refitted_codec_is_refused(trained, heldout_data, items, tmp_path)


def _refitted_codec_is_refused(checkpoint: Path, data: Path, items: Path, tmp_path: Path) -> None:
    """The checkpoint records its codec's hash; bin/infer refuses another mel_rvq.pt."""
    from valle.codec import RECORD_FILE, codec_identity
    from valle.codec.mel_rvq import STATE_FILE, MelRvqCodec
    from valle.infer import main as infer

    config = torch.load(checkpoint, map_location="cpu", weights_only=False)["config"]
    assert config["audio_codec"] == codec_identity(data) and config["audio_codec"]["sha256"]
    other = MelRvqCodec.load(data / STATE_FILE)
    other.codebooks = other.codebooks.flip(1)  # the same shapes, other codes: as a refit gives
    other_dir = tmp_path / "refitted"
    other.save(other_dir / STATE_FILE)
    (other_dir / RECORD_FILE).write_text((data / RECORD_FILE).read_text())
    assert infer(["--checkpoint", str(checkpoint), "--device", "cpu", "--tsv", str(items), "--output-dir",
                  str(tmp_path / "refused"), "--codec-dir", str(other_dir)]) == 2
    assert not list((tmp_path / "refused").glob("*.wav"))


@pytest.mark.timeout(300)
def test_the_trainer_refuses_an_ar_head_smaller_than_the_corpus_codebook_0(heldout_data, tmp_path):
    """The corpus's codebook 0 has 128 codes (--first-codebook-size 128): a 64-code AR head is
    refused before the first step, naming the flag and the size that fits."""
    cmd = [sys.executable, str(ROOT / "bin/trainer.py"), *MODEL, "--ar-codebook-size", "64",
           "--manifest-dir", str(heldout_data), "--dataset", "tiny", "--max-duration", "24",
           "--num-workers", "0", "--device", "cpu", "--exp-dir", str(tmp_path / "exp"),
           "--max-steps", "1", "--train-stage", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "--ar-codebook-size 64" in proc.stderr and "use --ar-codebook-size 128" in proc.stderr, proc.stderr[-3000:]
    assert not list((tmp_path / "exp").glob("*.pt"))

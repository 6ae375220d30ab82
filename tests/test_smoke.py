"""The newest-torch smoke set's pipeline (``make smoke-newest-torch``, which sets VALLE_SMOKE=1;
``make test`` skips it: tests/data/test_tiny.py and test_recipes.py cover the same there): tokenize
the tiny corpus with EnCodec, a few training steps on 2 gloo ranks under torchrun, synthesis
with the EnCodec and the Vocos decoders. The rest of the smoke set is marked ``smoke`` where it
lives (the codecs' equality fixtures, the page's API in tests/test_serve.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.smoke, pytest.mark.multiproc,
              pytest.mark.skipif(os.environ.get("VALLE_SMOKE") != "1",
                                 reason="the smoke run's pipeline: make smoke-newest-torch (VALLE_SMOKE=1)")]
# Offline: no weights are fetched (a missing network would only cost retries).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _run(argv: list[str], timeout: int) -> str:
    proc = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("smoke") / "tiny"
    out = _run(["bash", "egs/tiny/prepare.sh", "--python", sys.executable, "--data-dir", str(data),
                "--limit", "16", "--codec", "encodec"], timeout=300)
    assert "RANDOM ENCODEC WEIGHTS" in out
    return data


@pytest.fixture(scope="module")
def trained(corpus) -> Path:
    exp = corpus.parent / "exp"
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "bin/trainer.py", "--decoder-dim", "32", "--nhead", "2", "--num-decoder-layers", "1",
                "--dropout", "0", "--manifest-dir", str(corpus / "tokenized"), "--dataset", "tiny",
                "--max-duration", "8", "--num-workers", "0", "--device", "cpu", "--dtype", "float32",
                "--train-stage", "1", "--exp-dir", str(exp), "--num-epochs", "1", "--max-steps", "3",
                "--tensorboard", "false"], timeout=240)
    assert "(1/2)" in out and "OOM events" in out
    return exp / "epoch-1.pt"


@pytest.mark.timeout(300)
def test_tiny_corpus_is_tokenized_with_encodec(corpus):
    import json

    from lhotse import CutSet

    record = json.loads((corpus / "tokenized" / "audio_codec.json").read_text())
    assert record == {"codec": "encodec", "random_weights": True}
    cut = next(iter(CutSet.from_file(corpus / "tokenized" / "tiny_cuts_train.jsonl.gz")))
    codes = cut.load_features()
    assert codes.shape[1] == 8 and abs(codes.shape[0] - cut.duration * 75) <= 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("decoder", ["encodec", "vocos"])
def test_two_ranks_train_then_synthesis(corpus, trained, decoder, tmp_path):
    import soundfile as sf

    prompt = sorted((corpus / "corpus" / "wavs").rglob("*.wav"))[0]
    from lhotse import CutSet

    texts = {c.recording_id: c.supervisions[0].text
             for c in CutSet.from_file(corpus / "tokenized" / "tiny_cuts_all.jsonl.gz")}
    _run([sys.executable, "bin/infer.py", "--checkpoint", str(trained), "--text-prompts", texts[prompt.stem],
          "--audio-prompts", str(prompt), "--text", "The cat sat.", "--output-dir", str(tmp_path),
          "--top-k", "1", "--max-len-ratio", "2", "--device", "cpu", "--allow-random-encodec",
          "--decoder", decoder, "--allow-random-vocos"], timeout=300)
    wav, sr = sf.read(str(tmp_path / "0.wav"))
    assert sr == 24000 and wav.size > 0 and wav.size % 320 == 0 and np.isfinite(wav).all()

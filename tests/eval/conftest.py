"""A small held-out-layout corpus (mel-rvq codec, phoneme judge), built once per session by
egs/tiny/prepare.sh --layout heldout; shared by the evaluator tests and the training test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SENTENCES = 96  # natural training sentences (one voice each); dev 16, test 16 x 2 held-out voices
GENERATED = 300  # generated training utterances (half of them two sentences: zero-shot needs it)
JUDGE_EPOCHS = 40  # on the 96 natural ones: about 500 CTC steps, past the blank plateau


@pytest.fixture(scope="session")
def heldout_data(tmp_path_factory) -> Path:
    """Returns the tokenized dir: tiny_cuts_{train,dev,test}, mel_rvq.pt, audio_codec.json, judge.pt.
    Built once per run: under pytest-xdist (`make test`) the first worker to need it builds it
    in the run's shared temp dir and the others wait for it."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's directory, above each worker's own
    data_dir, done = shared / "heldout", shared / "heldout.done"
    with FileLock(str(shared / "heldout.lock")):
        if not done.is_file():
            _build_heldout(data_dir)
            done.touch()
    return data_dir / "tokenized"


def _build_heldout(data_dir: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", str(ROOT / "egs/tiny/prepare.sh"), "--python", sys.executable, "--data-dir", str(data_dir),
         "--layout", "heldout", "--codec", "mel-rvq", "--limit", str(TRAIN_SENTENCES),
         "--generated", str(GENERATED), "--judge-epochs", str(JUDGE_EPOCHS),
         "--judge-limit", str(TRAIN_SENTENCES), "--first-codebook-size", "128", "--num-jobs", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="session")
def judge(heldout_data):
    from valle.eval.judge import Judge

    return Judge.load(heldout_data / "judge.pt")


@pytest.fixture(scope="session")
def test_examples(heldout_data):
    """(wav, phonemes, cut) of the test part: held-out sentences in held-out voices."""
    from valle.eval.judge import load_cut_examples

    return load_cut_examples(heldout_data / "tiny_cuts_test.jsonl.gz")

"""Shared fixtures: a small tiny corpus built once per session by egs/tiny/prepare.sh."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# pytest runs with --import-mode=importlib: make data_testlib importable.
sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parents[2]


def load_tokenizer_cli():
    """bin/tokenizer.py as a module (bin/ is not a package)."""
    spec = importlib.util.spec_from_file_location("valle_bin_tokenizer", ROOT / "bin" / "tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """24 utterances, 4 voices, tokenized and split; returns the tokenized dir."""
    data_dir = tmp_path_factory.mktemp("tiny")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", str(ROOT / "egs/tiny/prepare.sh"), "--python", sys.executable,
         "--data-dir", str(data_dir), "--limit", "24"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RANDOM ENCODEC WEIGHTS" in proc.stderr + proc.stdout
    return data_dir / "tokenized"


@pytest.fixture(scope="session")
def tokenizer_cli():
    return load_tokenizer_cli()

"""scripts/oom_sweep.py keys its cache by the code it sweeps: a commit that changes only docs
or tests keeps the results (the whole sweep takes about two hours), while any committed or
uncommitted change to valle/, bin/, scripts/ or tests/support/ (the sweep driver and the
runs it starts) starts a new cache."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("oom_sweep", ROOT / "scripts" / "oom_sweep.py")
oom_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(oom_sweep)

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *cmd: str) -> None:
    # A timeout, so a git that waits (a prompt, a lock) fails the test instead of freezing CI;
    # no signing, so a machine-wide commit.gpgsign does not decide the outcome.
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                    *cmd], cwd=repo, check=True, capture_output=True, timeout=60)  # fmt: skip


def _commit(repo: Path, path: str, text: str) -> None:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", path)
    _git(repo, "commit", "-q", "-m", path)


def test_the_cache_key_follows_the_swept_code_only(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    for path in ("valle/step.py", "bin/trainer.py", "scripts/oom_sweep.py", "tests/support/sweep.py",
                 "docs/oom.md"):
        _commit(repo, path, "v1\n")
    first = oom_sweep._code_key(repo)
    assert first.startswith("code-") and "-" not in first.removeprefix("code-")

    _commit(repo, "docs/oom.md", "the sweep's table\n")
    _commit(repo, "tests/test_x.py", "pass\n")
    assert oom_sweep._code_key(repo) == first  # a docs-and-tests commit keeps the cache

    (repo / "valle/step.py").write_text("v2\n")
    dirty = oom_sweep._code_key(repo)
    assert dirty.startswith(first + "-")  # uncommitted code: its own cache
    _git(repo, "commit", "-q", "-am", "v2")
    committed = oom_sweep._code_key(repo)
    assert committed != first and "-" not in committed.removeprefix("code-")

    _commit(repo, "scripts/oom_sweep.py", "v2\n")
    script = oom_sweep._code_key(repo)
    assert script != committed

    _commit(repo, "tests/support/sweep.py", "v2\n")  # the sweep driver is swept code
    assert oom_sweep._code_key(repo) != script

"""The dev support (tests/support: multi-rank harness, trainer scenarios, allocation sweep)
lives outside the product package, and the scripts that use it still reach it: from the
repository root put on sys.path, in the parent and in its spawned ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_product_package_does_not_import_the_dev_support():
    importers = [str(p.relative_to(ROOT)) for p in (ROOT / "valle").rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+tests\b", p.read_text(), re.M)]
    assert not importers


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_script_spawns_ranks_that_import_the_support(tmp_path):
    # What scripts/bench_step.py and scripts/oom_sweep.py do: the root on sys.path, no
    # PYTHONPATH, started from elsewhere; each spawned rank unpickles a tests.support function.
    script = tmp_path / "spawn_check.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.support.harness import run_world, values\n"
        "from tests.support.scenarios import matrix_worker\n"
        "if __name__ == '__main__':\n"
        "    print(values(run_world(matrix_worker, 2, [], timeout=120)))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[{}, {}]"

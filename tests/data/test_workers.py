"""valle.data.workers: the trainer's DataLoader workers die with their parent and do not
inherit the HDF5 code files it read (issue 50: a killed process's workers held them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from data_testlib import end_processes, killed_workers, survivors

ROOT = Path(__file__).resolve().parents[2]

# A trainer in miniature: it has read a code file (lhotse keeps it open), then iterates a
# loader whose worker is busy (sleeping: torch's own poll of the parent never runs), and
# is SIGKILLed. The worker reports its pid and whether it holds the code file.
PARENT = r"""
import os, signal, sys, time
from pathlib import Path

import h5py, torch
from lhotse.features.io import lookup_cache_or_open

from valle.data.loader import ResumableLoader

h5, report = Path(sys.argv[1]), Path(sys.argv[2])
with h5py.File(h5, "w") as f:
    f["codes"] = [1, 2, 3]
lookup_cache_or_open(str(h5))  # what cut.load_features() leaves open


class Busy(torch.utils.data.IterableDataset):
    def __iter__(self):
        held = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        tmp = report.with_name("tmp")
        tmp.write_text(f"{os.getpid()}\n")
        (report.parent / "held").write_text("\n".join(held))
        tmp.rename(report)
        time.sleep(120)
        yield {}


batches = iter(ResumableLoader(Busy(), 1, 1, 0, 0)._dataloader(Busy()))
deadline = time.monotonic() + 60
while not report.is_file() and time.monotonic() < deadline:
    time.sleep(0.02)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(120)
def test_a_killed_trainers_loader_workers_die_with_it_and_never_held_its_code_files(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    h5, report = tmp_path / "codes.h5", tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(tmp_path / "log", "w") as log:  # a pipe would be held open by a surviving worker
        proc = subprocess.run([sys.executable, str(script), str(h5), str(report)], env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=90)
    workers = killed_workers(report)
    try:
        assert proc.returncode == -signal.SIGKILL, (tmp_path / "log").read_text()[-3000:]
        assert workers
        assert str(h5) not in (tmp_path / "held").read_text().splitlines()
        assert survivors(workers) == []
    finally:
        end_processes(workers)


def test_a_loader_made_off_the_main_thread_gets_no_parent_death_signal():
    """The kernel's signal follows the forking thread: one that ends early would kill the
    workers of a live process."""
    import threading

    from valle.data.workers import worker_init_fn

    got = []
    t = threading.Thread(target=lambda: got.append(worker_init_fn()))
    t.start()
    t.join()
    assert got == [None] and worker_init_fn() is not None

"""A checkpoint write that fails (disk full, file size limit) is agreed across ranks,
reported with the path and the error, and survived: training goes on unchanged, the
older checkpoints stay loadable, the next save tries again, no partial file is left for
a resume to pick, and --keep-last-k never costs the last good checkpoint."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.harness import clean_launch_env, run_world, values
from tests.support.scenarios import TINY_MODEL, matrix_worker
from valle.train.checkpoint import (
    find_latest_checkpoint,
    load_checkpoint,
    make_payload,
    remove_old_checkpoints,
    save_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]


def argv(exp: Path, *extra: str) -> list[str]:
    # 48 cuts in global batches of 8 over 2 ranks: 6 steps per epoch, 2 epochs.
    return TINY_MODEL + ["--exp-dir", str(exp), "--synthetic-data", "48",
                         "--synthetic-batch-size", "8", "--num-epochs", "2", "--log-interval", "1",
                         "--save-every-n", "2", "--keep-last-k", "1", *extra]


def log_text(exp: Path) -> str:
    return "".join(p.read_text() for p in sorted((exp / "log").glob("log-train-*")))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_full_disk_at_save_is_agreed_reported_and_survived(tmp_path):
    clean, full = tmp_path / "clean", tmp_path / "full"
    # the 2nd checkpoint write of the run (checkpoint-4.pt) fails as on a full disk
    runs = [("clean", argv(clean)), ("full", argv(full, "--inject-fault", "disk@save:2"))]
    per_rank = values(run_world(matrix_worker, 2, runs, timeout=240))
    assert all(per_rank[r][name]["ok"] for r in (0, 1) for name in ("clean", "full")), per_rank
    text = log_text(full)
    assert re.search(r"\(0/2\) could not write checkpoint \S*checkpoint-4\.pt: ENOSPC: No space "
                     r"left on device \(injected\)", text), text[-4000:]
    for rank in (0, 1):  # every rank knows, and names the checkpoint a resume would use
        assert re.search(rf"\({rank}/2\) checkpoint \S*checkpoint-4\.pt was not written .* the "
                         r"newest good checkpoint is \S*checkpoint-2\.pt", text), text[-4000:]
    # The next save went ahead (and --keep-last-k 1 then kept the newest only).
    assert re.search(r"\(0/2\) saved \S*checkpoint-6\.pt", text)
    assert sorted(p.name for p in full.glob("checkpoint-*.pt")) == ["checkpoint-12.pt"]
    assert not list(full.glob(".*.tmp"))
    # A failed save does not change training: the same parameters as without it.
    for name, tensor in per_rank[0]["clean"]["params"].items():
        torch.testing.assert_close(per_rank[0]["full"]["params"][name], tensor, rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_a_real_file_size_limit_fails_saves_until_it_is_lifted(tmp_path):
    """RLIMIT_FSIZE set on the running trainer (as a quota or `ulimit -f` would): its
    checkpoint writes fail for real (EFBIG, not SIGXFSZ), then succeed once lifted."""
    exp = tmp_path / "exp"
    cmd = [sys.executable, str(REPO / "bin" / "trainer.py"), *TINY_MODEL, "--exp-dir", str(exp),
           "--synthetic-data", "1600", "--synthetic-batch-size", "4", "--num-epochs", "1",
           "--log-interval", "50", "--save-every-n", "25", "--keep-last-k", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    limited = False
    try:
        wait_for(lambda: (exp / "checkpoint-25.pt").exists(), proc)
        unlimited = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1 << 20, unlimited[1]))  # 1 MiB
        limited = True
        wait_for(lambda: "could not write checkpoint" in log_text(exp), proc)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, unlimited)
        limited = False
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    failed = re.findall(r"could not write checkpoint \S*checkpoint-(\d+)\.pt: EFBIG: File too large",
                        out)
    assert failed, out[-4000:]
    names = {p.name for p in exp.glob("checkpoint-*.pt")}
    assert "checkpoint-25.pt" in names and not any(f"checkpoint-{n}.pt" in names for n in failed)
    assert "checkpoint-400.pt" in names  # saves went on after the limit was lifted
    assert not list(exp.glob(".*.tmp"))
    assert load_checkpoint(exp / "checkpoint-25.pt")["step"] == 25  # older ones intact
    assert not limited


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the trainer ended first:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_keep_last_k_never_deletes_the_last_good_checkpoint(tmp_path):
    for step in (2, 4):
        save_checkpoint(tmp_path / f"checkpoint-{step}.pt",
                        make_payload(model={"w": torch.zeros(2)}, step=step, epoch=1, train_stage=1))
    # A newer file that is not a good checkpoint (truncated by an old writer, a disk error).
    good = (tmp_path / "checkpoint-4.pt").read_bytes()
    (tmp_path / "checkpoint-6.pt").write_bytes(good[: len(good) // 2])
    removed = remove_old_checkpoints(tmp_path, keep_last_k=1)
    assert [p.name for p in removed] == ["checkpoint-2.pt"]
    assert (tmp_path / "checkpoint-6.pt").exists()  # left for the user to inspect
    path, resumed = find_latest_checkpoint(tmp_path)
    assert path.name == "checkpoint-4.pt" and resumed["step"] == 4


@pytest.mark.timeout(120)
def test_preemption_whose_checkpoint_cannot_be_written_exits_18(tmp_path):
    from valle.train.preemption import EXIT_PREEMPTED_NO_CHECKPOINT

    exp = tmp_path / "exp"
    cmd = [sys.executable, str(REPO / "bin" / "trainer.py"), *TINY_MODEL, "--exp-dir", str(exp),
           "--synthetic-data", "4000", "--synthetic-batch-size", "4", "--num-epochs", "1",
           "--log-interval", "5", "--save-every-n", "100000", "--inject-fault", "disk@save:1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "step 5 |" in log_text(exp), proc)
        proc.terminate()  # SIGTERM
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED_NO_CHECKPOINT, out[-4000:]
    assert "could not write checkpoint" in out and "its checkpoint could not be written" in out
    assert not list(exp.glob("checkpoint-*.pt")) and not list(exp.glob(".*.tmp"))

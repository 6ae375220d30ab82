"""Graceful preemption end to end: a signal, one checkpoint at a step boundary, exit 17,
and a requeued run that redoes no step (issue: preemption, many nodes, storage faults).

Real processes (torchrun, gloo on CPU, the tiny model), each under a hard subprocess
timeout and a pytest timeout. The signal is sent while a rank is provably inside a
step or a validation: an injected stall holds it there (`stall@STEP[xK]:1`, a short
sleep) and the test waits for the stall's log line before signalling.

- SIGTERM to torchrun (which forwards it to every worker) in the middle of a step;
- SIGUSR1, twice, to one worker only, during validation (the second signal changes
  nothing);
- a grace period shorter than the step in flight: exit 18, nothing new written, the
  requeued run resumes from the last periodic checkpoint.

Each requeue is the same command; the result is compared with an uninterrupted run:
the trained-cut log, step by step, and the final parameters, optimizer state,
averaged model and sampler position.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.harness import clean_launch_env
from tests.support.logs import trained_cut_launches
from tests.support.scenarios import TINY_MODEL
from valle.train.preemption import EXIT_PREEMPTED, EXIT_PREEMPTED_NO_CHECKPOINT

pytestmark = [pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[2]
# 48 cuts in global batches of 8 over 2 ranks: 6 steps per epoch, 2 epochs.
NUM_EPOCHS, STEPS_PER_EPOCH = 2, 6
STALL_S = 2.0


def command(exp_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", "--max-restarts", "0", "--monitor-interval", "0.2",
            str(REPO / "bin" / "trainer.py"), *TINY_MODEL, "--exp-dir", str(exp_dir),
            "--synthetic-data", "48", "--synthetic-batch-size", "8", "--num-epochs",
            str(NUM_EPOCHS), "--log-interval", "1", "--base-lr", "0.01", "--warmup-steps", "2",
            "--average-period", "1", "--log-trained-cuts", "true", "--valid-interval", "3",
            "--stall-seconds", str(STALL_S), *extra]


def run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=clean_launch_env(), capture_output=True, text=True,
                          timeout=timeout)


def output(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_launch_env(), stdout=handle,
                            stderr=subprocess.STDOUT, text=True)
    proc.log_handle = handle
    return proc


def wait_for_log(log: Path, pattern: str, count: int = 1, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(re.findall(pattern, log.read_text())) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} x{count} not in the log after {timeout} s:\n"
                         f"{log.read_text()[-4000:]}")


def finish(proc: subprocess.Popen, timeout: float = 60) -> int:
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.log_handle.close()


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker with RANK=rank (from /proc: no psutil needed)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


def assert_same_final_state(reference_dir: Path, resumed_dir: Path) -> None:
    final = f"epoch-{NUM_EPOCHS}.pt"
    a = torch.load(reference_dir / final, map_location="cpu", weights_only=False)
    b = torch.load(resumed_dir / final, map_location="cpu", weights_only=False)
    assert a["step"] == b["step"] == NUM_EPOCHS * STEPS_PER_EPOCH
    for key in ("model", "model_avg"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            torch.testing.assert_close(b[key][name], a[key][name], rtol=1e-6, atol=1e-7,
                                       msg=lambda m, what=f"{key} {name}": f"{what}: {m}")
    for index, pa in a["optimizer"]["state"].items():
        for k, value in pa.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(b["optimizer"]["state"][index][k], value, rtol=1e-6,
                                           atol=1e-7, equal_nan=True)
            else:
                assert b["optimizer"]["state"][index][k] == value
    assert a["scheduler"] == b["scheduler"]
    assert a["sampler"] == b["sampler"]


def assert_no_step_redone(reference_dir: Path, resumed_dir: Path, stopped_after: int,
                          first_launch: str) -> None:
    """The first launch trained steps 0..stopped_after, the requeue went on from the next
    one: the trained-cut log of both launches is the uninterrupted run's, every step
    once with the same cuts (a redone step would repeat its index)."""
    stops = re.findall(r"preempted: stopped after step (\d+)", first_launch)
    assert stops == [str(stopped_after + 1)] * 2  # both ranks, after the same step
    for rank in (0, 1):
        assert trained_cut_launches(resumed_dir, rank) == trained_cut_launches(reference_dir, rank)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    exp = tmp_path_factory.mktemp("preempt") / "uninterrupted"
    proc = run(command(exp))
    assert proc.returncode == 0, output(proc)
    return exp


@pytest.mark.timeout(300)
def test_sigterm_to_torchrun_mid_step_saves_at_the_boundary_and_resumes_exactly(
        tmp_path, reference):
    exp, log = tmp_path / "preempted", tmp_path / "launch1.log"
    stall_step = 4  # rank 1 sleeps inside step 4's forward; rank 0 waits in its vote
    cmd = command(exp, "--inject-fault", f"stall@{stall_step}:1")
    proc = start(cmd, log)
    wait_for_log(log, r"\(1/2\) injected stall")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    finish(proc)
    took = time.monotonic() - signalled
    text = log.read_text()
    # Both ranks finished step 4 (whose vote carried the flag) and stopped together.
    for rank in (0, 1):
        assert f"({rank}/2) preempted: stopped after step {stall_step + 1}" in text, text[-6000:]
    assert (exp / f"checkpoint-{stall_step + 1}.pt").exists()
    assert not list(exp.glob(".*.tmp"))
    assert took < 25, f"SIGTERM to exit took {took:.1f} s (grace 25 s)"

    again = run(cmd)  # the requeue: the very same command
    assert again.returncode == 0, output(again)
    assert re.search(rf"resuming from \S*checkpoint-{stall_step + 1}\.pt", again.stdout + again.stderr)
    assert_no_step_redone(reference, exp, stall_step, text)
    assert_same_final_state(reference, exp)


@pytest.mark.timeout(300)
def test_sigusr1_to_one_worker_during_validation_twice(tmp_path, reference):
    exp, log = tmp_path / "preempted", tmp_path / "launch1.log"
    # --valid-interval 3: validation runs after step index 2. stall@2x2:1 sleeps in step
    # 2's forward, then again in the validation's first batch (the same step window).
    cmd = command(exp, "--inject-fault", "stall@2x2:1")
    proc = start(cmd, log)
    wait_for_log(log, r"\(1/2\) injected stall", count=2)
    rank1 = worker_pid(proc.pid, 1)
    os.kill(rank1, signal.SIGUSR1)
    time.sleep(0.2)
    os.kill(rank1, signal.SIGUSR1)  # a second signal changes nothing
    code = finish(proc)
    text = log.read_text()
    assert code != 0  # torchrun reports its workers' exit 17 as a failure
    # Said in the validation's vote: no rank takes the partial loss as a best model.
    for rank in (0, 1):
        assert (f"({rank}/2) validation at step 3 cut short by a preemption signal on 1 rank(s)"
                in text), text[-6000:]
    assert not (exp / "best-valid-loss.pt").exists()
    # The next step's vote carried rank 1's flag: both ranks stop after step index 3.
    for rank in (0, 1):
        assert f"({rank}/2) preempted: stopped after step 4" in text, text[-6000:]
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", text)
    assert codes and set(codes) == {str(EXIT_PREEMPTED)}, text[-3000:]
    assert text.count("saved") and len(re.findall(r"\(0/2\) saved \S*checkpoint-4\.pt", text)) == 1

    again = run(cmd)
    assert again.returncode == 0, output(again)
    assert_no_step_redone(reference, exp, 3, text)
    assert_same_final_state(reference, exp)


@pytest.mark.timeout(300)
def test_grace_shorter_than_the_step_in_flight_exits_18_and_writes_nothing(tmp_path, reference):
    exp, log = tmp_path / "preempted", tmp_path / "launch1.log"
    cmd = command(exp, "--save-every-n", "2", "--preempt-grace-s", "1",
                  "--inject-fault", "stall@4:1", "--stall-seconds", "30")
    proc = start(cmd, log)
    wait_for_log(log, r"\(1/2\) injected stall")
    signalled = time.monotonic()
    rank0, rank1 = worker_pid(proc.pid, 0), worker_pid(proc.pid, 1)
    os.kill(rank0, signal.SIGTERM)
    os.kill(rank1, signal.SIGTERM)
    finish(proc)
    took = time.monotonic() - signalled
    text = log.read_text()
    assert took < 10, f"{took:.1f} s: the deadline did not cut the 30 s step short"
    # The stalled rank stops at its deadline (18). Its peer, signalled too, either reaches
    # its own deadline (18) or first sees the stalled rank's connection close (14): a race
    # with the same outcome, nothing written.
    assert "(1/2) preemption: the grace period" in text, text[-4000:]
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", text))
    assert str(EXIT_PREEMPTED_NO_CHECKPOINT) in codes, text[-3000:]
    assert codes <= {str(EXIT_PREEMPTED_NO_CHECKPOINT), "14"}, text[-3000:]
    # Nothing new: the periodic checkpoints of steps 2 and 4 only, no temporary file left
    # that a resume could pick.
    assert sorted(p.name for p in exp.glob("checkpoint-*.pt")) == ["checkpoint-2.pt",
                                                                    "checkpoint-4.pt"]
    assert not list(exp.glob(".*.tmp"))

    again = run(command(exp, "--save-every-n", "2"))
    assert again.returncode == 0, output(again)
    assert re.search(r"resuming from \S*checkpoint-4\.pt", again.stdout + again.stderr)
    assert_same_final_state(reference, exp)


# -- egs/slurm/train.sbatch: the batch script's trap, forwarding and requeue ---------------

FAKE_SRUN = """#!/usr/bin/env bash
# srun stand-in: drop srun's own options, run the task here (one node).
while [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol stand-in: the head node's address, and a log of requeue requests.
case "$1" in
  show) echo 127.0.0.1 ;;
  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
esac
"""


@pytest.mark.timeout(300)
def test_sbatch_script_forwards_the_notice_checkpoints_and_requeues(tmp_path, reference):
    from tests.support.harness import free_port

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    exp, log, requeues = tmp_path / "slurm", tmp_path / "job1.log", tmp_path / "requeues"
    env = {**clean_launch_env(), "PATH": f"{fake_bin}:{os.environ['PATH']}",
           "SCONTROL_LOG": str(requeues), "PYTHON": sys.executable, "VALLE_ROOT": str(REPO),
           "GPUS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node001", "RDZV_PORT": str(free_port())}
    # The trainer's flags, as a user passes them to sbatch (the launcher is the script's).
    trainer_flags = command(exp, "--inject-fault", "stall@4:1")[command(exp).index(
        str(REPO / "bin" / "trainer.py")) + 1:]
    script = ["bash", str(REPO / "egs" / "slurm" / "train.sbatch"), *trainer_flags]
    with open(log, "w") as handle:
        job = subprocess.Popen(script, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
        try:
            wait_for_log(log, r"\(1/2\) injected stall")
            job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@90 does
            assert job.wait(60) == 0, log.read_text()[-6000:]
        finally:
            if job.poll() is None:
                job.kill()
    text = log.read_text()
    assert "valle: preemption notice" in text
    for rank in (0, 1):
        assert f"({rank}/2) preempted: stopped after step 5" in text, text[-6000:]
    assert requeues.read_text() == "requeue 4242\n"

    again = subprocess.run(script, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, output(again)
    assert re.search(r"resuming from \S*checkpoint-5\.pt", again.stdout + again.stderr)
    assert requeues.read_text() == "requeue 4242\n"  # a finished job is not requeued
    assert_no_step_redone(reference, exp, 4, text)
    assert_same_final_state(reference, exp)

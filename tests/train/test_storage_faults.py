"""A full or failing disk (valle/train/storage.py): every write of the trainer -
checkpoints, best models, summaries, the quarantine list, OOM reports, cut lists,
TensorBoard, samples, the log file - fails as one line naming the file, the error and
the newest good checkpoint, never a traceback. A failed checkpoint is agreed across
ranks and survived: training goes on unchanged, the older checkpoints stay loadable,
the next save tries again, no partial file is left for a resume to pick, and
--keep-last-k never costs the last good checkpoint. A run whose last checkpoint, or
--max-failed-saves checkpoints in a row, could not be written exits 20 on every rank,
and the same command resumes from the newest good checkpoint."""

from __future__ import annotations

import errno
import logging
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.harness import clean_launch_env, run_world, values
from tests.support.scenarios import TINY_MODEL, exit_worker, matrix_worker
from valle.train.checkpoint import (
    find_latest_checkpoint,
    load_checkpoint,
    make_payload,
    readable_checkpoints,
    remove_old_checkpoints,
    save_checkpoint,
)
from valle.train.cli import parse_config
from valle.train.loop import main_from_config
from valle.train.storage import EXIT_UNSAVED

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
    # every rank knows, and names the checkpoint a resume would use; rank 0 in its one line
    assert re.search(r"\(0/2\) could not write checkpoint \S*checkpoint-4\.pt: .* the newest good "
                     r"checkpoint is \S*checkpoint-2\.pt", text), text[-4000:]
    assert re.search(r"\(1/2\) checkpoint \S*checkpoint-4\.pt was not written .* the "
                     r"newest good checkpoint is \S*checkpoint-2\.pt", text), text[-4000:]
    assert len(re.findall(r"checkpoint-4\.pt", text)) == 2  # said once per rank
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


# -- every write under one policy ------------------------------------------------------

def small_argv(exp: Path, *extra: str) -> list[str]:
    # 24 cuts in batches of 4 on one rank: 6 steps per epoch, 2 epochs. The 8 checkpoint
    # saves: checkpoint-2, -4, -6, epoch-1, checkpoint-8, -10, -12, epoch-2.
    return TINY_MODEL + ["--exp-dir", str(exp), "--synthetic-data", "24", "--synthetic-batch-size",
                         "4", "--num-epochs", "2", "--log-interval", "2", "--valid-interval", "3",
                         "--save-every-n", "2", "--keep-last-k", "0", *extra]


def run_trainer(argv: list[str], caplog) -> tuple[int, str]:
    """bin/trainer.py's path in this process: the exit code and the log. No record may
    carry a traceback (an exception escaping main_from_config fails the test itself)."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        code = main_from_config(parse_config(argv))
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert not tracebacks, tracebacks
    return code, caplog.text


INJECTED = r": ENOSPC: No space left on device \(injected\); "
NEWEST = r"; the newest good checkpoint is \S*(checkpoint|epoch)-\d+\.pt"
WRITES_IN_TURN = {  # fault: (extra flags, the one error line, the file that must not exist)
    "disk@save:2": ([], r"could not write checkpoint \S*checkpoint-4\.pt" + INJECTED
                    + r"training goes on, the next save tries again \(1 failed in a row" + r".*" + NEWEST,
                    "checkpoint-4.pt"),
    "disk@best:2": ([], r"could not write best model \S*best-\w+-loss\.pt" + INJECTED
                    + "training goes on without it" + NEWEST, None),
    "disk@summary:1": ([], r"could not write summary \S*epoch-1-summary-rank0\.json" + INJECTED
                       + "training goes on without it" + NEWEST, "epoch-1-summary-rank0.json"),
    "disk@summary:3": ([], r"could not write summary \S*/summary-rank0\.json" + INJECTED
                       + "training goes on without it" + NEWEST, "summary-rank0.json"),
    "disk@tensorboard:3": (["--tensorboard", "true", "--valid-samples", "0"], r"could not write TensorBoard events "
                           r"\S*tensorboard/stage0" + INJECTED + "training goes on without it"
                           + NEWEST, None),
    "disk@samples:1": (["--tensorboard", "true", "--valid-samples", "1",
                        "--valid-samples-max-seconds", "1"],
                       r"could not write validation samples \S*" + INJECTED
                       + "training goes on without it" + NEWEST, None),
    "disk@quarantine:1": (["--inject-fault", "forward@cut=syn-00009"],
                          r"could not write quarantine list \S*quarantine\.jsonl" + INJECTED
                          + "training goes on without it" + NEWEST, "quarantine.jsonl"),
    "disk@oom:2": (["--inject-fault", "forward@5"], r"could not write OOM report \S*oom/batch-step5-"
                   r"\S*\.pt" + INJECTED + "training goes on without it" + NEWEST, None),
    "disk@oom:3": (["--inject-fault", "forward@5"], r"could not write OOM report \S*oom/events-rank0"
                   r"\.jsonl" + INJECTED + "training goes on without it" + NEWEST,
                   "oom/events-rank0.jsonl"),
    "disk@report:5": (["--log-trained-cuts", "true"], r"could not write cut list \S*trained-cuts-"
                      r"rank0\.tsv" + INJECTED + "training goes on without it" + NEWEST, None),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", list(WRITES_IN_TURN))
def test_each_write_that_fails_is_said_once_and_the_run_ends_well(tmp_path, caplog, fault):
    extra, line, missing = WRITES_IN_TURN[fault]
    exp = tmp_path / "exp"
    code, text = run_trainer(small_argv(exp, "--inject-fault", fault, *extra), caplog)
    assert code == 0, text[-4000:]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and re.search(line, errors[0]), errors  # once, with file and error
    assert "never fired" not in text
    if missing is not None:
        assert not (exp / missing).exists()
    assert load_checkpoint(exp / "epoch-2.pt")["step"] == 12  # the final state is on disk
    assert not list(exp.rglob(".*.tmp"))


@pytest.mark.timeout(120)
def test_a_run_whose_final_state_is_not_written_exits_20_and_resumes(tmp_path, caplog):
    exp = tmp_path / "exp"
    code, text = run_trainer(small_argv(exp, "--inject-fault", "disk@save:8"), caplog)
    assert code == EXIT_UNSAVED == 20, text[-4000:]
    assert re.search(r"the run's final state \(\S*epoch-2\.pt\) could not be written\. The newest good "
                     r"checkpoint is \S*checkpoint-12\.pt; .* run the same command", text), text[-4000:]
    assert "done:" not in text and not (exp / "epoch-2.pt").exists()
    code, text = run_trainer(small_argv(exp), caplog)  # the disk has room again
    assert code == 0 and re.search(r"resuming from \S*checkpoint-12\.pt", text), text[-4000:]
    assert load_checkpoint(exp / "epoch-2.pt")["step"] == 12


@pytest.mark.timeout(120)
def test_persistent_disk_trouble_stops_at_max_failed_saves_and_resumes(tmp_path, caplog):
    exp = tmp_path / "exp"
    # every save from the 2nd on fails: checkpoint-4 and -6 (2 in a row) stop the run
    argv = small_argv(exp, "--inject-fault", "disk@save:2x100", "--max-failed-saves", "2")
    code, text = run_trainer(argv, caplog)
    assert code == EXIT_UNSAVED, text[-4000:]
    assert "1 failed in a row; the run stops at --max-failed-saves 2" in text
    assert re.search(r"could not write checkpoint \S*checkpoint-6\.pt: .* 2 failed in a row "
                     r"\(--max-failed-saves 2\): the run stops", text), text[-4000:]
    assert re.search(r"2 checkpoint saves in a row could not be written \(the last: \S*checkpoint-6\.pt; "
                     r"--max-failed-saves 2;.* The newest good checkpoint is \S*checkpoint-2\.pt",
                     text), text[-4000:]
    assert "step 8 |" not in text  # stopped at the failed save, not hours later
    assert [p.name for p in readable_checkpoints(exp)] == ["checkpoint-2.pt"]
    code, text = run_trainer(small_argv(exp), caplog)
    assert code == 0 and re.search(r"resuming from \S*checkpoint-2\.pt", text), text[-4000:]
    # --max-failed-saves 0: never stops for it, but the last save decides the exit code
    code, _ = run_trainer(small_argv(tmp_path / "zero", "--inject-fault", "disk@save:2x5",
                                     "--max-failed-saves", "0"), caplog)
    assert code == 0


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_on_two_ranks_rank_0s_failed_saves_stop_both_ranks_with_20_and_nothing_hangs(tmp_path):
    runs = [("final", argv(tmp_path / "final", "--inject-fault", "disk@save:8", "--keep-last-k", "0")),
            ("persistent", argv(tmp_path / "persistent", "--inject-fault", "disk@save:2x100")),
            ("best", argv(tmp_path / "best", "--inject-fault", "disk@best:1"))]
    codes = values(run_world(exit_worker, 2, runs, timeout=240))  # a hang fails here
    assert codes == [{"final": 20, "persistent": 20, "best": 0}] * 2, codes
    text = log_text(tmp_path / "persistent")
    for rank in (0, 1):  # the same stop on both ranks, naming the newest good checkpoint
        assert re.search(rf"\({rank}/2\) 3 checkpoint saves in a row could not be written .* The "
                         r"newest good checkpoint is \S*checkpoint-2\.pt", text), text[-4000:]
    assert [p.name for p in readable_checkpoints(tmp_path / "final")][0] == "checkpoint-12.pt"


# -- a real full disk ----------------------------------------------------------------------

def can_mount_tmpfs() -> str | None:
    """Why a private tmpfs cannot be made here (None: it can): unshare -rm needs user
    namespaces, which some containers and CI runners forbid."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"unshare -rm + mount tmpfs: {probe.stderr.strip()}"


@pytest.mark.timeout(240)
def test_a_real_full_tmpfs_stops_the_run_with_20_and_the_directory_resumes(tmp_path):
    why = can_mount_tmpfs()
    if why is not None:
        pytest.skip(f"cannot make a small tmpfs here ({why})")
    mnt, out = tmp_path / "mnt", tmp_path / "copied"
    mnt.mkdir()
    # 18 MiB: the logs, TensorBoard and three 5 MiB checkpoints fit, the 4th does not.
    trainer = [sys.executable, str(REPO / "bin" / "trainer.py"),
               *small_argv(mnt / "exp", "--tensorboard", "true", "--valid-samples", "0",
                          "--keep-last-k", "100")]
    script = ('mount -t tmpfs -o size=18m tmpfs "$0" || exit 99; "$@"; rc=$?; '
              f'cp -a "$0/exp" {out}; exit $rc')
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mnt), *trainer], cwd=REPO,
                          env=clean_launch_env(), capture_output=True, text=True, timeout=180)
    text = done.stdout + done.stderr
    assert done.returncode == EXIT_UNSAVED, text[-4000:]
    assert "Traceback" not in text and "Logging error" not in text, text[-4000:]
    failed = re.findall(r"could not write checkpoint \S*/(checkpoint-\d+\.pt|epoch-\d\.pt): ENOSPC: No "
                        r"space left on device; ", text)
    assert len(failed) == 3, text[-4000:]  # --max-failed-saves 3 (the default)
    newest = readable_checkpoints(out)[0]
    assert f"The newest good checkpoint is {mnt / 'exp' / newest.name};" in text, text[-4000:]
    assert not list(out.glob(".*.tmp")) and not any((out / name).exists() for name in failed)
    # The directory, moved to a disk with room, resumes from the newest good checkpoint.
    resumed = subprocess.run([sys.executable, str(REPO / "bin" / "trainer.py"), *small_argv(out)],
                             cwd=REPO, env=clean_launch_env(), capture_output=True, text=True,
                             timeout=180)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert f"resuming from {newest}" in resumed.stdout + resumed.stderr
    assert load_checkpoint(out / "epoch-2.pt")["step"] == 12


# -- the writers alone, on a real ENOSPC (/dev/full) ------------------------------------

def test_the_log_file_on_a_full_disk_says_so_once_without_tracebacks(capfd):
    from valle.train.metrics import LogFile

    handler = LogFile("/dev/full")
    log = logging.getLogger("test.storage.logfile")
    log.addHandler(handler)
    try:
        for k in range(3):
            log.error("record %d", k)
    finally:
        log.removeHandler(handler)
        handler.close = lambda: None  # its stream cannot be flushed either
    err = capfd.readouterr().err
    assert err.count("could not write the log file /dev/full: ENOSPC") == 1, err
    assert "Traceback" not in err and "Logging error" not in err


def test_a_quarantine_entry_that_cannot_be_appended_is_said_and_kept(tmp_path, caplog):
    from valle.train.resilience.quarantine import Quarantine

    q = Quarantine(tmp_path / "quarantine.jsonl")
    (tmp_path / "quarantine.jsonl").symlink_to("/dev/full")  # after the start-up read
    with caplog.at_level(logging.INFO):
        q.add("cut-1", reason="oom alone", step=3, rank=0)
    assert re.search(r"could not write quarantine list \S*quarantine\.jsonl: ENOSPC", caplog.text)
    assert [e["cut_id"] for e in q.state()] == ["cut-1"]  # still in every checkpoint's payload


def test_tensorboard_on_a_full_disk_says_it_and_writes_again_once_there_is_room(tmp_path, caplog,
                                                                                 capfd, monkeypatch):
    from tensorboard.compat.tensorflow_stub.io.gfile import LocalFileSystem

    from valle.train.metrics import TensorBoardLogger

    tb = TensorBoardLogger(tmp_path, enabled=True, rank=0)
    write = LocalFileSystem._write

    def full(self, filename, content, mode):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(LocalFileSystem, "_write", full)
    with caplog.at_level(logging.INFO):
        tb.scalars(1, {"loss": 1.0})
        tb.flush()  # the writer thread's failure reaches the trainer here (or at the next call)
        tb.scalars(2, {"loss": 2.0})  # a new writer, whose thread fails too
        tb.flush()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors  # once per writer that failed
    assert all(re.match(r"could not write TensorBoard events \S+: ENOSPC", e) for e in errors), errors
    monkeypatch.setattr(LocalFileSystem, "_write", write)
    tb.scalars(3, {"loss": 3.0})
    tb.close()
    assert "Traceback" not in capfd.readouterr().err  # the writer thread's is not printed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = set()
    for events in tmp_path.glob("events.out.tfevents.*"):
        board = EventAccumulator(str(events))
        board.Reload()
        steps |= {e.step for e in board.Scalars("loss")} if "loss" in board.Tags()["scalars"] else set()
    assert 3 in steps


def test_disk_faults_parse_and_refuse_unknown_writes():
    from valle.train.resilience.faults import parse_fault

    spec = parse_fault("disk@best:2x3:0,1")
    assert (spec.write, spec.step, spec.times, spec.ranks) == ("best", 2, 3, frozenset({0, 1}))
    assert parse_fault("disk@save:1").ranks == frozenset({0})
    with pytest.raises(ValueError, match="KIND one of save, best, summary"):
        parse_fault("disk@checkpoint:1")
    with pytest.raises(ValueError, match="N >= 1"):
        parse_fault("disk@save:0")

#!/usr/bin/env python3
"""Steps redone per preemption, and the time from SIGTERM to exit (`make bench`).

Two gloo ranks under torchrun train the tiny model on synthetic cuts with
--save-every-n 10. At step 27 (held there by a short injected stall, so every row
stops at the same point) torchrun gets SIGTERM, as from `scancel` or an eviction;
then the same command is run again, as a requeue does. Side by side:

- graceful: the trainer as it is (the signal is voted, one checkpoint, exit 17);
- no handler: the workers SIGKILLed at the same point, which is what a trainer that
  does not handle SIGTERM gets from torchrun; the requeue resumes from checkpoint 20.

Steps redone = steps in the trained-cuts logs of both launches - distinct steps.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.harness import clean_launch_env  # noqa: E402
from tests.support.scenarios import TINY_MODEL  # noqa: E402

STOP_STEP = 27


def command(exp: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", "--max-restarts", "0", "--monitor-interval", "0.2",
            str(ROOT / "bin" / "trainer.py"), *TINY_MODEL, "--exp-dir", str(exp),
            "--synthetic-data", "400", "--synthetic-batch-size", "8", "--num-epochs", "1",
            "--log-interval", "1", "--save-every-n", "10", "--log-trained-cuts", "true",
            "--inject-fault", f"stall@{STOP_STEP - 1}:1", "--stall-seconds", "1"]


def wait_for(path: Path, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text()):
            return
        time.sleep(0.02)
    raise TimeoutError(pattern)


def workers(launcher: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == launcher:
                pids.append(int(entry.name))
    return pids


def preempt_and_requeue(exp: Path, graceful: bool) -> tuple[float, int]:
    log = exp.parent / f"{exp.name}.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(command(exp), cwd=ROOT, env=clean_launch_env(), stdout=handle,
                                stderr=subprocess.STDOUT)
        wait_for(log, r"\(1/2\) injected stall")
        sent = time.monotonic()
        if graceful:
            proc.send_signal(signal.SIGTERM)
        else:
            for pid in workers(proc.pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(120)
        to_exit = time.monotonic() - sent
    subprocess.run(command(exp), cwd=ROOT, env=clean_launch_env(), capture_output=True,
                   timeout=300, check=True)
    steps = [int(line.split("\t")[0])
             for line in (exp / "trained-cuts-rank0.tsv").read_text().splitlines()]
    return to_exit, len(steps) - len(set(steps))


def main() -> None:
    shown = " ".join(command(Path("EXP"))).replace(sys.executable, "python").replace(f"{ROOT}/", "")
    print(f"Each launch: `{shown}`; SIGTERM to torchrun at step {STOP_STEP}, then the same "
          "command again.")
    print()
    print("| stop | steps redone per preemption | signal to exit (s) |")
    print("| --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, graceful in (("SIGTERM, graceful (this trainer)", True),
                               ("SIGKILL at the same point (no handler)", False)):
            seconds, redone = preempt_and_requeue(Path(tmp) / name.split(",")[0].split()[0], graceful)
            print(f"| {name} | {redone} | {seconds:.1f} |")


if __name__ == "__main__":
    main()

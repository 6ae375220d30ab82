"""`--collective-timeout`: a peer that never joins a collective becomes an error, not a hang.

Two ranks under torchrun (gloo on CPU), each run under a hard subprocess timeout:

- the trainer: rank 1 stalls inside a step far longer than the timeout, with
  the watchdog out of the way; rank 0, waiting in the step's vote, must fail
  within the collective timeout;
- every kind of collective the trainer issues (valle.train.dist's wrappers, the
  bucketed async all_reduce, all_gather_object of the sampler state, the repair
  broadcasts, barrier), each on its own group, with the peer absent: each must
  raise within the timeout. (Measured with torch 2.9.1: gloo honours the timeout
  for all of them, raising "Timed out waiting ...ms" after the timeout.)
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.harness import clean_launch_env
from tests.support.scenarios import TINY_MODEL

pytestmark = [pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 5.0



def torchrun(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "0", "--monitor-interval", "0.2", *argv]
    return subprocess.run(cmd, cwd=REPO, env=clean_launch_env(), capture_output=True, text=True,
                          timeout=timeout)


def output(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-5000:]}"


def clock(text: str) -> float:
    """Seconds since midnight of an 'HH:MM:SS.fff' (or ',fff') time of day."""
    t = dt.datetime.strptime(text.replace(",", "."), "%H:%M:%S.%f")
    return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6


@pytest.mark.timeout(120)
def test_trainer_rank_errors_out_when_its_peer_never_joins(tmp_path):
    exp = tmp_path / "exp"
    started = time.monotonic()
    proc = torchrun(
        str(REPO / "bin" / "trainer.py"), *TINY_MODEL, "--exp-dir", str(exp),
        "--synthetic-data", "48", "--synthetic-batch-size", "8", "--num-epochs", "1",
        "--log-interval", "1", "--inject-fault", "stall@3:1", "--stall-seconds", "600",
        "--stall-min-seconds", "1000",  # the watchdog stays out of it
        "--collective-timeout", str(TIMEOUT), timeout=90)
    elapsed = time.monotonic() - started
    logs = proc.stdout + proc.stderr
    assert proc.returncode != 0, output(proc)
    stalled = re.search(r"(\d\d:\d\d:\d\d,\d+) WARNING .*\(1/2\) injected stall", logs)
    assert stalled, output(proc)
    # Rank 0 failed in a collective on the timeout, reported as a peer failure (exit 14).
    failed = re.search(r"(\d\d:\d\d:\d\d,\d+) ERROR .*\(0/2\) a peer rank failed or hung "
                       r"\(collective timeout 5 s\): .*(Timed out|timeout)", logs, re.IGNORECASE)
    assert failed, output(proc)
    assert re.search(r"failed \(exitcode: 14\) local_rank: 0", logs), output(proc)
    # From the stall to rank 0's error: the timeout. (torchrun's own report comes later:
    # it SIGTERMs the stalled rank, which stops at its preemption deadline, exit 18.)
    waited = clock(failed.group(1)) - clock(stalled.group(1))
    assert TIMEOUT - 0.5 < waited < TIMEOUT + 5, waited
    assert not list((exp / "log").glob("stall-rank*.txt"))  # it was not the watchdog
    assert elapsed < 60, f"{elapsed:.0f} s"  # start-up + the timeout, never the 600 s stall


PROBE = textwrap.dedent("""
    import datetime, json, os, sys, threading, time
    import torch
    import torch.distributed as dist
    from valle.train.dist import (DistContext, all_reduce_sum, barrier, broadcast_object,
                                  broadcast_tensors, gather_ints, init_distributed)
    from valle.train.sampler_state import gather_rank_states

    timeout, out = float(sys.argv[1]), sys.argv[2]
    ctx = init_distributed("cpu", timeout)
    kinds = {
        "all_reduce (vote)": lambda c: all_reduce_sum(torch.ones(4), c),
        "async all_reduce + wait (gradient buckets)":
            lambda c: dist.all_reduce(torch.ones(4), group=c.group, async_op=True).wait(),
        "all_gather (gather_ints)": lambda c: gather_ints([1, 2], c),
        "all_gather_object (sampler state)": lambda c: gather_rank_states({"a": 1}, c),
        "broadcast (repair)": lambda c: broadcast_tensors([torch.ones(4)], 1, c),
        "broadcast_object_list (repair)": lambda c: broadcast_object({"a": 1}, 1, c),
        "barrier": lambda c: barrier(c),
    }
    groups = {k: dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
              for k in kinds}
    if ctx.rank == 1:
        time.sleep(3 * timeout)  # never joins any of them
        os._exit(0)
    results = {}

    def probe(kind):
        c = DistContext(ctx.rank, ctx.world_size, ctx.local_rank, ctx.device, groups[kind])
        start = time.monotonic()
        try:
            kinds[kind](c)
            results[kind] = {"error": None, "seconds": time.monotonic() - start}
        except Exception as e:
            results[kind] = {"error": f"{type(e).__name__}: {e}"[:300],
                             "seconds": time.monotonic() - start}

    threads = [threading.Thread(target=probe, args=(k,), daemon=True) for k in kinds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(6 * timeout)
    for kind in kinds:
        results.setdefault(kind, {"error": "still waiting (hang)", "seconds": None})
    with open(out, "w") as f:
        json.dump(results, f)
    os._exit(0)
""")


@pytest.mark.timeout(120)
def test_every_collective_the_trainer_uses_honours_the_timeout(tmp_path):
    timeout = 2.0
    script, out = tmp_path / "probe.py", tmp_path / "probe.json"
    script.write_text(PROBE)
    proc = torchrun(str(script), str(timeout), str(out), timeout=90)
    assert proc.returncode == 0 and out.exists(), output(proc)
    results = json.loads(out.read_text())
    assert len(results) == 7
    for kind, r in results.items():
        assert r["error"] is not None and r["seconds"] is not None, (kind, r)
        assert "still waiting" not in r["error"], (kind, r)
        assert re.search(r"Timed out|timeout", r["error"], re.IGNORECASE), (kind, r)
        assert timeout - 0.2 < r["seconds"] < timeout + 3, (kind, r)

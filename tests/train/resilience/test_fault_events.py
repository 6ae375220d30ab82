"""Every `--inject-fault` OOM phase fires and leaves an OOM event (phase, step, rank);
a fault that never fired is said at the end of the run (issue: grad_sync@STEP:RANK
left no event in a 3-rank run).

The cause was shadowing: a fault fired only on attempt 0 of its step, so when an
earlier failure in the same step (another fault, a poisoned cut) ended attempt 0
before the fault's phase, the fault never fired and nothing said so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.harness import run_world, values
from tests.support.scenarios import TINY_MODEL, matrix_worker
from valle.train.cli import parse_config
from valle.train.resilience.faults import OOM_PHASES, FaultInjector, parse_fault

WORLD = 3
FAULT_STEP, FAULT_RANK = 2, 1


def base_argv(exp_dir: Path) -> list[str]:
    # 48 cuts in global batches of 6 (2 rows per rank): 8 steps, FAULT_STEP on every rank,
    # and no micro-batch of one cut (two one-off faults on one cut would quarantine it).
    return TINY_MODEL + [
        "--exp-dir", str(exp_dir), "--synthetic-data", str(16 * WORLD),
        "--synthetic-batch-size", "6", "--num-epochs", "1", "--log-interval", "1",
        "--check-consistency-every", "1", "--average-period", "1", "--bucket-cap-mb", "0.05",
    ]


def events(exp_dir: Path, rank: int) -> list[dict]:
    path = exp_dir / "oom" / f"events-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


SCENARIOS = {
    **{phase: [f"{phase}@{FAULT_STEP}:{FAULT_RANK}"] for phase in OOM_PHASES},
    # attempt 0 of the step ends in forward, before any later phase is reached
    "shadowed": [f"forward@{FAULT_STEP}:{FAULT_RANK}", f"grad_sync@{FAULT_STEP}:{FAULT_RANK}",
                 f"optimizer@{FAULT_STEP}:{FAULT_RANK}"],
    # never reached: a step past the end, a cut that is never drawn
    "unfired": [f"grad_sync@500:{FAULT_RANK}", "forward@cut=no-such-cut"],
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault-events")
    runs = []
    for name, faults in SCENARIOS.items():
        argv = base_argv(root / name)
        for fault in faults:
            argv += ["--inject-fault", fault]
        runs.append((name, argv))
    per_rank = values(run_world(matrix_worker, WORLD, runs, timeout=300))
    return root, per_rank


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", OOM_PHASES)
def test_each_phase_leaves_an_event_with_phase_step_rank(world, phase):
    root, per_rank = world
    for rank in range(WORLD):
        result = per_rank[rank][phase]
        assert result["ok"], result
        assert result["summary"]["unfired_faults"] == []
    got = [(e["phase"], e["step"], e["rank"]) for e in events(root / phase, FAULT_RANK)]
    assert got == [(phase, FAULT_STEP, FAULT_RANK)]
    for rank in set(range(WORLD)) - {FAULT_RANK}:
        assert events(root / phase, rank) == []


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_fault_behind_an_earlier_failure_fires_in_the_retry(world):
    root, per_rank = world
    assert all(per_rank[r]["shadowed"]["ok"] for r in range(WORLD))
    got = [(e["phase"], e["step"], e["attempt"]) for e in events(root / "shadowed", FAULT_RANK)]
    # forward ends attempt 0; attempt 1 reaches the gradient sync and fails there;
    # attempt 2 reaches the update, whose fault is retried locally within the attempt.
    assert got == [("forward", FAULT_STEP, 0), ("grad_sync", FAULT_STEP, 1),
                   ("optimizer", FAULT_STEP, 2)]
    assert per_rank[FAULT_RANK]["shadowed"]["summary"]["unfired_faults"] == []
    # nothing lost: every drawn cut was trained, on every rank
    for rank in range(WORLD):
        epoch = per_rank[rank]["shadowed"]["summary"]["epochs"][-1]
        assert epoch["cuts_trained"] == epoch["cuts_drawn"] == 16 * WORLD


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_faults_that_never_fired_are_reported_by_name(world):
    root, per_rank = world
    for rank in range(WORLD):
        unfired = per_rank[rank]["unfired"]["summary"]["unfired_faults"]
        expected = ["forward@cut=no-such-cut"]
        if rank == FAULT_RANK:
            expected = [f"grad_sync@500:{FAULT_RANK}", *expected]
        assert unfired == expected
    log = "".join(p.read_text() for p in (root / "unfired" / "log").glob("*"))
    assert f"--inject-fault grad_sync@500:{FAULT_RANK} never fired on rank {FAULT_RANK}" in log


def test_injector_counts_passes_not_attempts():
    faults = FaultInjector([parse_fault("forward@4"), parse_fault("grad_sync@4")], rank=0)
    faults.phases.begin_attempt(4, 0)
    with pytest.raises(Exception, match="phase=forward"):
        faults.maybe_fail("forward")
    faults.phases.begin_attempt(4, 1)  # attempt 0 never reached grad_sync: the retry does
    faults.maybe_fail("forward")  # already fired once: the retry passes it
    with pytest.raises(Exception, match="phase=grad_sync step=4 attempt=1"):
        faults.maybe_fail("grad_sync")
    faults.phases.begin_attempt(4, 2)
    faults.maybe_fail("grad_sync")
    assert faults.unfired() == []


def test_grad_sync_fault_is_refused_under_ddp(tmp_path):
    argv = TINY_MODEL + ["--exp-dir", str(tmp_path), "--synthetic-data", "8",
                         "--grad-sync", "ddp", "--inject-fault", "grad_sync@1"]
    with pytest.raises(ValueError, match="grad_sync@1: --grad-sync ddp has no grad_sync point"):
        parse_config(argv)

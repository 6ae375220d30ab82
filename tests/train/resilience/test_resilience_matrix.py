"""The OOM matrix: phase x world size x failing ranks, on gloo/CPU (issue: resilient step).

For every cell the run must finish (an OOM in the update phase, even on every
rank, is retried locally and resumes where it stopped), the
parameter/optimizer/scaler/averaged-model fingerprints must agree across ranks
after every step (--check-consistency-every 1 raises otherwise), every drawn
cut must be trained or quarantined, and - dropout 0 - the final parameters
must equal those of the same run without the fault.

One process group per world size runs the whole row, so the matrix costs three
spawns; each has a hard timeout, so a hang fails instead of freezing CI.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_world, values
from tests.support.scenarios import TINY_MODEL, matrix_worker
from valle.train.resilience.faults import OOM_PHASES

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

WORLD_SIZES = (1, 2, 4)
STEPS = 3
FAULT_STEP = 1


def failing_sets(world_size: int) -> dict[str, list[int]]:
    if world_size == 1:
        return {"all": [0]}
    return {"one": [world_size - 1], "some": list(range(0, world_size, 2)),
            "all": list(range(world_size))}


def base_argv(exp_dir, world_size: int) -> list[str]:
    return TINY_MODEL + [
        "--exp-dir", str(exp_dir), "--synthetic-data", str(8 * world_size * STEPS),
        "--synthetic-batch-size", str(4 * world_size), "--num-epochs", "1",
        "--max-steps", str(STEPS), "--check-consistency-every", "1", "--average-period", "1",
        "--base-lr", "0.01", "--warmup-steps", "2", "--log-interval", "1",
        # ~35 buckets of 50 kB: launching "the remaining buckets in order" really happens
        "--bucket-cap-mb", "0.05",
    ]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    results = {}
    for world_size in WORLD_SIZES:
        root = tmp_path_factory.mktemp(f"matrix-ws{world_size}")
        runs = [("clean", base_argv(root / "clean", world_size))]
        for phase in OOM_PHASES:
            for name, ranks in failing_sets(world_size).items():
                fault = f"{phase}@{FAULT_STEP}:{','.join(map(str, ranks))}"
                runs.append((f"{phase}/{name}",
                             base_argv(root / f"{phase}-{name}", world_size) + ["--inject-fault", fault]))
        per_rank = values(run_world(matrix_worker, world_size, runs, timeout=300))
        results[world_size] = per_rank
    return results


CELLS = [(phase, ws, failing) for ws in WORLD_SIZES for phase in OOM_PHASES
         for failing in failing_sets(ws)]


@pytest.mark.parametrize(("phase", "world_size", "failing"), CELLS,
                         ids=[f"{p}-ws{w}-{f}" for p, w, f in CELLS])
def test_matrix_cell(matrix, phase, world_size, failing):
    ranks = matrix[world_size]
    key = f"{phase}/{failing}"
    outcomes = [r[key] for r in ranks]
    assert all(o["ok"] for o in outcomes), [o.get("message") for o in outcomes]
    summaries = [o["summary"] for o in outcomes]
    assert all(s["steps"] == STEPS for s in summaries)
    # identical state on every rank at the end (and after every step: the run would have raised)
    assert len({tuple(sorted(s["fingerprints"].items())) for s in summaries}) == 1
    epoch = summaries[0]["epochs"][0]
    assert epoch["balanced"] and epoch["cuts_quarantined"] == 0
    assert epoch["cuts_trained"] == epoch["cuts_drawn"] == 4 * world_size * STEPS
    assert epoch["oom_events"] == (len(failing_sets(world_size)[failing]))
    # equivalence: the one-off OOM was retried, the result is the fault-free run's
    clean = ranks[0]["clean"]["params"]
    for name, tensor in outcomes[0]["params"].items():
        torch.testing.assert_close(tensor, clean[name], rtol=1e-4, atol=1e-5, msg=name)


def test_clean_runs_train(matrix, tmp_path):
    """The baseline itself must have moved the parameters (else equivalence is vacuous)."""
    from valle.models import get_model
    from valle.train.cli import parse_config

    for world_size in WORLD_SIZES:
        clean = matrix[world_size][0]["clean"]
        assert clean["summary"]["steps"] == STEPS
        assert clean["summary"]["epochs"][0]["oom_events"] == 0
        cfg = parse_config(base_argv(tmp_path, world_size))
        torch.manual_seed(cfg.seed)  # the trainer's initialisation
        initial = get_model(cfg.model).state_dict()
        moved = [k for k, v in clean["params"].items() if not torch.equal(v, initial[k])]
        assert len(moved) > len(initial) // 2, f"only {len(moved)} of {len(initial)} tensors trained"

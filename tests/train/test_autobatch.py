"""--max-duration auto on CPU, with the memory meter as the device (a simulated device of
--memory-budget-gb): the fit, the choice against the largest budget that fits (found by
bisection), an epoch within the budget, doubling the budget, agreement over ranks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.support.harness import run_world, values
from tests.support.scenarios import TINY_MODEL, agree_worker, train_worker
from valle.train import autobatch
from valle.train.autobatch import BatchShape, MemoryModel, Probe, fit_memory_model, largest_budget
from valle.train.cli import parse_config

pytestmark = pytest.mark.timeout(600)

BUDGET_GB = 0.03  # ~31 MiB: about 15 cuts per batch of the tiny model below


def argv(exp_dir, budget_gb=BUDGET_GB, *extra, cuts=64):
    return TINY_MODEL + ["--exp-dir", str(exp_dir), "--synthetic-data", str(cuts), "--num-epochs", "1",
                         "--max-duration", "auto", "--memory-budget-gb", str(budget_gb),
                         "--log-interval", "1", *map(str, extra)]


def built(exp_dir, budget_gb=BUDGET_GB, *extra):
    from valle.train.build import build_run
    from valle.train.dist import init_distributed

    cfg = parse_config(argv(exp_dir, budget_gb, *extra))
    run = build_run(cfg, init_distributed("cpu"))
    run.meter.stop()  # counted again inside the windows that ask (tests build several runs)
    return run


def largest_that_fits(run) -> int:
    """Bisection on the same machine: the largest batch budget whose pessimistic batches
    run without the meter (the "device") running out of memory."""
    source = autobatch.synthetic_source(run.cfg, run.ctx)

    def fits(budget: int) -> bool:
        with run.meter.active():
            probes = autobatch.probe_budget(run.stepper, run.meter, source, budget)
        return all(p.peak_bytes is not None for p in probes)

    lo, hi = 1, len(run.data.corpus)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


@pytest.fixture(scope="module")
def chosen_run(tmp_path_factory):
    return built(tmp_path_factory.mktemp("auto"))


TRUTH = MemoryModel(1000, {"constant": 500.0, "frames": 40.0, "text": 0.0, "cuts": 300.0,
                           "attention": 2.0})


def _probes(shapes):
    return [Probe(0, "x", s, 1000, int(TRUTH.predict(s))) for s in shapes]


def test_the_fit_recovers_a_known_memory_model_term_by_term():
    # Row lengths that vary independently: every feature is identifiable.
    shapes = [BatchShape(f * c, t * c, c, float(c * (f + t) ** 2))
              for c in (1, 2, 5) for f, t in ((50, 10), (120, 30), (80, 60), (200, 5))]
    model = fit_memory_model(_probes(shapes))
    for name, value in TRUTH.coef.items():
        assert model.coef[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert model.max_error < 1e-4


@pytest.mark.parametrize("lapack_pick", ["as_is", "another_exact_solution"])
def test_collinear_probes_fit_exactly_whichever_solution_lstsq_picks(monkeypatch, lapack_pick):
    # Two kinds of rows, each grown in proportion (as the scan probes): frames, text and
    # attention are all combinations of cuts and cuts x kind, so many coefficient sets fit
    # exactly, and which one lstsq returns for the rank-deficient whole depends on the
    # LAPACK build. CI once got 10,729 for 11,000 here. "another_exact_solution" plays
    # that other machine: lstsq adds a null-space vector to what it returns.
    if lapack_pick == "another_exact_solution":
        real = torch.linalg.lstsq

        def other_machine(a, b, **kwargs):
            result = real(a, b, **kwargs)
            _, sv, vh = torch.linalg.svd(a)
            if sv.numel() == a.shape[1] and sv[-1] > 1e-10 * sv[0]:
                return result  # full rank: the solution is unique
            return SimpleNamespace(solution=result.solution + 3.0 * vh[-1][:, None] * b.norm())
        monkeypatch.setattr(torch.linalg, "lstsq", other_machine)
    shapes = [BatchShape(f * c, t * c, c, float(c * (f + t) ** 2))
              for c in (1, 2, 4, 8) for f, t in ((50, 10), (120, 30))]
    model = fit_memory_model(_probes(shapes))
    for s in shapes:
        assert model.predict(s) == pytest.approx(TRUTH.predict(s), rel=1e-6)
    assert all(c >= 0 for c in model.coef.values())
    assert fit_memory_model(_probes(list(reversed(shapes)))).coef == pytest.approx(model.coef)
    # Grown in proportion: budget 4 x (limit - fixed) / growth per unit of budget.
    shape = shapes[-1]
    limit = TRUTH.predict(shape.scaled(3.0))
    budget, bound = largest_budget(model, {"worst": shape}, 1.0, limit)
    assert budget == pytest.approx(3.0, rel=1e-3) and bound == "worst"


def test_the_chosen_budget_is_at_least_90_percent_of_the_largest_that_fits(chosen_run):
    chosen = chosen_run.cfg.synthetic_batch_size
    largest = largest_that_fits(chosen_run)
    assert 0.9 * largest <= chosen <= largest, (chosen, largest)
    assert chosen_run.cfg.corpus_record["autobatch"]["budget"] == chosen


def test_an_oom_report_gives_the_predicted_peak_beside_the_budget(chosen_run):
    from valle.train.resilience.memory import OomEvent

    batch = chosen_run.data.pessimistic_batches()["longest audio"]
    event = chosen_run.stepper.reporter.report(
        OomEvent("forward", 0, 0, 0, 1, True, "test"), batch)
    assert event.memory["budget"] == int(BUDGET_GB * (1 << 30))
    assert 0 < event.memory["predicted_peak"] < event.memory["budget"]
    assert "predicted peak" in event.summary()


def test_doubling_the_memory_budget_gives_a_larger_batch_budget(chosen_run, tmp_path):
    doubled = built(tmp_path, 2 * BUDGET_GB)
    assert doubled.cfg.synthetic_batch_size > 1.5 * chosen_run.cfg.synthetic_batch_size


def test_activation_checkpointing_lets_auto_choose_a_larger_budget(chosen_run, tmp_path):
    recomputing = built(tmp_path, BUDGET_GB, "--activation-checkpointing")
    assert recomputing.cfg.synthetic_batch_size > chosen_run.cfg.synthetic_batch_size


@pytest.mark.parametrize("extra", [(), ("--train-stage", "1"), ("--train-stage", "2"),
                                   ("--dtype", "float16")], ids=["both", "ar", "nar", "fp16"])
def test_an_epoch_at_the_chosen_budget_fills_it_without_an_oom(tmp_path, extra):
    from valle.train.loop import train

    summary = train(parse_config(argv(tmp_path, BUDGET_GB, *extra))).to_json()
    budget = int(BUDGET_GB * (1 << 30))
    assert summary["memory_budget_bytes"] == budget
    assert 0.6 * budget <= summary["peak_memory_bytes"] <= budget
    assert summary["oom_events"] == 0 and summary["epochs"][0]["balanced"]
    written = json.loads((tmp_path / "summary-rank0.json").read_text())
    assert written["synthetic_batch_size"] == summary["synthetic_batch_size"] > 1
    assert written["peak_memory_bytes"] == summary["peak_memory_bytes"]


def test_two_ranks_agree_on_the_minimum(tmp_path):
    results = values(run_world(train_worker, 2, argv(tmp_path), timeout=540))
    sizes = {r["summary"]["synthetic_batch_size"] for r in results}
    assert len(sizes) == 1 and sizes.pop() >= 2
    assert all(r["summary"]["oom_events"] == 0 for r in results)


def test_every_rank_takes_the_smallest_proposal():
    assert values(run_world(agree_worker, 3, [40.0, 25.0, 31.0], timeout=120)) == [25.0] * 3


def test_auto_on_cpu_needs_a_memory_budget(tmp_path):
    from valle.train.build import build_run
    from valle.train.dist import init_distributed

    cfg = parse_config(TINY_MODEL + ["--exp-dir", str(tmp_path), "--synthetic-data", "8",
                                     "--max-duration", "auto"])
    with pytest.raises(ValueError, match="--memory-budget-gb"):
        build_run(cfg, init_distributed("cpu"))


def test_max_duration_flag_takes_auto_or_seconds():
    assert parse_config(["--synthetic-data", "8", "--max-duration", "auto"]).data.max_duration == "auto"
    assert parse_config(["--synthetic-data", "8", "--max-duration", "80"]).data.max_duration == 80.0
    with pytest.raises(SystemExit):
        parse_config(["--synthetic-data", "8", "--max-duration", "lots"])


def test_the_meter_runs_through_training_only_under_a_cpu_budget(tmp_path):
    from valle.train.build import build_run
    from valle.train.dist import init_distributed

    plain = build_run(parse_config(TINY_MODEL + ["--exp-dir", str(tmp_path), "--synthetic-data", "8"]),
                      init_distributed("cpu"))
    assert not plain.meter.running and plain.meter.budget_bytes == 0
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None

"""A strided allocation sweep (the whole one is `make oom-sweep`): the first
allocation of every phase of a step - forward, backward, bucket launches, the
vote, the GradScaler, the optimizer, validation, the consistency check, the
checkpoint, a repair - fails in its own run, and every run must survive:
ranks agree after every step, no cut is lost or quarantined, and the final
parameters equal the fault-free run's."""

from __future__ import annotations

import pytest

from tests.support.sweep import (
    SweepConfig,
    choose_points,
    classify,
    run_sweep,
    trainer_argv,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(600)]

CONFIGS = [
    # GradScaler path, every rank failing at the same allocation
    SweepConfig(world_size=2, scaler=True, failing="all", fault_step=1),
    # a damaged rank repaired from rank 0, with rank 0's allocations failing
    SweepConfig(world_size=2, scaler=False, failing="some", fault_step=1, scenario="repair"),
    # LoRA adapters on a frozen base: only they are bucketed, updated, averaged and repaired
    SweepConfig(world_size=2, scaler=False, failing="all", fault_step=1, scenario="lora"),
    # activation checkpointing: the recomputation allocates inside backward (every rank
    # failing: rank 0's census has the checkpoint save)
    SweepConfig(world_size=2, scaler=False, failing="all", fault_step=1,
                model_flags=("--activation-checkpointing",)),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_phase_survives_an_oom_at_its_first_allocation(cfg):
    result = run_sweep(cfg, mode="phases")
    phases = set().union(*(p.phases for p in result.points))
    assert {"forward", "backward", "optimizer", "validate/forward", "consistency",
            "checkpoint"} <= phases, phases
    # The recovery path (vote, repair, quarantine sharing) allocates nothing at all.
    assert not phases & {"vote", "repair", "quarantine", "gather"}, phases
    bad = [(p.index, p.phase, p.op, p.outcome, p.detail) for p in result.points
           if p.outcome != "survived"]
    assert not bad, bad


def test_an_oom_at_set_up_stops_every_rank_promptly_with_a_named_error():
    cfg = SweepConfig(world_size=2, failing="one", fault_step=-1)  # rank 1, building the run
    result = run_sweep(cfg, mode="phases", per_point_s=60)
    assert result.points and {p.phase for p in result.points} == {"startup"}
    assert all(p.outcome == "clean exit" and "StartupError" in p.detail for p in result.points), \
        result.points


def test_choose_points_hits_every_phase_and_op_kind():
    census = {0: [["forward", "mm"], ["forward", "add"], ["backward", "mm"], ["forward", "mm"]],
              1: [["forward", "mm"], ["vote", "x"]]}
    assert choose_points(census, [0], "phases") == {1: [("forward", "mm")], 3: [("backward", "mm")]}
    assert list(choose_points(census, [0], "kinds")) == [1, 2, 3]
    assert list(choose_points(census, [0], "ends")) == [1, 2, 3, 4]
    assert list(choose_points(census, [0], "phases", last=True)) == [3, 4]
    # rank 1's vote is at position 2, where rank 0 is in forward: labelled by rank 1
    assert choose_points(census, [0, 1], "phases") == {
        1: [("forward", "mm")], 2: [("vote", "x")], 3: [("backward", "mm")]}
    assert list(choose_points(census, [1], "all")) == [1, 2]


def test_classify_tells_the_outcomes_apart():
    cfg = SweepConfig()
    ok = {"status": "ok", "steps": cfg.expected_steps, "balanced": True, "quarantined": 0, "trained": 24,
          "drawn": 24, "equal": True, "fired": True}
    assert classify([ok, {**ok, "fired": False}], cfg)[0] == "survived"
    assert classify([{**ok, "fired": False}] * 2, cfg)[0] == "not hit"
    assert classify([ok, {**ok, "equal": False}], cfg)[0] == "lost"
    assert classify([ok, {**ok, "quarantined": 1}], cfg)[0] == "lost"
    assert classify([{"status": "crash", "detail": "RuntimeError: mismatch"}, ok], cfg)[0] == "crash"
    named = {"status": "named", "detail": "NoHealthyRankError: restart"}
    assert classify([named, named], cfg)[0] == "clean exit"
    assert classify([named, ok], cfg)[0] == "crash"  # some stopped, others went on


def test_model_flags_reach_the_swept_trainer_and_name_the_configuration(tmp_path):
    """`oom_sweep.py --model-flags`: the swept model takes them (e.g. the guided-attention loss,
    whose probe allocates in the forward) and the configuration's name (its cache key) says so."""
    plain = SweepConfig(1, False, "all", 1, "plain")
    guided = SweepConfig(1, False, "all", 1, "plain", ("--guided-attention-weight", "1"))
    argv = trainer_argv(tmp_path, guided, ["--inject-fault", "alloc@1:5:0"])
    assert argv[-4:] == ["--guided-attention-weight", "1", "--inject-fault", "alloc@1:5:0"]
    assert "--guided-attention-weight" not in trainer_argv(tmp_path, plain, [])
    assert guided.name == plain.name + " [--guided-attention-weight 1]"


@pytest.mark.timeout(120)
def test_the_fp16_comparison_knows_the_lora_adapters(tmp_path):
    """Under fp16 a point's weights are compared relative to the initial ones; in the lora
    scenario those include the adapters (a sweep without them lost every fp16 LoRA point to
    a KeyError in the harness, reported as 'no result from every rank')."""
    from tests.support.scenarios import train_worker
    from tests.support.sweep import _equal, _initial_params, write_lora_base

    cfg = SweepConfig(world_size=1, scaler=True, failing="all", fault_step=1, scenario="lora")
    write_lora_base(cfg)
    initial = _initial_params(cfg, tmp_path)
    trained = train_worker(0, 1, trainer_argv(tmp_path / "run", cfg, []))["params"]
    adapters = [k for k in trained if "lora_" in k]
    assert adapters and set(trained) <= set(initial)
    assert _equal(trained, trained, initial)
    moved = {k: v + 1.0 if k == adapters[0] else v for k, v in trained.items()}
    assert not _equal(moved, trained, initial)

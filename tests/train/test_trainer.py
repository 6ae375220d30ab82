"""The trainer end to end on synthetic tokens: resume, world sizes, stages, uneven data,
DDP mode, quarantine, non-finite votes (issues 3 and 4)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from tests.support.harness import run_world, values
from tests.support.scenarios import TINY_MODEL, train_worker
from valle.train.checkpoint import load_checkpoint
from valle.train.cli import parse_config
from valle.train.loop import train

pytestmark = pytest.mark.timeout(300)


def argv(exp_dir, *extra, cuts=48, batch=8, epochs=1) -> list[str]:
    return TINY_MODEL + ["--exp-dir", str(exp_dir), "--synthetic-data", str(cuts),
                         "--synthetic-batch-size", str(batch), "--num-epochs", str(epochs),
                         "--log-interval", "1", "--average-period", "2", *map(str, extra)]


def run_local(exp_dir, *extra, **kw):
    return train(parse_config(argv(exp_dir, *extra, **kw)))


def assert_same_params(a: dict, b: dict, rtol=1e-5, atol=1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
    straight = run_local(tmp_path / "straight", "--save-every-n", "100", epochs=2)
    first = run_local(tmp_path / "resumed", "--save-every-n", "4", "--max-steps", "4", epochs=2)
    assert first.steps == 4 and (tmp_path / "resumed" / "checkpoint-4.pt").exists()
    resumed = run_local(tmp_path / "resumed", "--save-every-n", "4", epochs=2)
    assert resumed.steps == straight.steps == 12
    assert_same_params(resumed.model_state, straight.model_state)
    # the averaged model and optimizer state came back too, not only the weights
    ends = [load_checkpoint(tmp_path / d / "epoch-2.pt") for d in ("straight", "resumed")]
    assert_same_params(ends[1]["model_avg"], ends[0]["model_avg"])
    for a, b in zip(ends[1]["optimizer"]["state"].values(), ends[0]["optimizer"]["state"].values()):
        for key in a:
            if isinstance(a[key], torch.Tensor) and a[key].is_floating_point():
                torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, equal_nan=True)


def test_truncated_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    exp = tmp_path / "exp"
    run_local(exp, "--save-every-n", "2", "--max-steps", "4")
    newest = exp / "checkpoint-4.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        summary = run_local(exp, "--save-every-n", "2", "--max-steps", "5")
    assert any("checkpoint-4.pt" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    # resumed at step 2 (checkpoint-2.pt) and ran 3 more steps
    assert summary.steps == 5
    assert json.loads((exp / "epoch-1-summary-rank0.json").read_text())["steps"] == 3


def test_world_sizes_one_and_two_reach_the_same_parameters(tmp_path):
    extra = ["--max-steps", "4", "--check-consistency-every", "1"]
    one = values(run_world(train_worker, 1, argv(tmp_path / "ws1", *extra), timeout=120))[0]
    two = values(run_world(train_worker, 2, argv(tmp_path / "ws2", *extra), timeout=120))
    assert one["summary"]["steps"] == two[0]["summary"]["steps"] == 4
    # Summation order differs (one rank vs an all-reduce of two): float rounding only
    # (measured max difference 1.3e-6 after 4 steps).
    assert_same_params(two[0]["params"], one["params"], rtol=1e-4, atol=1e-5)


def test_stage_switch_keeps_weights_and_drops_optimizer_state(tmp_path, caplog):
    exp = tmp_path / "exp"
    ar = run_local(exp, "--train-stage", "1", "--max-steps", "2", "--save-every-n", "2")
    with caplog.at_level(logging.WARNING):
        nar = run_local(exp, "--train-stage", "2", "--max-steps", "2", "--save-every-n", "2")
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped and "optimizer" in dropped[0] and "scheduler" in dropped[0]
    # stage 2 started afresh (2 steps, not 4) from the stage-1 weights: the AR
    # parameters, not trained in stage 2, are exactly the stage-1 ones.
    assert nar.steps == 2
    ar_keys = [k for k in ar.model_state if k.startswith("ar_")]
    assert ar_keys
    for k in ar_keys:
        torch.testing.assert_close(nar.model_state[k], ar.model_state[k], rtol=0, atol=0)
    changed = [k for k in nar.model_state if k.startswith("nar_")
               and not torch.equal(nar.model_state[k], ar.model_state[k])]
    assert changed, "stage 2 must train the NAR"


def test_uneven_ranks_end_the_epoch_together_without_losing_cuts(tmp_path):
    # 5 batches over 2 ranks: rank 0 holds 3, rank 1 holds 2 and runs dry first.
    args = argv(tmp_path / "exp", "--synthetic-partition", "batches", "--check-consistency-every",
                "1", cuts=20, batch=4)
    results = values(run_world(train_worker, 2, args, timeout=120))
    epoch = results[0]["summary"]["epochs"][0]
    assert epoch["steps"] == 3
    assert epoch["cuts_drawn"] == epoch["cuts_trained"] == 20 and epoch["balanced"]


def test_cut_that_always_fails_ends_in_quarantine_and_stays_skipped(tmp_path):
    exp = tmp_path / "exp"
    args = argv(exp, "--inject-fault", "backward@cut=syn-00005", "--check-consistency-every", "1",
                cuts=16, batch=8, epochs=2)
    results = values(run_world(train_worker, 2, args, timeout=120))
    lines = [json.loads(x) for x in (exp / "quarantine.jsonl").read_text().splitlines()]
    assert [q["cut_id"] for q in lines] == ["syn-00005"]
    assert "backward" in lines[0]["reason"]
    events = [json.loads(x) for f in (exp / "oom").glob("events-rank*.jsonl")
              for x in f.read_text().splitlines()]
    lone = [e for e in events if e["cut_ids"] == ["syn-00005"]]
    assert len(lone) == 2 and {e["step"] for e in lone} == {lines[0]["step"]}  # retried once
    first, second = results[0]["summary"]["epochs"]
    assert first["cuts_quarantined"] == 1 and first["balanced"]
    assert first["cuts_trained"] == 15
    # epoch 2: skipped up front (no new OOM), still accounted for
    assert second["cuts_quarantined"] == 1 and second["oom_events"] == 0 and second["balanced"]
    assert (exp / "oom" / "events-rank0.jsonl").exists() or (exp / "oom" / "events-rank1.jsonl").exists()


def test_non_finite_loss_on_one_rank_skips_the_step_everywhere(tmp_path):
    args = argv(tmp_path / "exp", "--inject-fault", "nonfinite@1:1", "--check-consistency-every", "1",
                "--max-steps", "3")
    results = values(run_world(train_worker, 2, args, timeout=120))
    for r in results:
        epoch = r["summary"]["epochs"][0]
        assert epoch["steps"] == 3
        assert len(epoch["skipped_ids"]) == 4  # this rank's rows of the skipped step
        assert epoch["balanced"]
        assert all(torch.isfinite(t).all() for t in r["params"].values())


def test_ddp_mode_recovers_forward_ooms(tmp_path):
    args = argv(tmp_path / "exp", "--grad-sync", "ddp", "--inject-fault", "forward@1:0",
                "--check-consistency-every", "1", "--max-steps", "3")
    results = values(run_world(train_worker, 2, args, timeout=120))
    assert all(r["ok"] and r["summary"]["steps"] == 3 for r in results)
    assert [r["summary"]["epochs"][0]["oom_events"] for r in results] == [1, 1]  # global count
    assert results[0]["summary"]["epochs"][0]["cuts_trained"] == 24  # the OOM step was retried


def test_ddp_mode_backward_oom_fails_fast_with_a_clear_error(tmp_path):
    args = argv(tmp_path / "exp", "--grad-sync", "ddp", "--inject-fault", "backward@1:1",
                "--collective-timeout", "10", "--max-steps", "3")
    results = run_world(train_worker, 2, args, timeout=150)  # a hang raises WorldTimeout
    failed = results[1][1]
    assert failed["error"] == "DdpBackwardOomError" and "--grad-sync overlap" in failed["message"]
    # rank 0 is left in DDP's all-reduce and gets out through the collective timeout
    assert results[0][0] == "error" or not results[0][1]["ok"]


def test_overlap_mode_recovers_the_same_backward_oom(tmp_path):
    args = argv(tmp_path / "exp", "--inject-fault", "backward@1:1", "--check-consistency-every", "1",
                "--max-steps", "3")
    results = values(run_world(train_worker, 2, args, timeout=120))
    assert all(r["ok"] and r["summary"]["steps"] == 3 for r in results)
    assert results[1]["summary"]["epochs"][0]["oom_events"] == 1


def test_a_batch_left_empty_by_quarantine_does_not_end_the_epoch(tmp_path):
    # batch size 1: the poisoned cut's step has no row left, yet data remains after it
    summary = run_local(tmp_path / "exp", "--inject-fault", "forward@cut=syn-00003", cuts=6, batch=1,
                        epochs=2)
    first, second = summary.epochs
    assert first["steps"] == second["steps"] == 6
    assert first["cuts_trained"] == second["cuts_trained"] == 5
    assert first["cuts_quarantined"] == second["cuts_quarantined"] == 1
    # a lone cut is retried once before it is quarantined: two OOM events
    assert first["oom_events"] == 2 and second["oom_events"] == 0


def test_unrepairable_state_exits_with_its_own_code(tmp_path):
    """One rank, an optimizer OOM on the update and on both its local retries: no healthy
    rank to copy from -> exit 10, clear message."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "bin/trainer.py"),
                           *argv(tmp_path / "exp", "--inject-fault", "optimizer@1x3", "--max-steps", "3")],
                          capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 10, proc.stderr[-2000:]
    assert "Restart from the last checkpoint" in proc.stderr


def test_an_update_that_fails_twice_resumes_and_equals_the_clean_run(tmp_path):
    clean = run_local(tmp_path / "clean", "--max-steps", "3")
    faulty = run_local(tmp_path / "faulty", "--inject-fault", "optimizer@1x2", "--max-steps", "3")
    assert faulty.epochs[0]["oom_events"] == 2
    assert_same_params(faulty.model_state, clean.model_state, rtol=0, atol=0)


def test_accumulate_grad_steps_equals_one_larger_batch(tmp_path):
    # two batches of 4 accumulated into one step == one batch of 8 (same global order)
    big = run_local(tmp_path / "big", "--max-steps", "3", "--synthetic-partition", "rows", batch=8)
    acc = run_local(tmp_path / "acc", "--max-steps", "3", "--accumulate-grad-steps", "2", batch=4)
    assert acc.steps == big.steps == 3
    assert_same_params(acc.model_state, big.model_state, rtol=1e-4, atol=1e-5)
    full = run_local(tmp_path / "full", cuts=16, batch=8)
    best = load_checkpoint(tmp_path / "full" / "best-train-loss.pt")
    assert math.isfinite(full.epochs[0]["train_loss"]) and best["step"] == full.steps == 2
    assert_same_params(best["model"], full.model_state, rtol=0, atol=0)


def test_pessimistic_scan_names_the_flag_to_lower(tmp_path, caplog):
    """A scan batch that cannot fit: stop before training, naming the flag (cut fault = OOM)."""
    from valle.train.loop import main_from_config

    cfg = parse_config(argv(tmp_path / "exp", "--oom-check", "true", "--inject-fault",
                            "forward@cut=syn-00003", "--max-steps", "2", cuts=16, batch=8))
    with caplog.at_level(logging.INFO):
        code = main_from_config(cfg)
    assert code == 13
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "pessimistic batches" in text and "peak" in text and "OOM" in text
    assert "--max-duration" in text or "--max-text-tokens" in text
    assert not (tmp_path / "exp" / "checkpoint-2.pt").exists()  # no training happened


def test_adamw_with_clipping_and_cosine_schedule_trains(tmp_path):
    summary = run_local(tmp_path / "exp", "--optimizer-name", "AdamW", "--scheduler-name", "Cosine",
                        "--grad-clip", "0.5", "--base-lr", "0.002", "--warmup-steps", "2",
                        "--max-steps", "6", cuts=48)
    mean, last = summary.epochs[0]["train_loss"], summary.final_loss
    # the last step's loss is below the epoch's mean: the loss fell while training
    assert summary.steps == 6 and math.isfinite(last) and last < mean - 0.05, (last, mean)
    assert all(torch.isfinite(t).all() for t in summary.model_state.values())


@pytest.mark.parametrize("sync", ["overlap", "after-backward"])
def test_non_finite_gradient_with_a_finite_loss_skips_the_step_everywhere(tmp_path, sync):
    # AdamW would write the NaNs into the weights; the vote must stop it on every rank
    args = argv(tmp_path / "exp", "--inject-fault", "nonfinite_grad@1:0", "--grad-sync", sync,
                "--optimizer-name", "AdamW", "--scheduler-name", "Noam", "--base-lr", "0.001",
                "--check-consistency-every", "1", "--max-steps", "3")
    results = values(run_world(train_worker, 2, args, timeout=120))
    for r in results:
        epoch = r["summary"]["epochs"][0]
        assert epoch["steps"] == 3 and len(epoch["skipped_ids"]) == 4 and epoch["balanced"]
        assert all(torch.isfinite(t).all() for t in r["params"].values())


def test_non_finite_gradient_on_one_rank_alone_is_skipped(tmp_path):
    summary = run_local(tmp_path / "exp", "--inject-fault", "nonfinite_grad@1", "--optimizer-name",
                        "AdamW", "--scheduler-name", "Noam", "--base-lr", "0.001", "--max-steps", "3")
    assert len(summary.epochs[0]["skipped_ids"]) == 8
    assert all(torch.isfinite(t).all() for t in summary.model_state.values())


def test_tensorboard_and_log_file_record_the_run(tmp_path):
    from valle.train.metrics import _read_tensorboard_scalars

    exp = tmp_path / "exp"
    run_local(exp, "--tensorboard", "true", "--inject-fault", "forward@1", "--max-steps", "3")
    board = exp / "tensorboard" / "stage0"
    losses = _read_tensorboard_scalars(board, "train/loss")
    assert [s for s, _ in losses] == [1, 2, 3] and all(math.isfinite(v) for _, v in losses)
    assert [v for _, v in _read_tensorboard_scalars(board, "train/oom_events")] == [0.0, 1.0, 0.0]
    assert _read_tensorboard_scalars(board, "train/step_time_s")
    log = next((exp / "log").glob("log-train-*")).read_text()
    assert "epoch 1 step 3 | loss" in log and "it/s" in log and "ETA" in log
    assert "OOM in forward on rank 0 at step 1" in log


def test_scan_runs_on_a_fresh_start_and_a_new_stage_but_not_on_a_resume(tmp_path, caplog):
    exp = tmp_path / "exp"

    def scanned(*extra) -> bool:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            run_local(exp, "--oom-check", "true", "--save-every-n", "2", *extra)
        return any("pessimistic batches" in r.getMessage() for r in caplog.records)

    assert scanned("--max-steps", "2")
    assert not scanned("--max-steps", "4")  # same stage, resumed from checkpoint-2.pt
    assert scanned("--train-stage", "2", "--max-steps", "2")  # a new stage: a new memory profile


def test_missing_checkpoint_named_by_a_flag_is_a_usage_error(tmp_path, caplog):
    from valle.train.loop import main_from_config

    with caplog.at_level(logging.ERROR):
        code = main_from_config(parse_config(argv(tmp_path / "exp", "--start-batch", "7")))
    assert code == 2
    assert any("checkpoint-7.pt" in r.getMessage() for r in caplog.records)


def test_start_from_a_lifeiteng_checkpoint_takes_its_weights_and_architecture(tmp_path):
    from pathlib import Path

    from valle.models.convert import load_model_checkpoint

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "lifeiteng" / "lifeiteng_tiny.pt"
    state, hparams = load_model_checkpoint(fixture)
    # the flags say d=32/1 layer/8 codebooks; the checkpoint's 4 codebooks and 4 heads win
    summary = run_local(tmp_path / "exp", "--start-from", str(fixture), "--base-lr", "0",
                        "--max-steps", "1", "--average-period", "0", cuts=8, batch=8)
    assert summary.steps == 1 and summary.model_state.keys() == state.keys()
    assert_same_params(summary.model_state, state, rtol=0, atol=0)  # lr 0: the loaded weights
    saved = load_checkpoint(tmp_path / "exp" / "best-train-loss.pt")
    assert saved["config"]["start_from"] == str(fixture) and hparams["num_quantizers"] == 4


def test_start_from_a_missing_file_is_a_usage_error(tmp_path, caplog):
    from valle.train.loop import main_from_config

    with caplog.at_level(logging.ERROR):
        code = main_from_config(parse_config(argv(tmp_path / "exp", "--start-from", "nope.pt")))
    assert code == 2 and any("nope.pt" in r.getMessage() for r in caplog.records)


def test_synthetic_data_refuses_a_small_ar_head(tmp_path):
    """Synthetic codebook 0 spans all 1024 codes: a smaller --ar-codebook-size is a clear error."""
    with pytest.raises(ValueError, match="--synthetic-data .* --ar-codebook-size 1024, got 128"):
        run_local(tmp_path / "exp", "--ar-codebook-size", "128", "--max-steps", "1")
    assert not list((tmp_path / "exp").glob("*.pt"))

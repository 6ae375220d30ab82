"""LoRA fine-tuning in the trainer (--lora-rank on --start-from): only the adapters train and
hold optimizer state, the base stays bit-identical, checkpoints hold the adapters tied to
their base by hash, resume is exact, and OOM recovery holds with 1 and 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_world, values
from tests.support.scenarios import TINY_MODEL, train_worker
from valle.models.lora import LoraError, base_fingerprint, is_adapter_key
from valle.train.checkpoint import load_checkpoint
from valle.train.cli import parse_config
from valle.train.loop import train

pytestmark = pytest.mark.timeout(300)

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--optimizer-name", "AdamW", "--base-lr", "0.01",
        "--warmup-steps", "1", "--average-period", "2"]


def argv(exp_dir, *extra, cuts=48, epochs=1) -> list[str]:
    return TINY_MODEL + ["--exp-dir", str(exp_dir), "--synthetic-data", str(cuts),
                         "--synthetic-batch-size", "8", "--num-epochs", str(epochs),
                         "--log-interval", "1", *map(str, extra)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny pretrained model (3 full steps): its checkpoint and its weights."""
    exp = tmp_path_factory.mktemp("base")
    summary = train(parse_config(argv(exp, "--max-steps", "3", "--average-period", "0",
                                      "--base-lr", "0.01", "--optimizer-name", "AdamW")))
    path = exp / "best-train-loss.pt"
    return path, {k: v.clone() for k, v in summary.model_state.items()}


def lora_run(exp_dir, base_path, *extra, **kw):
    return train(parse_config(argv(exp_dir, "--start-from", base_path, *LORA, *extra, **kw)))


def test_only_adapters_train_and_the_checkpoint_holds_them_tied_to_the_base(tmp_path, base):
    base_path, base_state = base
    summary = lora_run(tmp_path / "exp", base_path, "--save-every-n", "3")
    final = summary.model_state
    assert summary.steps == 6
    # The base weights are bit-identical after training; the adapters moved.
    for key, value in base_state.items():
        assert torch.equal(final[key], value), key
    adapters = {k: v for k, v in final.items() if is_adapter_key(k)}
    assert adapters and any(v.abs().sum() > 0 for k, v in adapters.items() if k.endswith("lora_B"))
    saved = load_checkpoint(tmp_path / "exp" / "epoch-1.pt")
    assert set(saved["model"]) == set(adapters) and set(saved["model_avg"]) == set(adapters)
    assert saved["lora"]["base_sha256"] == base_fingerprint(base_state)
    assert saved["lora"]["config"] == {"lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.0,
                                       "lora_targets": ["attn", "ffn"]}
    # Optimizer state for the adapters alone.
    assert len(saved["optimizer"]["state"]) == len(adapters)
    adapter_bytes = sum(v.numel() * v.element_size() for v in saved["model"].values())
    base_bytes = sum(v.numel() * v.element_size() for v in base_state.values())
    assert adapter_bytes < 0.2 * base_bytes  # the tiny model: 32 wide, rank 4


def test_resume_gives_the_losses_and_adapters_of_the_uninterrupted_run(tmp_path, base):
    base_path, _ = base
    straight = lora_run(tmp_path / "straight", base_path, "--save-every-n", "100", epochs=2)
    first = lora_run(tmp_path / "resumed", base_path, "--save-every-n", "4", "--max-steps", "4",
                     epochs=2)
    assert first.steps == 4
    resumed = lora_run(tmp_path / "resumed", base_path, "--save-every-n", "4", epochs=2)
    assert resumed.steps == straight.steps == 12
    assert resumed.epochs[-1]["train_loss"] == pytest.approx(straight.epochs[-1]["train_loss"],
                                                             rel=1e-6)
    ends = [load_checkpoint(tmp_path / d / "epoch-2.pt") for d in ("straight", "resumed")]
    for key in ("model", "model_avg"):
        assert ends[0][key].keys() == ends[1][key].keys()
        for name in ends[0][key]:
            torch.testing.assert_close(ends[1][key][name], ends[0][key][name], rtol=1e-6, atol=1e-7)


def test_resuming_onto_another_base_is_refused_naming_both(tmp_path, base):
    base_path, base_state = base
    exp = tmp_path / "exp"
    lora_run(exp, base_path, "--max-steps", "2", "--save-every-n", "2")
    other = tmp_path / "other.pt"
    payload = load_checkpoint(base_path)
    payload["model"] = {k: v + 1e-3 if v.is_floating_point() else v for k, v in base_state.items()}
    torch.save(payload, other)
    with pytest.raises(LoraError, match=f"{base_path.name}.*--start-from {other}"):
        lora_run(exp, other, "--max-steps", "4")
    with pytest.raises(LoraError, match="holds LoRA adapters"):
        train(parse_config(argv(exp, "--max-steps", "4")))


def test_lora_needs_start_from_and_checks_its_flags(tmp_path):
    with pytest.raises(ValueError, match="--lora-rank.*--start-from"):
        parse_config(argv(tmp_path, "--lora-rank", "4"))
    with pytest.raises(ValueError, match="--lora-targets"):
        parse_config(argv(tmp_path, "--lora-rank", "4", "--start-from", "x.pt",
                          "--lora-targets", "attn,conv"))


FAULTS = ["--inject-fault", "forward@1", "--inject-fault", "backward@2",
          "--inject-fault", "optimizer@3"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_injected_ooms_with_lora_end_where_the_fault_free_run_ends(tmp_path, base, world_size):
    base_path, base_state = base
    common = ["--start-from", str(base_path), *LORA, "--max-steps", "4",
              "--check-consistency-every", "1", "--save-every-n", "100"]
    clean = values(run_world(train_worker, world_size, argv(tmp_path / "clean", *common),
                             timeout=150))
    faulty = values(run_world(train_worker, world_size,
                              argv(tmp_path / "faulty", *common, *FAULTS), timeout=150))
    for result in clean + faulty:
        assert result["ok"], result
        assert result["summary"]["steps"] == 4 and not result["summary"]["unfired_faults"]
    for name, value in clean[0]["params"].items():
        torch.testing.assert_close(faulty[0]["params"][name], value, rtol=1e-5, atol=1e-6)
        if not is_adapter_key(name):
            assert torch.equal(faulty[0]["params"][name], base_state[name]), name
    # Every rank holds the same adapters (the consistency check ran at every step too).
    for other in faulty[1:]:
        for name, value in faulty[0]["params"].items():
            assert torch.equal(other["params"][name], value), name


@pytest.mark.multiproc
def test_preempted_lora_run_resumes_to_the_uninterrupted_adapters(tmp_path, base):
    """SIGTERM inside a step (an injected stall holds it there): the adapters' checkpoint at
    the step boundary, exit 17, and the same command finishes where an uninterrupted run does."""
    import signal
    import sys

    from tests.train.test_preemption import REPO, finish, output, run, start, wait_for_log
    from valle.train.preemption import EXIT_PREEMPTED

    base_path, _ = base

    def command(exp, *extra):
        return [sys.executable, str(REPO / "bin" / "trainer.py"),
                *argv(exp, "--start-from", base_path, *LORA, "--save-every-n", "100",
                      "--stall-seconds", "2", *extra, epochs=2)]

    reference = run(command(tmp_path / "reference"), timeout=200)
    assert reference.returncode == 0, output(reference)
    exp, log = tmp_path / "preempted", tmp_path / "launch1.log"
    cmd = command(exp, "--inject-fault", "stall@4")
    proc = start(cmd, log)
    wait_for_log(log, "injected stall")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == EXIT_PREEMPTED, log.read_text()[-4000:]
    assert set(load_checkpoint(exp / "checkpoint-5.pt")["model"]) == set(
        load_checkpoint(tmp_path / "reference" / "epoch-2.pt")["model"])
    again = run(cmd, timeout=200)
    assert again.returncode == 0, output(again)
    a, b = (load_checkpoint(d / "epoch-2.pt") for d in (tmp_path / "reference", exp))
    assert a["step"] == b["step"] == 12
    for key in ("model", "model_avg"):
        for name in a[key]:
            torch.testing.assert_close(b[key][name], a[key][name], rtol=1e-6, atol=1e-7)


def test_a_corpus_table_with_other_ids_than_the_bases_is_refused(tmp_path, caplog):
    from valle.data.symbols import SymbolTable
    from valle.train.finetune import check_text_tokens

    base, same, other = tmp_path / "base.k2", tmp_path / "same.k2", tmp_path / "other.k2"
    SymbolTable.from_symbols(["a", "b", "c"]).to_file(base)
    SymbolTable.from_symbols(["a", "b"]).to_file(same)  # a subset: the same ids
    SymbolTable.from_symbols(["a", "c"]).to_file(other)  # c gets b's id
    check_text_tokens(str(base), str(same), "base.pt")
    with pytest.raises(LoraError, match=r"other.k2: 1 symbol\(s\) \(c\).*--text-tokens .*base.k2"):
        check_text_tokens(str(base), str(other), "base.pt")
    check_text_tokens(str(tmp_path / "gone.k2"), str(other), "base.pt")  # cannot check: a warning
    assert "cannot check" in caplog.text


def test_lora_errors_are_usage_errors_with_one_line(tmp_path, base):
    from valle.train.loop import main_from_config

    base_path, _ = base
    exp = tmp_path / "exp"
    lora_run(exp, base_path, "--max-steps", "1", "--save-every-n", "1")
    assert main_from_config(parse_config(argv(exp, "--max-steps", "2"))) == 2


def test_two_stage_lora_trains_the_ar_adapters_then_the_nar_ones(tmp_path, base):
    base_path, base_state = base
    exp = tmp_path / "exp"
    ar = lora_run(exp, base_path, "--train-stage", "1", "--max-steps", "2", "--save-every-n", "2")
    nar = lora_run(exp, base_path, "--train-stage", "2", "--max-steps", "2", "--save-every-n", "2")
    adapters = [k for k in nar.model_state if is_adapter_key(k) and k.endswith("lora_B")]
    for key in adapters:
        moved_in_ar = not torch.equal(ar.model_state[key], torch.zeros_like(ar.model_state[key]))
        moved_in_nar = not torch.equal(nar.model_state[key], ar.model_state[key])
        assert (moved_in_ar, moved_in_nar) == ((True, False) if key.startswith("ar_") else (False, True)), key
    for key, value in base_state.items():
        assert torch.equal(nar.model_state[key], value), key

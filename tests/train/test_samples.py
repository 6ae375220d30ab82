"""Hear it train (valle/train/samples.py): held-out syntheses in TensorBoard at each validation,
on rank 0 only, without changing the training's course."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.harness import run_world, values
from tests.support.scenarios import TINY_MODEL, train_worker
from valle.train.cli import parse_config
from valle.train.loop import train
from valle.train.samples import SAMPLES_DIR, pair_by_speaker, preserved_state

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
# The demo's model, smaller: the AR's head fits the corpus's 128-code codebook 0.
MANIFEST_MODEL = ["--model-name", "valle", "--decoder-dim", "32", "--nhead", "2", "--num-decoder-layers", "1",
                  "--prefix-mode", "1", "--dropout", "0", "--guided-attention-weight", "1.0",
                  "--ar-codebook-size", "128", "--device", "cpu", "--oom-check", "false"]


def synthetic_argv(exp_dir: Path, *extra: str) -> list[str]:
    return TINY_MODEL + ["--exp-dir", str(exp_dir), "--synthetic-data", "32", "--synthetic-batch-size", "8",
                         "--num-epochs", "1", "--valid-interval", "2", "--tensorboard", "true",
                         "--valid-samples-max-seconds", "1", *extra]


def read_board(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(logdir), size_guidance={"audio": 0, "images": 0, "scalars": 0, "tensors": 0})
    board.Reload()
    return board.Tags()


def samples_dir(exp_dir: Path, stage: int = 0) -> Path:
    return exp_dir / "tensorboard" / f"stage{stage}" / SAMPLES_DIR


# ------------------------------------------------------------------ pure parts
def test_items_pair_consecutive_utterances_of_one_speaker_taking_speakers_in_turn():
    speakers = ["b", "a", "b", "a", "c", "b", "a", "b", None]
    # a: 1, 3, 6; b: 0, 2, 5, 7; c: 4 (alone: never an item); None: no speaker
    assert pair_by_speaker(speakers, 10) == [(1, 3), (0, 2), (5, 7)]
    assert pair_by_speaker(speakers, 2) == [(1, 3), (0, 2)]
    assert pair_by_speaker(["x", "y"], 4) == []


def test_preserved_state_restores_every_rng_and_the_training_mode():
    model = torch.nn.Linear(2, 2).train()
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    with preserved_state(model, torch.device("cpu")):
        assert not model.training and not torch.is_grad_enabled()
        torch.rand(3), random.random(), np.random.rand(), torch.manual_seed(123)
    assert model.training and torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def test_bad_decode_flags_are_refused_at_start():
    with pytest.raises(ValueError, match="--valid-samples-decode"):
        parse_config(synthetic_argv(Path("/tmp/unused"), "--valid-samples-decode=--top-k three"))
    with pytest.raises(ValueError, match="--valid-samples-decode"):
        parse_config(synthetic_argv(Path("/tmp/unused"), "--valid-samples-decode=--min-len-ratio 20"))


# ------------------------------------------------------------------ synthetic runs
def test_synthetic_run_writes_codes_and_attention_images_and_no_audio(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        train(parse_config(synthetic_argv(tmp_path, "--valid-samples", "2", "--max-steps", "4")))
    tags = read_board(samples_dir(tmp_path))
    for k in (0, 1):
        assert {f"samples/{k}/codes_output", f"samples/{k}/codes_ground_truth",
                f"samples/{k}/attention"} <= set(tags["images"]), tags
    assert not tags["audio"]
    assert "valid_samples/wall_seconds" in tags["scalars"]
    assert "codes are written as images, no audio" in caplog.text
    assert "samples at step 2: 2 items" in caplog.text and "samples at step 4: 2 items" in caplog.text


def test_samples_interval_skips_validations_between_passes(tmp_path, caplog):
    with pytest.raises(ValueError, match="--valid-samples-interval"):
        parse_config(synthetic_argv(tmp_path, "--valid-samples-interval", "3"))
    with caplog.at_level(logging.INFO):
        train(parse_config(synthetic_argv(tmp_path, "--valid-samples", "1", "--valid-samples-interval", "4",
                                          "--max-steps", "4")))
    assert "validation at step 2" in caplog.text and "samples at step 2" not in caplog.text
    assert "samples at step 4: 1 items" in caplog.text


def test_valid_samples_zero_writes_none(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        train(parse_config(synthetic_argv(tmp_path, "--valid-samples", "0", "--max-steps", "2")))
    assert "validation at step 2" in caplog.text
    assert not samples_dir(tmp_path).exists() and "samples at step" not in caplog.text


@pytest.mark.parametrize("pass_draws_rng", [False, True], ids=["as-is", "pass-draws-global-rng"])
def test_training_is_bit_identical_with_samples_on_and_off(tmp_path, monkeypatch, pass_draws_rng):
    # with dropout, a pass that left the model in eval mode would show (checked: it fails then);
    # the step reseeds the RNG from (seed, step), and preserved_state restores it anyway
    if pass_draws_rng:  # as a codec with random weights (or any library) might
        from valle.train.samples import SampleWriter

        decode = SampleWriter._decode
        monkeypatch.setattr(SampleWriter, "_decode", lambda self, item: (torch.rand(7), random.random(),
                                                                          np.random.rand(), decode(self, item))[-1])
    common = ["--dropout", "0.1", "--max-steps", "6", "--average-period", "2"]
    off = train(parse_config(synthetic_argv(tmp_path / "off", "--valid-samples", "0", *common)))
    on = train(parse_config(synthetic_argv(tmp_path / "on", "--valid-samples", "2", *common)))
    assert samples_dir(tmp_path / "on").is_dir()
    assert off.model_state.keys() == on.model_state.keys()
    for name, value in off.model_state.items():
        assert torch.equal(value, on.model_state[name]), name
    assert off.fingerprints == on.fingerprints


def test_an_oom_or_an_error_while_sampling_is_reported_and_training_goes_on(tmp_path, caplog, monkeypatch):
    from valle.train.samples import SampleWriter

    calls = []

    def fail(self, item):  # the first pass runs out of memory, the second meets a bug
        calls.append(item.name)
        raise torch.OutOfMemoryError("CUDA out of memory (test)") if len(calls) == 1 else RuntimeError(
            "broken decoder (test)")

    monkeypatch.setattr(SampleWriter, "_decode", fail)
    common = ["--max-steps", "4"]
    with caplog.at_level(logging.INFO):
        failed = train(parse_config(synthetic_argv(tmp_path / "on", "--valid-samples", "2", *common)))
    clean = train(parse_config(synthetic_argv(tmp_path / "off", "--valid-samples", "0", *common)))
    assert failed.steps == clean.steps == 4
    assert len(calls) == 2  # one item per pass: each failure ended its pass
    assert "samples failed after 1 attempt(s): out of memory" in caplog.text
    assert "samples at step 4 failed (training goes on): broken decoder (test)" in caplog.text
    for name, value in clean.model_state.items():
        assert torch.equal(value, failed.model_state[name]), name


def test_two_ranks_stay_consistent_and_only_rank_0_writes_samples(tmp_path):
    argv = synthetic_argv(tmp_path, "--valid-samples", "2", "--check-consistency-every", "1",
                          "--collective-timeout", "60", "--max-steps", "4")
    results = values(run_world(train_worker, 2, argv, timeout=240))
    assert all(r["ok"] for r in results), results
    summaries = [r["summary"] for r in results]
    assert summaries[0]["steps"] == summaries[1]["steps"] == 4
    assert summaries[0]["fingerprints"] == summaries[1]["fingerprints"]
    logs = {p.name[-1]: p.read_text() for p in (tmp_path / "log").glob("log-train-*")}
    assert "samples at step 2: 2 items" in logs["0"] and "samples at step 4: 2 items" in logs["0"]
    assert "samples at step" not in logs["1"]
    events = list(samples_dir(tmp_path).glob("events.out.tfevents.*"))
    assert len(events) == 2  # one writer per pass of rank 0 (rank 1's would double them)


# ------------------------------------------------------------------ the demo's layout
@pytest.fixture(scope="module")
def heldout_corpus(tmp_path_factory) -> Path:
    """egs/tiny's held-out layout, small: mel-rvq codec, a (briefly trained) phoneme judge."""
    data_dir = tmp_path_factory.mktemp("heldout")
    proc = subprocess.run(
        ["bash", str(ROOT / "egs/tiny/prepare.sh"), "--python", sys.executable, "--data-dir", str(data_dir),
         "--layout", "heldout", "--codec", "mel-rvq", "--limit", "24", "--generated", "0",
         "--judge-epochs", "2", "--judge-limit", "24", "--first-codebook-size", "128", "--num-jobs", "0"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return data_dir / "tokenized"


@pytest.mark.timeout(900)
def test_manifest_run_writes_audio_mels_attention_and_held_out_scores(heldout_corpus, tmp_path, caplog):
    exp = tmp_path / "exp"
    argv = MANIFEST_MODEL + [
        "--manifest-dir", str(heldout_corpus), "--dataset", "tiny", "--max-duration", "16",
        "--num-workers", "0", "--exp-dir", str(exp), "--train-stage", "1", "--max-steps", "2",
        "--valid-interval", "2", "--valid-samples", "2", "--valid-samples-max-seconds", "1.5",
        # no EOS before a frame per phoneme: an untrained AR says something to look at
        "--valid-samples-decode=--top-k 3 --min-len-ratio 1 --seed 1",
        "--valid-judge", str(heldout_corpus / "judge.pt")]
    with caplog.at_level(logging.INFO):
        train(parse_config(argv))
    tags = read_board(samples_dir(exp, stage=1))
    for k in (0, 1):
        assert {f"samples/{k}/output", f"samples/{k}/ground_truth", f"samples/{k}/prompt"} <= set(tags["audio"])
        assert {f"samples/{k}/mel_output", f"samples/{k}/mel_ground_truth",
                f"samples/{k}/attention"} <= set(tags["images"])
    assert {"valid_samples/per", "valid_samples/similarity", "valid_samples/wall_seconds"} <= set(tags["scalars"])
    assert "samples at step 2: 2 items" in caplog.text
    # prompts are other utterances of the same speaker, from the validation part
    from lhotse import CutSet

    dev = {c.id: c.supervisions[0].speaker for c in CutSet.from_file(heldout_corpus / "tiny_cuts_dev.jsonl.gz")}
    table = [line for line in read_text_summary(samples_dir(exp, stage=1)).splitlines() if line.startswith("| 0")
             or line.startswith("| 1")]
    assert len(table) == 2
    for line in table:
        _, _, target, prompt, *_ = (c.strip() for c in line.split("|"))
        assert target != prompt and dev[target] == dev[prompt]


def read_text_summary(logdir: Path) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    board.Reload()
    event = board.Tensors("samples/items/text_summary")[0]
    return event.tensor_proto.string_val[0].decode()


def test_a_held_out_pair_its_voice_cannot_read_is_named_for_skipping():
    from types import SimpleNamespace

    from valle.train.samples import unsayable_text

    def cut(cut_id, text, voice):
        custom = {"espeak_voice": voice} if voice else None
        return SimpleNamespace(id=cut_id, supervisions=[SimpleNamespace(text=text, custom=custom)])

    good, chinese = cut("a", "the dog", "en-us"), cut("b", "你好", "en-us")
    assert unsayable_text(good, cut("c", "你好", "cmn")) == ""
    assert unsayable_text(chinese, good).startswith("cut b: the text has Han letters ('你好')")
    assert "cut b: the prompt's transcript has Han letters" in unsayable_text(good, chinese)
    assert unsayable_text(cut("d", "你好", None), good) == ""  # no recorded voice: not judged


def test_manifest_items_skip_a_pair_its_voices_cannot_read_with_a_warning(tmp_path, monkeypatch, caplog):
    from types import SimpleNamespace

    from lhotse import CutSet, MonoCut, SupervisionSegment

    import valle.train.samples as samples
    from valle.data.symbols import SymbolTable

    monkeypatch.setattr(samples, "_codes", lambda cut: torch.zeros(3, 8, dtype=torch.long))
    table = tmp_path / "unique_text_tokens.k2symbols"
    SymbolTable.from_symbols(["_", "d", "o"]).to_file(table)

    def cut(i: int, text: str) -> MonoCut:
        custom = {"tokens": {"text": ["d", "o"]}, "espeak_voice": "en-us"}
        sup = SupervisionSegment(f"c{i}", f"r{i}", 0, 1, text=text, speaker="s", custom=custom)
        return MonoCut(f"c{i}", 0, 1, 0, supervisions=[sup])

    CutSet.from_cuts([cut(0, "do"), cut(1, "你好"), cut(2, "do"), cut(3, "do")]).to_file(tmp_path / "dev.jsonl.gz")
    module = SimpleNamespace(cfg=SimpleNamespace(valid_part="dev"), text_tokens_path=lambda: table,
                             cuts_path=lambda part: tmp_path / f"{part}.jsonl.gz", languages=lambda: None)
    with caplog.at_level(logging.WARNING):
        items = samples.manifest_items(module, 2)
    assert [(item.name, item.prompt_name) for item in items] == [("c2", "c3")]
    assert "validation samples: item c0 (prompt c1) skipped: cut c1: the prompt's transcript has Han" in caplog.text

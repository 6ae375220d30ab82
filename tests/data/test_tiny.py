import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from valle.data.tiny import VOICES, EspeakSynth, Voice, read_sentences

ROOT = Path(__file__).resolve().parents[2]


def test_voices_are_distinct_and_deterministic():
    synth = EspeakSynth.get()
    assert synth.sample_rate == 22050
    text = "The quick brown fox jumps over the lazy dog."
    audio = [synth.synthesize(text, v) for v in VOICES]
    assert len({v.speaker for v in VOICES}) >= 3
    for a in audio:
        assert a.dtype == np.int16 and 1.0 < len(a) / synth.sample_rate < 5.0
        assert np.abs(a).max() > 1000
    for i in range(len(audio)):
        for j in range(i + 1, len(audio)):
            n = min(len(audio[i]), len(audio[j]))
            assert len(audio[i]) != len(audio[j]) or not np.array_equal(audio[i][:n], audio[j][:n])
    # espeak carries a little filter state between calls: same length, not bit-exact samples.
    assert len(synth.synthesize(text, VOICES[0])) == len(audio[0])


def test_sentence_list_is_big_and_varied():
    sentences = read_sentences(ROOT / "egs/tiny/sentences.txt")
    assert len(sentences) >= 200 and len(set(sentences)) == len(sentences)


def test_tiny_corpus_manifests(tiny_data):
    from lhotse import CutSet

    parts = {p: CutSet.from_file(tiny_data / f"tiny_cuts_{p}.jsonl.gz") for p in ("train", "dev", "test")}
    assert sum(len(c) for c in parts.values()) == 24
    for cuts in parts.values():
        assert {c.supervisions[0].speaker for c in cuts} == {v.speaker for v in VOICES}
        assert all(c.supervisions[0].language == "en-us" for c in cuts)
        assert all(0.5 < c.duration < 4.0 for c in cuts)
    assert (tiny_data / "unique_text_tokens.k2symbols").is_file()


def test_heldout_plan_keeps_test_voices_and_sentences_out_of_training():
    """egs/tiny/local/heldout_corpus.py: --train-voices N spreads the training part over N eSpeak
    voices; the held-out voices and the dev/test sentences never reach it."""
    sys.path.insert(0, str(ROOT / "egs/tiny/local"))
    try:
        import heldout_corpus as hc
    finally:
        sys.path.pop(0)
    sentences = read_sentences(ROOT / "egs/tiny/sentences.txt")
    held_out = {v.speaker for v in hc.HELD_OUT_VOICES}
    for n in (4, 12):
        rows = hc.plan(sentences, 16, 16, 1, 0, generated=200, train_voices=n)
        train = [r for r in rows if r[1] == "train"]
        assert len(train) == len(sentences) - 32 + 200
        assert {r[2].speaker for r in train} == {v.speaker for v in hc.training_voices(n)}
        assert len({r[2].speaker for r in train}) == n and not held_out & {r[2].speaker for r in train}
        test = [r for r in rows if r[1] == "test"]
        assert {r[2].speaker for r in test} == held_out
        assert not {r[3] for r in test} & {r[3] for r in train}
    assert len({v.name for v in hc.training_voices(12)} | {v.name for v in hc.HELD_OUT_VOICES}) == 14
    with pytest.raises(ValueError, match="--train-voices"):
        hc.training_voices(13)


def test_espeak_refuses_a_voice_variant_it_lacks():
    """eSpeak NG itself falls back to the plain voice for an unknown variant, without an error:
    a misspelt training or held-out voice would silently be another voice."""
    engine = EspeakSynth.get()
    with pytest.raises(ValueError, match="no voice variant 'nosuch'"):
        engine.synthesize("hello", Voice("x", "en-us+nosuch", rate=170, pitch=50))
    assert len(engine.synthesize("hello", Voice("x", "en-us+m7", rate=170, pitch=50))) > 1000


def test_heldout_corpus_is_kept_when_its_plan_is_unchanged(tmp_path):
    """A rerun of the held-out synthesis keeps a corpus made from the same plan (eSpeak would give
    other samples: its oscillator state carries over between utterances) and re-makes it when the
    plan changed."""
    script = ROOT / "egs/tiny/local/heldout_corpus.py"
    out = tmp_path / "corpus"

    def synth(*extra):
        return subprocess.run([sys.executable, str(script), "synth", "--sentences", str(ROOT / "egs/tiny/sentences.txt"),
                               "--out-dir", str(out), "--num-dev", "2", "--num-test", "2", "--limit", "3", *extra],
                              capture_output=True, text=True, timeout=120, check=True)

    synth()
    wavs = sorted(out.glob("wavs/*/*.wav"))
    assert len(wavs) == 3 + 2 + 2 * 2 and (out / "plan.tsv").is_file()
    stamps = [w.stat().st_mtime_ns for w in wavs]
    assert "from this plan" in synth().stderr
    assert [w.stat().st_mtime_ns for w in wavs] == stamps
    again = synth("--generated", "2")
    assert "from this plan" not in again.stderr
    assert len((out / "metadata.tsv").read_text().splitlines()) == 3 + 2 + 2 + 2 * 2
    assert [w.stat().st_mtime_ns for w in wavs] != stamps


def test_prepare_stops_on_tokens_older_than_a_remade_corpus(tmp_path):
    """Tokens made before bin/tokenizer.py recorded its sources, then the corpus synthesised again
    from another plan: egs/tiny/prepare.sh stops with a line saying what to delete."""
    import os
    import time

    cuts = tmp_path / "tokenized" / "tiny_cuts_train.jsonl.gz"
    cuts.parent.mkdir()
    cuts.write_bytes(b"")
    plan = tmp_path / "corpus" / "plan.tsv"
    plan.parent.mkdir()
    plan.write_text("x\n")
    now = time.time()
    os.utime(cuts, (now - 60, now - 60))
    run = subprocess.run(["bash", str(ROOT / "egs/tiny/prepare.sh"), "--stage", "2", "--stop-stage", "2",
                          "--data-dir", str(tmp_path), "--layout", "heldout", "--codec", "mel-rvq",
                          "--python", sys.executable], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and f"delete {tmp_path}/tokenized" in run.stderr


def test_recipes_parse():
    for recipe in ("tiny", "libritts", "ljspeech"):
        for script in ("prepare.sh", "run.sh"):
            subprocess.run(["bash", "-n", str(ROOT / "egs" / recipe / script)], check=True)
    bad = subprocess.run(["bash", str(ROOT / "egs/tiny/prepare.sh"), "--no-such-flag", "1"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--no-such-flag" in bad.stderr


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_demo_quick_runs_every_stage():
    """`egs/tiny/run.sh --quick true`: the demo's whole pipeline (corpus, codec, judge, AR and NAR
    under torchrun with an injected OOM, synthesis, evaluation, summary) in a few minutes."""
    import json
    import os
    import shutil
    import sys

    tiny = ROOT / "egs" / "tiny"
    for stale in (tiny / "exp" / "quick", tiny / "data" / "quick"):  # a leftover run would resume
        shutil.rmtree(stale, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(tiny / "run.sh"), "--quick", "true", "--python", sys.executable],
                          capture_output=True, text=True, env=env, timeout=840)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    summary = out[out.index("demo summary"):]
    assert "OOM recovered:    backward on rank 1 at step 7 (injected)" in summary
    drawn = re.search(r"cuts drawn (\d+) = trained (\d+) \+ quarantined 0 \+ skipped 0", summary)
    assert drawn and drawn.group(1) == drawn.group(2), summary
    # Where the run stands on the measured curve, with this run's AR steps and what goes further.
    ar_steps = json.loads((tiny / "exp" / "quick" / "ar" / "summary-rank0.json").read_text())["steps"]
    assert f"on the curve:     this AR trained {ar_steps} steps" in summary, summary
    assert "further: make demo-long" in summary
    evaluation = json.loads((tiny / "exp" / "quick" / "eval.json").read_text())
    assert len(evaluation["rows"]) == 2
    assert set(evaluation["summary"]) >= {"output", "ground_truth", "codec_resynthesis"}
    for row in evaluation["rows"]:
        assert Path(tiny / row["row"]["out_wav"]).is_file()
    assert (tiny / "exp" / "quick" / "loss-curve.png").stat().st_size > 0
    # The AR head is the size of the codec's codebook 0 (run.sh's --ar-codebook-size), and the
    # synthesis above decoded from that checkpoint.
    import torch

    payload = torch.load(tiny / "exp" / "quick" / "nar" / "best-valid-loss.pt", map_location="cpu",
                         weights_only=False)
    assert payload["config"]["ar_codebook_size"] == 128
    assert payload["model"]["ar_predict_layer.weight"].shape[0] == 129


@pytest.mark.parametrize("codec, width", [("encodec", 1024), ("mel-rvq", 512)])
def test_demo_ar_head_is_as_wide_as_the_corpus_codebook_0(tmp_path, codec, width):
    """egs/tiny/run.sh gives the AR head the width of the tokenized corpus's codebook 0: all 1024
    codes with EnCodec (the trainer refuses a narrower head), the fitted size with mel-rvq."""
    import json

    import torch

    data = tmp_path / "tokenized"
    data.mkdir()
    record = {"codec": codec} if codec == "encodec" else {"codec": codec, "state": "mel_rvq.pt"}
    (data / "audio_codec.json").write_text(json.dumps(record))
    if codec == "mel-rvq":
        torch.save({"sizes": [width] + [1024] * 7}, data / "mel_rvq.pt")
    (tmp_path / "exp" / "ar").mkdir(parents=True)
    (tmp_path / "exp" / "ar" / "best-valid-loss.pt").touch()  # what the NAR stage starts from
    calls = tmp_path / "torchrun.txt"
    fake_python = tmp_path / "python"  # records the trainer's command line instead of training
    fake_python.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m torch.distributed.run" ]; then echo "$@" >> {calls}; '
                           f'exit 0; fi\nexec {sys.executable} "$@"\n')
    fake_python.chmod(0o755)
    subprocess.run(["bash", str(ROOT / "egs/tiny/run.sh"), "--stage", "1", "--stop-stage", "2", "--data", str(data),
                    "--exp", str(tmp_path / "exp"), "--python", str(fake_python)],
                   check=True, timeout=120, capture_output=True)
    ar, nar = [line.split() for line in calls.read_text().splitlines()]
    for args in (ar, nar):
        assert args[args.index("--ar-codebook-size") + 1] == str(width)

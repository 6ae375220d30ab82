import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from valle.data.tiny import VOICES, EspeakSynth, read_sentences

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
    evaluation = json.loads((tiny / "exp" / "quick" / "eval.json").read_text())
    assert len(evaluation["rows"]) == 2
    assert set(evaluation["summary"]) >= {"output", "ground_truth", "codec_resynthesis"}
    for row in evaluation["rows"]:
        assert Path(tiny / row["row"]["out_wav"]).is_file()
    assert (tiny / "exp" / "quick" / "loss-curve.png").stat().st_size > 0

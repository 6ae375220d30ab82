"""The offline judges: the phoneme recogniser hears the right sentence on held-out sentences in
held-out voices, and resemblyzer tells the voices apart."""

from __future__ import annotations

import math

import pytest

from valle.eval.per import edit_distance, error_rate, spoken


def test_per_basics():
    assert edit_distance("kitten", "sitting") == 3
    assert error_rate(["a", "b"], []) == 1.0 and error_rate([], []) == 0.0
    assert error_rate(["a"], ["a", "b", "c"]) == 2.0  # insertions count: PER can exceed 1
    assert spoken(["ð", "ə", "_", "k", "æ", "t", ".", "ɑːɹ", ","]) == ["ð", "ə", "k", "æ", "t", "ɑːɹ"]


def test_judge_per_on_held_out_truth_is_far_below_mismatched_text(judge, test_examples):
    wavs = [w for w, _, _ in test_examples]
    refs = [s for _, s, _ in test_examples]
    texts = [c.supervisions[0].text for _, _, c in test_examples]
    # another sentence's text for each wav (shift by 2: the next row is the same text in the other voice)
    other = [refs[(i + 2) % len(refs)] for i in range(len(refs))]
    assert all(texts[i] != texts[(i + 2) % len(texts)] for i in range(len(texts)))
    own = sum(judge.per(wavs, refs)) / len(wavs)
    mismatched = sum(judge.per(wavs, other)) / len(wavs)
    assert own < 0.6 * mismatched, (own, mismatched)
    assert "judge" not in str(test_examples[0][2].recording.sources[0].source)  # ground truth, not output


def test_judge_round_trips_through_save_load(judge, test_examples, tmp_path):
    from valle.eval.judge import Judge

    loaded = Judge.load(judge.save(tmp_path / "j.pt"))
    wavs = [w for w, _, _ in test_examples[:3]]
    assert loaded.transcribe(wavs) == judge.transcribe(wavs)
    with pytest.raises(FileNotFoundError, match="valle.eval.judge train"):
        Judge.load(tmp_path / "missing.pt")


def test_speaker_similarity_same_voice_above_different_voice(test_examples):
    pytest.importorskip("resemblyzer", reason="pip install 'valle[eval]'")
    from valle.eval.similarity import SpeakerEmbedder

    emb = SpeakerEmbedder("resemblyzer")
    by_voice: dict[str, list] = {}
    for wav, _, cut in test_examples[:12]:
        by_voice.setdefault(cut.supervisions[0].speaker, []).append(wav)
    assert len(by_voice) == 2
    (a, xs), (b, ys) = sorted(by_voice.items())
    same = [emb.similarity(xs[i], 24000, xs[i + 1], 24000) for i in range(len(xs) - 1)]
    same += [emb.similarity(ys[i], 24000, ys[i + 1], 24000) for i in range(len(ys) - 1)]
    diff = [emb.similarity(x, 24000, y, 24000) for x, y in zip(xs, ys)]
    assert not any(math.isnan(v) for v in same + diff)
    assert sum(same) / len(same) > sum(diff) / len(diff) + 0.05, (same, diff)


def test_unavailable_models_say_which_flag(tmp_path):
    from valle.eval.asr import AsrUnavailable, WhisperAsr
    from valle.eval.similarity import SpeakerEmbedder, SpeakerModelUnavailable

    with pytest.raises(AsrUnavailable, match="--whisper-model"):
        WhisperAsr(str(tmp_path / "base.pt"))
    with pytest.raises(SpeakerModelUnavailable, match="--speaker-model-path"):
        SpeakerEmbedder("wavlm", tmp_path / "no-such-dir")

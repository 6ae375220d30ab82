"""bin/tokenizer.py on a manifest with bad items: completes, reports each, tokenizes the rest."""

import shutil

import numpy as np
import soundfile as sf
from lhotse import AudioSource, CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

from valle.data.symbols import SymbolTable
from valle.data.tiny import VOICES, EspeakSynth
from valle.data.validation import ValidationReport


def _write_manifests(tmp_path):
    synth = EspeakSynth.get()
    sr = synth.sample_rate
    wav_dir = tmp_path / "wavs"
    wav_dir.mkdir()
    recs, sups = [], []

    def add(utt, samples, text, recording=None):
        if recording is None:
            path = wav_dir / f"{utt}.wav"
            sf.write(path, samples, sr, subtype="PCM_16")
            recording = Recording.from_file(path, recording_id=utt)
        recs.append(recording)
        sups.append(SupervisionSegment(id=utt, recording_id=utt, start=0.0, duration=recording.duration,
                                       channel=0, text=text, speaker="s1", language="en-us"))

    good_texts = ["The cat sat on the mat.", "Rain fell on the roof.", "Where are my keys?"]
    for i, text in enumerate(good_texts):
        add(f"good{i}", synth.synthesize(text, VOICES[i % len(VOICES)]), text)
    speech = synth.synthesize("Hello there, my friend.", VOICES[0])
    add("chinese", speech, "你好世界，今天天气很好。")
    add("empty", speech, "")
    add("zero", np.zeros(0, dtype=np.int16), "Nothing at all.")
    add("long", np.zeros(60 * sr, dtype=np.int16), "A very long silence.")
    corrupt = wav_dir / "corrupt.wav"
    corrupt.write_bytes(b"RIFF\x00\x00\x00\x00WAVEgarbage" * 10)
    add("corrupt", None, "This audio is broken.",
        Recording(id="corrupt", sources=[AudioSource(type="file", channels=[0], source=str(corrupt))],
                  sampling_rate=sr, num_samples=2 * sr, duration=2.0))
    man = tmp_path / "manifests"
    man.mkdir()
    RecordingSet.from_recordings(recs).to_file(man / "bad_recordings_test.jsonl.gz")
    SupervisionSet.from_segments(sups).to_file(man / "bad_supervisions_test.jsonl.gz")
    return man, good_texts


def test_bad_items_are_reported_and_good_ones_tokenized(tmp_path, tokenizer_cli):
    man, good_texts = _write_manifests(tmp_path)
    out = tmp_path / "tokenized"
    cli = tokenizer_cli
    argv = ["--src-dir", str(man), "--output-dir", str(out), "--prefix", "bad", "--dataset-parts", "test",
            "--allow-random-encodec", "--filter-max-duration", "30"]
    assert cli.main(argv) == 0

    report = ValidationReport.read(out / "bad_bad_cuts_test.tsv")
    reasons = {e.cut_id.split("-")[0]: e.reason for e in report.entries}
    assert reasons == {
        "chinese": "foreign_script",
        "empty": "empty_text",
        "zero": "zero_length_audio",
        "long": "too_long",
        "corrupt": "unreadable_audio",
    }
    cuts = CutSet.from_file(out / "bad_cuts_test.jsonl.gz")
    assert sorted(c.supervisions[0].text for c in cuts) == sorted(good_texts)
    table = SymbolTable.from_file(out / "unique_text_tokens.k2symbols")
    for cut in cuts:
        codes = cut.load_features()
        assert codes.shape[1] == 8 and abs(codes.shape[0] - cut.duration * 75) <= 1
        symbols = cut.supervisions[0].custom["tokens"]["text"]
        assert symbols and all(s in table for s in symbols)
        assert cut.supervisions[0].custom["num_text_tokens"] == len(symbols)

    # Restartable: a finished part is skipped, outputs untouched.
    before = (out / "bad_cuts_test.jsonl.gz").stat().st_mtime_ns
    assert cli.main(argv) == 0
    assert (out / "bad_cuts_test.jsonl.gz").stat().st_mtime_ns == before


def test_text_rate_rule_catches_text_the_audio_cannot_carry():
    from valle.data.text import TextTokenizer
    from valle.data.validation import TEXT_TOO_LONG, check_text_symbols

    text = "This sentence is far too long to be spoken in half a second by anyone at all."
    ph = TextTokenizer().phonemize_one(text)
    assert check_text_symbols(text, "en-us", ph.symbols, ph.language_switches, 0.5)[0] == TEXT_TOO_LONG
    assert check_text_symbols(text, "en-us", ph.symbols, ph.language_switches, 5.0) is None


def test_a_part_tokenized_from_other_manifests_is_refused_not_reused(tmp_path, tokenizer_cli, capsys):
    """A finished part is skipped on a rerun only while its source manifests are unchanged: a
    corpus re-made with other audio or text gets a one-line error naming the part and what to
    delete, not a silent training run on the old tokens."""
    man = tmp_path / "manifests"
    man.mkdir()
    synth = EspeakSynth.get()
    recs, sups = [], []
    for i, text in enumerate(["The cat sat on the mat.", "Rain fell on the roof."]):
        path = tmp_path / f"u{i}.wav"
        sf.write(path, synth.synthesize(text, VOICES[0]), synth.sample_rate, subtype="PCM_16")
        rec = Recording.from_file(path, recording_id=f"u{i}")
        recs.append(rec)
        sups.append(SupervisionSegment(id=f"u{i}", recording_id=f"u{i}", start=0.0, duration=rec.duration,
                                       channel=0, text=text, speaker="s1", language="en-us"))
    RecordingSet.from_recordings(recs).to_file(man / "c_recordings_train.jsonl.gz")
    SupervisionSet.from_segments(sups).to_file(man / "c_supervisions_train.jsonl.gz")
    out = tmp_path / "tokenized"
    argv = ["--src-dir", str(man), "--output-dir", str(out), "--prefix", "c", "--dataset-parts", "train",
            "--allow-random-encodec"]
    assert tokenizer_cli.main(argv) == 0
    assert (out / "c_sources_train.json").is_file()
    # the same manifests written again (gzip stamps another time): still the same part, skipped
    RecordingSet.from_recordings(recs).to_file(man / "c_recordings_train.jsonl.gz")
    before = (out / "c_cuts_train.jsonl.gz").stat().st_mtime_ns
    assert tokenizer_cli.main(argv) == 0
    assert (out / "c_cuts_train.jsonl.gz").stat().st_mtime_ns == before
    # the corpus changed (one more sentence's text differs): refused, naming the part and the fix
    sups[1] = SupervisionSegment(id="u1", recording_id="u1", start=0.0, duration=recs[1].duration,
                                 channel=0, text="Snow fell on the roof.", speaker="s1", language="en-us")
    SupervisionSet.from_segments(sups).to_file(man / "c_supervisions_train.jsonl.gz")
    capsys.readouterr()
    assert tokenizer_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "part 'train'" in err and "corpus changed" in err and "c_*_train*" in err
    assert (out / "c_cuts_train.jsonl.gz").stat().st_mtime_ns == before
    for path in out.glob("c_*_train*"):  # what the message says to delete
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert tokenizer_cli.main(argv) == 0
    assert [c.supervisions[0].text for c in CutSet.from_file(out / "c_cuts_train.jsonl.gz")][1] == \
        "Snow fell on the roof."

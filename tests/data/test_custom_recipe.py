"""egs/custom: a folder of your own audio -> tokenized corpus, on small corpora that the tests
write with eSpeak NG in each transcript layout (sidecar .txt/.lab, LJSpeech metadata.csv, Kaldi
wav.scp + text + utt2spk), with the files real folders hold: a stereo 44.1 kHz flac, an mp3, a
long recording with and without a transcript, a file without a transcript, a silent file, an
unreadable file, a foreign-script transcript. The sidecar corpus runs prepare.sh end to end
through bin/tokenizer.py (random EnCodec weights) and the trainer takes 2 steps on it."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from data_testlib import ROOT, run_recipe

from valle.data import custom as C
from valle.data.validation import ValidationReport

TOKENIZER_FLAGS = "--allow-random-encodec --download-encodec false --chunk-size 4 --batch-duration 4"
SENTENCES = ["The cat sat down.", "Rain fell all day.", "Where is my hat?", "We walked home slowly.",
             "A small bird sang.", "Open the door, please.", "She smiled at him.", "It is late now."]
MAX_SEGMENT = 4.0  # seconds: the long recordings below are about 9 s
GAP_S = 0.7  # the silence between the long recordings' sentences


def speak(text: str, voice_index: int) -> tuple[np.ndarray, int]:
    from valle.data.tiny import VOICES, EspeakSynth, trim_silence

    synth = EspeakSynth.get()
    samples = trim_silence(synth.synthesize(text, VOICES[voice_index]), synth.sample_rate)
    return samples.astype(np.float32) / 32768.0, synth.sample_rate


def long_recording(voice_index: int) -> tuple[np.ndarray, int, list[tuple[float, float]]]:
    """Sentences joined by GAP_S of silence; returns the audio and where the gaps are (s)."""
    parts, gaps, t = [], [], 0.0
    for text in SENTENCES[:6]:
        x, sr = speak(text, voice_index)
        if parts:
            parts.append(np.zeros(int(GAP_S * sr), np.float32))
            gaps.append((t, t + GAP_S))
            t += GAP_S
        parts.append(x)
        t += x.size / sr
    return np.concatenate(parts), sr, gaps


def write_speech(path: Path, text: str, voice_index: int, stereo_rate: int | None = None) -> None:
    x, sr = speak(text, voice_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    if stereo_rate:  # 44.1 kHz stereo: left the voice, right a quieter copy
        import torch

        from valle.codec.audio import resample

        x = resample(torch.from_numpy(x), sr, stereo_rate).numpy()
        x, sr = np.stack([x, 0.5 * x], axis=1), stereo_rate
    sf.write(path, x, sr)


def write_sidecar_corpus(root: Path) -> dict:
    """spk_a/, spk_b/ with .txt/.lab transcripts, and the awkward files; returns what to expect."""
    corpus = root / "mine"
    for i, text in enumerate(SENTENCES[:3]):
        write_speech(corpus / "spk_a" / f"a{i}.wav", text, 0)
        (corpus / "spk_a" / f"a{i}.{'lab' if i == 1 else 'txt'}").write_text(text + "\n")
    write_speech(corpus / "spk_a" / "stereo.flac", SENTENCES[3], 0, stereo_rate=44100)
    (corpus / "spk_a" / "stereo.txt").write_text(SENTENCES[3])
    expected = {"good": {"spk_a_a0", "spk_a_a1", "spk_a_a2", "spk_a_stereo", "spk_b_b0", "spk_b_b1", "spk_b_b2"}}
    try:
        write_speech(corpus / "spk_a" / "compressed.mp3", SENTENCES[4], 0)
        (corpus / "spk_a" / "compressed.txt").write_text(SENTENCES[4])
        expected["good"].add("spk_a_compressed")
    except Exception:  # libsndfile without mp3 (< 1.1): the corpus goes without one
        pass
    for i, text in enumerate(SENTENCES[4:7]):
        write_speech(corpus / "spk_b" / f"b{i}.wav", text, 1)
        (corpus / "spk_b" / f"b{i}.txt").write_text(text)
    write_speech(corpus / "spk_b" / "untranscribed.wav", SENTENCES[7], 1)
    x, sr, gaps = long_recording(1)
    sf.write(corpus / "spk_b" / "long_untranscribed.wav", x, sr)
    sf.write(corpus / "spk_b" / "long_transcribed.wav", x, sr)
    (corpus / "spk_b" / "long_transcribed.txt").write_text(" ".join(SENTENCES[:6]))
    sf.write(corpus / "spk_b" / "silent.wav", np.zeros(sr, np.float32), sr)
    (corpus / "spk_b" / "silent.txt").write_text("Nothing to hear.")
    (corpus / "spk_b" / "broken.wav").write_bytes(b"RIFF\x00\x00not really a wav file")
    (corpus / "spk_b" / "broken.txt").write_text("Cannot be read.")
    write_speech(corpus / "spk_a" / "foreign.wav", SENTENCES[0], 0)
    (corpus / "spk_a" / "foreign.txt").write_text("你好世界")
    expected.update(gaps=gaps, long_duration=x.size / sr, reasons={
        "spk_b_untranscribed": C.NO_TRANSCRIPT, "spk_b_long_transcribed": "too_long",
        "spk_b_silent": C.SILENT_AUDIO, "spk_b_broken": "unreadable_audio"})
    return {"corpus": corpus, **expected}


def read_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def manifests(corpus: Path, out: Path, *flags: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "valle.data.custom", "manifests", "--corpus-dir", str(corpus),
                           "--output-dir", str(out), "--max-segment-duration", str(MAX_SEGMENT), *flags],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    """The sidecar corpus through every stage of egs/custom/prepare.sh."""
    root = tmp_path_factory.mktemp("custom")
    corpus = write_sidecar_corpus(root)
    data = root / "data"
    rc, out, err = run_recipe("egs/custom/prepare.sh", "--corpus-dir", str(corpus["corpus"]), "--data-dir",
                              str(data), "--max-segment-duration", str(MAX_SEGMENT), "--num-jobs", "0",
                              "--device", "cpu", "--valid-fraction", "0.2",
                              "--whisper-model", str(root / "no-whisper.pt"),
                              "--extra-tokenizer-flags", TOKENIZER_FLAGS, timeout=400)
    assert rc == 0, out[-3000:] + err[-3000:]
    return corpus, data, out + err


def test_every_stage_runs_and_names_each_bad_file(sidecar):
    corpus, data, log = sidecar
    assert "Traceback" not in log
    report = {e.cut_id: e for e in ValidationReport.read(data / "manifests" / "custom_bad_items.tsv").entries}
    for utt_id, reason in corpus["reasons"].items():
        assert report[utt_id].reason == reason, (utt_id, report.get(utt_id))
    assert "--max-segment-duration" in report["spk_b_long_transcribed"].detail  # refused, and why
    assert "broken.wav" in report["spk_b_broken"].detail
    # Whisper's weights are not there: the untranscribed file and every piece of the long one
    # stay out, each by name, and the log says so
    pieces = sorted(k for k in report if k.startswith("spk_b_long_untranscribed-"))
    assert len(pieces) >= 3 and all(report[k].reason == C.NO_TRANSCRIPT for k in pieces)
    assert "Whisper unavailable" in log
    tokenizer_report = {e.cut_id: e.reason for e in
                        ValidationReport.read(data / "tokenized" / "custom_bad_cuts_all.tsv").entries}
    assert tokenizer_report == {"spk_a_foreign": "foreign_script"}


def test_tokenized_cuts_hold_the_good_files_at_the_codec_rate(sidecar):
    from lhotse import CutSet

    corpus, data, _ = sidecar
    tok = data / "tokenized"
    train, dev = (CutSet.from_file(tok / f"custom_cuts_{p}.jsonl.gz") for p in ("train", "dev"))
    ids = {c.id for c in train} | {c.id for c in dev}
    assert ids == corpus["good"]
    assert not {c.id for c in train} & {c.id for c in dev}
    speakers = {c.supervisions[0].speaker: c for c in train}
    assert set(speakers) == {"spk_a", "spk_b"}  # from the folders; both kept in train
    stereo = next(c for c in [*train, *dev] if c.id == "spk_a_stereo")
    assert stereo.sampling_rate == 24000 and stereo.load_audio().shape[-1] == stereo.num_samples
    assert stereo.supervisions[0].text == SENTENCES[3]
    assert all(c.supervisions[0].custom["tokens"]["text"] for c in train)
    assert (tok / "unique_text_tokens.k2symbols").is_file()


def test_a_stereo_file_is_tokenized_from_the_mean_of_its_channels(sidecar):
    # left the voice, right a copy at half the level: the codec hears 0.75 x the voice
    from lhotse import CutSet

    from valle.data.pipeline import AudioLoadDataset

    _, data, _ = sidecar
    tok = data / "tokenized"
    cuts = [c for p in ("train", "dev") for c in CutSet.from_file(tok / f"custom_cuts_{p}.jsonl.gz")]
    stereo = next(c for c in cuts if c.id == "spk_a_stereo")
    assert stereo.channel == [0, 1] and stereo.supervisions[0].channel == [0, 1]
    left, right = stereo.load_audio()
    assert np.abs(left).max() > 0.05 and np.allclose(right, 0.5 * left, atol=1e-3)
    _, heard, reason, _ = AudioLoadDataset([stereo])[0]  # what bin/tokenizer.py feeds the codec
    assert reason is None and heard.shape == left.shape
    np.testing.assert_allclose(heard.numpy(), (left + right) / 2, atol=1e-6)
    assert not np.allclose(heard.numpy(), left, atol=1e-2)


def test_the_silence_checks_hear_every_channel(tmp_path):
    # speech on the right channel only: channel 0 alone would be silent
    from valle.data.custom import VAD_RATE, load_for_vad

    t = np.arange(VAD_RATE) / VAD_RATE
    tone = (0.4 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    sf.write(tmp_path / "right.wav", np.stack([np.zeros_like(tone), tone], axis=1), VAD_RATE)
    recording, samples = load_for_vad(tmp_path / "right.wav")
    assert recording.channel_ids == [0, 1] and samples.shape == tone.shape
    np.testing.assert_allclose(samples, tone / 2, atol=1e-3)


def test_the_split_is_by_utterance_deterministic_and_keeps_every_speaker_in_train(sidecar, tmp_path):
    _, data, _ = sidecar
    tok = data / "tokenized"
    again = C.split_held_out(tok / "custom_cuts_all.jsonl.gz", tmp_path, "custom", fraction=0.2)
    for part in ("train", "dev"):
        assert read_gz(tmp_path / f"custom_cuts_{part}.jsonl.gz") == read_gz(tok / f"custom_cuts_{part}.jsonl.gz")
    assert again["dev"] >= 1
    from valle.data.extremes import Extremes

    for part, n in again.items():  # what the trainer's start-up reads, as for tokenized parts
        assert Extremes.read(tok / f"custom_extremes_{part}.json").count == n
    assert C.held_out_counts({"a": 10, "b": 1, "c": 2}, 0.2, 1) == {"a": 2, "b": 0, "c": 0}
    assert C.held_out_counts({"a": 3, "b": 2}, 0.1, 2) == {"a": 1, "b": 1}
    assert C.held_out_counts({"a": 1}, 0.5, 1) == {"a": 0}  # one utterance stays in train


@pytest.mark.timeout(300)
def test_the_trainer_takes_two_steps_on_the_result(sidecar, tmp_path):
    from tests.support.scenarios import TINY_MODEL

    _, data, _ = sidecar
    exp = tmp_path / "exp"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "trainer.py"), *TINY_MODEL, "--manifest-dir", str(data / "tokenized"),
         "--dataset", "custom", "--exp-dir", str(exp), "--max-steps", "2", "--max-duration", "8",
         "--num-workers", "0", "--train-stage", "1", "--valid-interval", "1000", "--save-every-n", "1000"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(exp.glob("*.pt")), sorted(p.name for p in exp.iterdir())


def test_long_untranscribed_recordings_are_cut_inside_their_silences(sidecar, tmp_path):
    corpus, _, _ = sidecar
    out = tmp_path / "manifests"
    rc, log = manifests(corpus["corpus"], out)
    assert rc == 0, log
    pending = [e["supervision"] for e in read_gz(out / "custom_untranscribed_all.jsonl.gz")
               if e["supervision"]["recording_id"] == "spk_b_long_untranscribed"]
    assert len(pending) >= 3
    for before, after in zip(pending, pending[1:]):
        cut_end, cut_start = before["start"] + before["duration"], after["start"]
        # each cut falls in one of the gaps written between sentences
        assert any(g0 - 0.05 <= cut_start and cut_end <= g1 + 0.05 for g0, g1 in corpus["gaps"]), (cut_end, cut_start)
    assert all(s["duration"] <= MAX_SEGMENT for s in pending)
    assert pending[0]["start"] <= 0.2 and pending[-1]["start"] + pending[-1]["duration"] >= corpus["long_duration"] - 0.2


def test_whisper_transcripts_join_the_manifests_and_leave_the_report(sidecar, tmp_path):
    corpus, _, _ = sidecar
    out = tmp_path / "manifests"
    assert manifests(corpus["corpus"], out)[0] == 0
    heard = []

    def fake_whisper(samples: np.ndarray, rate: int, language: str) -> str:
        heard.append((samples.size / rate, language))
        return f"words {len(heard)}"

    done, report = C.transcribe_pending(out, "custom", fake_whisper)
    assert done == len(heard) >= 4 and all(lang == "en-us" for _, lang in heard)
    assert C.NO_TRANSCRIPT not in report.counts
    assert report.counts == ValidationReport.read(out / "custom_bad_items.tsv").counts
    sups = {s["id"]: s for s in read_gz(out / "custom_supervisions_all.jsonl.gz")}
    assert sups["spk_b_untranscribed"]["text"].startswith("words ")
    assert sups["spk_b_untranscribed"]["custom"]["transcribed_by"] == "whisper"
    assert {s["recording_id"] for s in sups.values()} <= {r["id"] for r in read_gz(out / "custom_recordings_all.jsonl.gz")}
    assert read_gz(out / "custom_untranscribed_all.jsonl.gz") == []


def test_ljspeech_layout_with_normalized_text_and_a_file_it_does_not_list(tmp_path):
    corpus = tmp_path / "lj"
    for i in range(3):
        write_speech(corpus / "wavs" / f"LJ001-{i:04d}.wav", SENTENCES[i], 2)
    rows = ["LJ001-0000|Dr. Who.|Doctor Who.", f"LJ001-0001|{SENTENCES[1]}", "LJ001-0009|No audio here.", "bad-line"]
    (corpus / "metadata.csv").write_text("\n".join(rows) + "\n")
    rc, log = manifests(corpus, tmp_path / "out")
    assert rc == 0, log
    sups = {s["id"]: s for s in read_gz(tmp_path / "out" / "custom_supervisions_all.jsonl.gz")}
    assert set(sups) == {"LJ001-0000", "LJ001-0001"}
    assert sups["LJ001-0000"]["custom"]["normalized_text"] == "Doctor Who."
    assert {s["speaker"] for s in sups.values()} == {"lj"}  # one speaker: the corpus folder
    report = {e.cut_id: e.reason for e in ValidationReport.read(tmp_path / "out" / "custom_bad_items.tsv").entries}
    assert report == {"LJ001-0009": "no_recording", "bad-line": "bad_manifest_item", "LJ001-0002": C.NO_TRANSCRIPT}


def test_kaldi_layout_takes_speakers_from_utt2spk_and_languages_per_speaker(tmp_path):
    corpus = tmp_path / "kaldi"
    for i in range(3):
        write_speech(corpus / "audio" / f"u{i}.wav", SENTENCES[i], i % 2)
    (corpus / "wav.scp").write_text("u0 audio/u0.wav\nu1 audio/u1.wav\nu2 audio/u2.wav\nu3 sox x.wav -t wav - |\n")
    (corpus / "text").write_text(f"u0 {SENTENCES[0]}\nu1 {SENTENCES[1]}\nu2 Guten Tag.\nu9 orphan text\n")
    (corpus / "utt2spk").write_text("u0 anna\nu1 anna\nu2 ben\n")
    (corpus / "spk2lang").write_text("# speaker language\nben de\n")
    rc, log = manifests(corpus, tmp_path / "out")
    assert rc == 0, log
    sups = {s["id"]: s for s in read_gz(tmp_path / "out" / "custom_supervisions_all.jsonl.gz")}
    assert {k: (s["speaker"], s["language"]) for k, s in sups.items()} == {
        "u0": ("anna", "en-us"), "u1": ("anna", "en-us"), "u2": ("ben", "de")}
    report = {e.cut_id: e.reason for e in ValidationReport.read(tmp_path / "out" / "custom_bad_items.tsv").entries}
    assert report == {"u3": "unreadable_audio", "u9": "no_recording"}


def test_a_bad_language_or_corpus_is_one_error_line_naming_it(tmp_path):
    corpus = tmp_path / "c"
    write_speech(corpus / "x.wav", SENTENCES[0], 0)
    (corpus / "speakers.tsv").write_text("speaker\tlanguage\nc\tnot-a-language\n")
    rc, log = manifests(corpus, tmp_path / "out")
    assert rc == 2 and "speakers.tsv:2: speaker c" in log and "Traceback" not in log
    rc, log = manifests(tmp_path / "missing", tmp_path / "out")
    assert rc == 2 and "no such folder" in log


def test_kaldi_segments_give_a_long_recording_one_transcript_per_segment(tmp_path):
    corpus = tmp_path / "kaldi"
    corpus.mkdir()
    x, sr, gaps = long_recording(0)
    sf.write(corpus / "talk.wav", x, sr)
    bounds = [0.0, *[g for gap in gaps for g in gap], x.size / sr]  # sentence i: bounds[2i]..bounds[2i+1]
    sentences = [(bounds[2 * i], bounds[2 * i + 1]) for i in range(len(bounds) // 2)]
    (corpus / "wav.scp").write_text("talk talk.wav\n")
    lines = [f"talk-{i} talk {a:.2f} {b:.2f}" for i, (a, b) in enumerate(sentences)]
    lines.append(f"talk-both talk {sentences[0][0]:.2f} {sentences[3][1]:.2f}")  # over --max-segment-duration
    lines.append(f"talk-past talk {x.size / sr - 0.5:.2f} {x.size / sr + 3:.2f}")  # outside the recording
    (corpus / "segments").write_text("\n".join(lines) + "\n")
    texts = [f"talk-{i} {SENTENCES[i]}" for i in range(len(sentences) - 1)]  # the last has no text
    (corpus / "text").write_text("\n".join([*texts, f"talk-both {SENTENCES[0]}", "talk-past Late."]) + "\n")
    (corpus / "utt2spk").write_text("".join(f"talk-{i} carol\n" for i in range(len(sentences))))
    rc, log = manifests(corpus, tmp_path / "out")
    assert rc == 0, log
    sups = {s["id"]: s for s in read_gz(tmp_path / "out" / "custom_supervisions_all.jsonl.gz")}
    last = len(sentences) - 1
    assert set(sups) == {f"talk-{i}" for i in range(last)}
    assert all(s["recording_id"] == "talk" and s["speaker"] == "carol" for s in sups.values())
    assert sups["talk-1"]["text"] == SENTENCES[1] and sups["talk-1"]["start"] == pytest.approx(sentences[1][0], abs=0.01)
    report = {e.cut_id: e.reason for e in ValidationReport.read(tmp_path / "out" / "custom_bad_items.tsv").entries}
    assert report == {"talk-both": "too_long", "talk-past": "segment_outside_recording", f"talk-{last}": C.NO_TRANSCRIPT}


def test_whisper_is_asked_for_english_speakers_only():
    import importlib.util

    spec = importlib.util.spec_from_file_location("custom_transcribe", ROOT / "egs/custom/local/transcribe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class FakeAsr:
        def transcribe(self, wav, sr):
            return f"{wav.numel()} samples at {sr}"

    transcribe = module.english_only(FakeAsr())
    samples = np.zeros(160, np.float32)
    assert transcribe(samples, 16000, "en-us") == "160 samples at 16000"
    assert transcribe(samples, 16000, "") == "160 samples at 16000"  # no language: the default, English
    assert transcribe(samples, 16000, "de") is None  # stays reported as no_transcript


def test_run_sh_trains_the_custom_dataset(tmp_path):
    fake = tmp_path / "python"  # a stand-in for python that prints what egs/train.sh launches
    fake.write_text('#!/usr/bin/env bash\necho "LAUNCH $*"\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "egs/custom/run.sh"), "--python", str(fake), "--nproc", "1"],
                          env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    launches = [line for line in proc.stdout.splitlines() if line.startswith("LAUNCH -m torch.distributed.run")]
    assert len(launches) == 2 and all("--dataset custom" in line for line in launches)


def test_a_transcript_that_is_not_utf8_is_named_not_guessed(tmp_path):
    corpus = tmp_path / "c"
    write_speech(corpus / "spk" / "ok.wav", SENTENCES[0], 0)
    (corpus / "spk" / "ok.txt").write_text(SENTENCES[0])
    write_speech(corpus / "spk" / "latin1.wav", SENTENCES[1], 0)
    (corpus / "spk" / "latin1.txt").write_bytes("Caf\u00e9 au lait.".encode("latin-1"))
    rc, log = manifests(corpus, tmp_path / "out")
    assert rc == 0, log
    report = ValidationReport.read(tmp_path / "out" / "custom_bad_items.tsv").entries
    assert [(e.cut_id, e.reason) for e in report] == [("spk_latin1", "bad_manifest_item")]
    assert "latin1.txt: not UTF-8" in report[0].detail
    (corpus / "metadata.csv").write_bytes("spk_ok|Caf\u00e9.\n".encode("latin-1"))  # now the ljspeech layout
    rc, log = manifests(corpus, tmp_path / "out")
    assert rc == 2 and "metadata.csv: not UTF-8" in log and "Traceback" not in log


def test_a_piece_without_a_pause_is_reported_under_its_own_id_and_the_others_keep_theirs():
    rate = C.VAD_RATE

    def tone(seconds: float) -> np.ndarray:
        return 0.3 * np.sin(2 * np.pi * 200 * np.arange(int(seconds * rate)) / rate).astype(np.float32)

    def quiet(seconds: float) -> np.ndarray:
        return np.zeros(int(seconds * rate), np.float32)

    # 3 s of sound, 1 s pause, 6 s without a pause, 1 s pause, 1 s of sound
    samples = np.concatenate([tone(3), quiet(1), tone(6), quiet(1), tone(1)])
    cfg = C.PrepareConfig(Path("."), Path("."), max_segment_duration=MAX_SEGMENT)
    report = ValidationReport()
    item = C.SourceItem("rec", Path("rec.wav"), "spk")
    pieces = C.segments_of(item, samples.size / rate, samples, cfg, report)
    assert [i for i, _ in pieces] == ["rec-000", "rec-002"]
    assert pieces[0][1].start == 0.0 and 3.0 < pieces[0][1].end <= 3.2
    assert 10.8 <= pieces[1][1].start < 11.0 and pieces[1][1].end == pytest.approx(12.0, abs=0.05)
    assert [(e.cut_id, e.reason) for e in report.entries] == [("rec-001", "too_long")]
    assert "no silence" in report.entries[0].detail
    # with a transcript the same recording is refused whole: no alignment to cut it by
    report = ValidationReport()
    item.text = "A transcript of all of it."
    assert C.segments_of(item, samples.size / rate, samples, cfg, report) == []
    assert [(e.cut_id, e.reason) for e in report.entries] == [("rec", "too_long")]


def test_run_sh_fine_tunes_with_lora_in_two_stages(tmp_path):
    fake = tmp_path / "python"  # a stand-in for python that prints what egs/train.sh launches
    fake.write_text('#!/usr/bin/env bash\necho "LAUNCH $*"\n')
    fake.chmod(0o755)
    run = ["bash", str(ROOT / "egs/custom/run.sh"), "--python", str(fake), "--nproc", "1"]
    proc = subprocess.run([*run, "--start-from", "base.pt", "--lora-rank", "16", "--text-tokens", "t.k2"],
                          env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    launches = [line for line in proc.stdout.splitlines() if line.startswith("LAUNCH -m torch.distributed.run")]
    assert [line.split("--train-stage ")[1].split()[0] for line in launches] == ["1", "2"]
    for line in launches:
        for flags in ("--start-from base.pt --lora-rank 16 --lora-alpha 32", "--optimizer-name AdamW "
                      "--scheduler-name Cosine --base-lr 5e-4", "--max-steps 2000", "--valid-samples 4",
                      "--exp-dir exp/lora", "--text-tokens t.k2"):
            assert flags in line, line
    proc = subprocess.run([*run, "--lora-rank", "16"], env=dict(os.environ), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "--lora-rank needs --start-from" in proc.stderr

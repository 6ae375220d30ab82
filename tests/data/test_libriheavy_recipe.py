"""The Libriheavy recipe (egs/libriheavy), every stage as a user runs it, on a small corpus in
the real layout: Libriheavy's published cut manifests (segments of long LibriLight recordings,
texts/pre_texts, source paths under download/librilight/) and LibriLight's flac tree
elsewhere (fake audio; the download stage finds both and skips); then a 2-step training run
on what it made."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from data_testlib import run_recipe, run_sh_launches, tone, train_two_steps

pytestmark = pytest.mark.timeout(600)

TOKENIZER_FLAGS = "--allow-random-encodec --download-encodec false --chunk-size 2 --batch-duration 4"
SR = 16000
# (book text, cased and punctuated; the ASR text) per segment of the long recording
LONG_SEGMENTS = [("The cat sat down.", "THE CAT SAT DOWN"), ("\"Where is it?\" she asked.", "WHERE IS IT SHE ASKED"),
                 ("Rain fell today.", "RAIN FELL TODAY"), ("We walked home.", "WE WALKED HOME")]
HELD_OUT = {"dev": ("A bird sang.", "A BIRD SANG"), "test_clean": ("Open the door.", "OPEN THE DOOR"),
            "test_other": ("It is late now.", "IT IS LATE NOW")}
PITCHES = [220.0, 330.0, 440.0, 550.0]  # one per segment of the long recording


def _write_jsonl_gz(path: Path, items: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for d in items:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def _read(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _flac(librilight: Path, rel: str, audio: np.ndarray) -> dict:
    """A LibriLight flac at ``rel`` and its recording dict as Libriheavy publishes it."""
    path = librilight / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, audio, SR, format="FLAC")
    rec_id = rel.removesuffix(".flac")
    return {"id": rec_id, "sources": [{"type": "file", "channels": [0], "source": f"download/librilight/{rel}"}],
            "sampling_rate": SR, "num_samples": len(audio), "duration": len(audio) / SR, "channel_ids": [0]}


def _long_recording() -> np.ndarray:
    """0.5 s of silence, then one 2 s sine per segment, each at its own pitch: a segment's
    audio tells which span of the recording it came from."""
    t = np.arange(2 * SR) / SR
    blocks = [np.zeros(SR // 2)] + [0.3 * np.sin(2 * np.pi * f * t) for f in PITCHES]
    return np.concatenate(blocks).astype(np.float32)


def _dominant_hz(audio: np.ndarray, sr: int) -> float:
    spectrum = np.abs(np.fft.rfft(audio))
    return float(np.argmax(spectrum) * sr / len(audio))


def _cut(rec: dict, index: int, start: float, duration: float, texts: tuple[str, str], speaker: str) -> dict:
    cut_id = f"{rec['id']}_{index}"
    return {"id": cut_id, "start": start, "duration": duration, "channel": 0,
            "supervisions": [{"id": cut_id, "recording_id": rec["id"], "start": 0, "duration": duration,
                              "channel": 0, "language": "English", "speaker": speaker,
                              "custom": {"texts": list(texts), "pre_texts": ["...before. " * 50, "BEFORE " * 50],
                                         "begin_byte": 100 * index, "end_byte": 100 * index + 60}}],
            "recording": rec, "custom": {"text_path": "download/librilight_text/output_text_small_cleaned/x/text.txt"},
            "type": "MonoCut"}


def make_libriheavy(root: Path) -> tuple[Path, Path, dict]:
    """libriheavy/libriheavy_cuts_{small,dev,test_clean,test_other}.jsonl.gz and librilight/
    {small,...}/{speaker}/{book}/{file}.flac. small: four segments (start > 0) of one 9 s
    recording, and a cut whose flac is not there; each held-out part one segment of its own."""
    manifests, librilight = root / "libriheavy", root / "librilight"
    long_rec = _flac(librilight, "small/100/sea_fairies_64kb_mp3/01_baum_sea_fairies_64kb.flac", _long_recording())
    small = [_cut(long_rec, i, 0.5 + 2.0 * i, 1.3, texts, "100") for i, texts in enumerate(LONG_SEGMENTS)]
    ghost = dict(long_rec, id="small/200/lost_book/lost",
                 sources=[{"type": "file", "channels": [0], "source": "download/librilight/small/200/lost_book/lost.flac"}])
    small.append(_cut(ghost, 0, 1.0, 1.2, ("The end came.", "THE END CAME"), "200"))
    _write_jsonl_gz(manifests / "libriheavy_cuts_small.jsonl.gz", small)
    for k, (part, texts) in enumerate(HELD_OUT.items()):
        rec = _flac(librilight, f"medium/{300 + k}/book_{k}/chapter_{k}.flac", tone(4.0, SR, 10 + k))
        _write_jsonl_gz(manifests / f"libriheavy_cuts_{part}.jsonl.gz", [_cut(rec, 0, 1.5, 1.2, texts, str(300 + k))])
    return manifests, librilight, {"long": long_rec, "small": small, "ghost": small[-1]["id"]}


@pytest.fixture(scope="module")
def libriheavy(tmp_path_factory):
    root = tmp_path_factory.mktemp("libriheavy")
    manifests, librilight, made = make_libriheavy(root)
    data = root / "data"
    # stage 2 through --tokenizer-launcher (torchrun on a cluster): a stand-in that notes its call
    launcher = root / "launcher"
    launcher.write_text(f'#!/usr/bin/env bash\necho "$*" >> {root}/launched\nexec {sys.executable} "$@"\n')
    launcher.chmod(0o755)
    rc, out, err = run_recipe("egs/libriheavy/prepare.sh", "--data-dir", str(data), "--manifests-dir",
                              str(manifests), "--librilight-dir", str(librilight), "--dataset-parts",
                              "small dev test_clean test_other", "--num-jobs", "0", "--stop-stage", "5",
                              "--shar-shard-size", "2", "--extra-tokenizer-flags", TOKENIZER_FLAGS,
                              "--tokenizer-launcher", str(launcher), timeout=400)
    assert rc == 0, out[-3000:] + err[-3000:]
    launched = (root / "launched").read_text().splitlines()
    assert len(launched) == 1 and launched[0].split()[0].endswith("bin/tokenizer.py")
    return data, made, out + err


def test_every_stage_runs_and_the_download_is_skipped(libriheavy):
    data, _, log = libriheavy
    assert "Traceback" not in log
    assert "not downloaded again" in log
    tok = data / "tokenized"
    for part in ("small", "dev", "test_clean", "test_other"):
        assert (tok / f"libriheavy_cuts_{part}.jsonl.gz").is_file(), part
    assert "libriheavy_cuts_train.jsonl.gz: 4 cuts" in log  # stage 4

def test_train_gets_the_extremes_record_of_its_cuts_from_combine(libriheavy):
    # made in combine's pass: the same record a pass over train's lhotse cuts makes
    from lhotse import CutSet

    from valle.data.extremes import Extremes

    data, _, log = libriheavy
    tok = data / "tokenized"
    record = Extremes.read(tok / "libriheavy_extremes_train.json")
    assert record.count == 4
    assert record.to_json() == Extremes.of(CutSet.from_file(tok / "libriheavy_cuts_train.jsonl.gz")).to_json()
    assert "combine: extremes record of libriheavy_cuts_train.jsonl.gz (4 cuts)" in log


def test_shar_shards_read_back_with_the_slashed_cut_ids(libriheavy):
    # Libriheavy's cut ids are paths ("small/100/book/file_0"): HDF5 keys and Shar members hold them
    from lhotse import CutSet

    data, made, _ = libriheavy
    shar = list(CutSet.from_shar(in_dir=data / "shar" / "train"))
    assert sorted(c.id for c in shar) == sorted(c["id"] for c in made["small"][:4])
    assert all(c.load_features().shape[1] == 8 for c in shar)


def test_manifests_place_each_segment_in_its_recording_under_the_users_librilight(libriheavy):
    data, made, _ = libriheavy
    man = data / "manifests"
    recs = _read(man / "libriheavy_recordings_small.jsonl.gz")
    assert [r["id"] for r in recs] == [made["long"]["id"]]  # four segments, one recording
    source = Path(recs[0]["sources"][0]["source"])
    assert source.is_file() and "download/librilight" not in str(source)
    sups = _read(man / "libriheavy_supervisions_small.jsonl.gz")
    assert [s["start"] for s in sups] == [0.5, 2.5, 4.5, 6.5]  # the cuts' starts, in the recording
    # the book's cased, punctuated text; pre_texts and byte offsets are not carried along
    assert [s["text"] for s in sups] == [t for t, _ in LONG_SEGMENTS]
    assert all("custom" not in s or "pre_texts" not in (s["custom"] or {}) for s in sups)


def test_a_cut_whose_flac_is_missing_is_listed_not_dropped_silently(libriheavy):
    from valle.data.validation import ValidationReport

    data, made, log = libriheavy
    report = ValidationReport.read(data / "manifests" / "libriheavy_skipped_small.tsv")
    assert [(e.cut_id, e.reason) for e in report.entries] == [(made["ghost"], "missing_audio")]
    assert "lost.flac" in report.entries[0].detail
    assert "part small: 4 utterances" in log and "missing_audio 1" in log


def test_tokenized_segments_hold_the_codes_of_their_own_span(libriheavy):
    from lhotse import CutSet

    data, made, _ = libriheavy
    cuts = CutSet.from_file(data / "tokenized" / "libriheavy_cuts_train.jsonl.gz")
    assert sorted(c.id for c in cuts) == sorted(c["id"] for c in made["small"][:4])
    pitch = {c["id"]: f for c, f in zip(made["small"], PITCHES)}
    for cut in cuts:
        sup = cut.supervisions[0]
        assert sup.custom["tokens"]["text"] and sup.custom["espeak_voice"] == "en-us"
        assert cut.sampling_rate == 24000 and cut.features.sampling_rate == 24000
        codes = cut.load_features()
        assert codes.shape[1] == 8 and abs(codes.shape[0] - round(cut.duration * 75)) <= 1
        # the segment's audio is its own span of the long recording (resampled to 24 kHz)
        audio = cut.load_audio()[0]
        assert len(audio) == cut.num_samples
        assert abs(_dominant_hz(audio, 24000) - pitch[cut.id]) < 5, cut.id


def test_run_sh_trains_two_steps_on_the_tokenized_cuts(libriheavy, tmp_path):
    data, _, _ = libriheavy
    launches = run_sh_launches("egs/libriheavy/run.sh", tmp_path)
    assert len(launches) == 2 and all("--dataset libriheavy" in x for x in launches)  # AR, then NAR
    train_two_steps(data / "tokenized", "libriheavy", tmp_path / "exp")


def test_text_upper_takes_the_asr_transcript(tmp_path):
    from valle.data.libriheavy import main

    manifests, librilight, _ = make_libriheavy(tmp_path)
    out = tmp_path / "manifests"
    assert main(["prepare", "--manifests-dir", str(manifests), "--librilight-dir", str(librilight),
                 "--output-dir", str(out), "--parts", "small", "--text", "upper"]) == 0
    assert [s["text"] for s in _read(out / "libriheavy_supervisions_small.jsonl.gz")] == [
        u for _, u in LONG_SEGMENTS]


def test_wrong_parts_and_directories_are_one_error_line(tmp_path, capsys):
    from valle.data.libriheavy import main

    manifests, librilight, _ = make_libriheavy(tmp_path)
    common = ["prepare", "--manifests-dir", str(manifests), "--output-dir", str(tmp_path / "o")]
    assert main([*common, "--librilight-dir", str(librilight), "--parts", "train-clean-100"]) == 2
    assert "unknown Libriheavy part(s) ['train-clean-100']" in capsys.readouterr().err
    assert main([*common, "--librilight-dir", str(tmp_path / "nowhere"), "--parts", "small"]) == 2
    assert "--librilight-dir" in capsys.readouterr().err
    (manifests / "libriheavy_cuts_dev.jsonl.gz").unlink()
    assert main([*common, "--librilight-dir", str(librilight), "--parts", "dev"]) == 2
    assert "libriheavy_cuts_dev.jsonl.gz: no such Libriheavy manifest" in capsys.readouterr().err


def test_download_resumes_and_shows_only_whole_files(tmp_path, monkeypatch):
    """Stage 0 with the network replaced: a transfer cut short leaves no file that looks whole,
    the next run resumes it; LibriLight's tar is unpacked into {part}/ for the parts the
    manifests' audio lies in (the held-out parts say which)."""
    import io
    import tarfile

    import lhotse.utils

    from valle.data import libriheavy

    manifests, _, _ = make_libriheavy(tmp_path / "src")
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
        for name in ("small/100/book/a.flac", "small/100/book/a.json"):
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"fLaC"))
    calls = []

    def fake_download(url, filename, **_):
        name = url.rsplit("/", 1)[1]
        body = tar_bytes.getvalue() if name.endswith(".tar") else (manifests / name).read_bytes()
        done = Path(filename).stat().st_size if Path(filename).exists() else 0
        calls.append((name, done))
        if len(calls) == 1:  # the first transfer breaks half-way
            Path(filename).write_bytes(body[: len(body) // 2])
            raise ConnectionError("reset by peer")
        with open(filename, "ab") as f:
            f.write(body[done:])

    monkeypatch.setattr(lhotse.utils, "resumable_download", fake_download)
    out, audio = tmp_path / "manifests", tmp_path / "librilight"
    with pytest.raises(ConnectionError):
        libriheavy.download(out, ["small", "dev"], audio)
    assert not (out / "libriheavy_cuts_small.jsonl.gz").exists()  # only the .part
    libriheavy.download(out, ["small", "dev"], audio)
    assert calls[1][1] > 0  # resumed, not restarted
    for part in ("small", "dev"):
        assert _read(out / f"libriheavy_cuts_{part}.jsonl.gz") == _read(manifests / f"libriheavy_cuts_{part}.jsonl.gz")
    # small's audio is in LibriLight's small, dev's in medium (make_libriheavy puts it there)
    assert (audio / "small" / "100" / "book" / "a.flac").read_bytes() == b"fLaC"
    assert (audio / "medium").is_dir() and sorted(p.name for p in audio.iterdir()) == ["medium", "small"]
    n = len(calls)
    libriheavy.download(out, ["small", "dev"], audio)  # everything there: nothing fetched
    assert len(calls) == n


def test_parts_without_extremes_records_still_give_train_its_record(libriheavy, tmp_path):
    import shutil

    from valle.data.extremes import Extremes

    data, _, _ = libriheavy
    copy = tmp_path / "data"
    shutil.copytree(data / "tokenized", copy / "tokenized")
    (copy / "tokenized" / "libriheavy_extremes_small.json").unlink()  # tokenized by an older version
    (copy / "tokenized" / "libriheavy_extremes_train.json").unlink()
    rc, out, err = run_recipe("egs/libriheavy/prepare.sh", "--data-dir", str(copy), "--dataset-parts", "small",
                              "--stage", "3", "--stop-stage", "3")
    assert rc == 0, out[-3000:] + err[-3000:]
    assert (Extremes.read(copy / "tokenized" / "libriheavy_extremes_train.json").to_json()
            == Extremes.read(data / "tokenized" / "libriheavy_extremes_train.json").to_json())


def test_malformed_cuts_are_listed_with_their_reason(tmp_path):
    from valle.data.libriheavy import main
    from valle.data.validation import ValidationReport

    manifests, librilight, made = make_libriheavy(tmp_path)
    good = made["small"][0]
    no_sup = dict(good, id="small/100/x/no_sup", supervisions=[])
    no_rec = {k: v for k, v in dict(good, id="small/100/x/no_rec").items() if k != "recording"}
    _write_jsonl_gz(manifests / "libriheavy_cuts_dev.jsonl.gz", [good, no_sup, no_rec])
    out = tmp_path / "manifests"
    assert main(["prepare", "--manifests-dir", str(manifests), "--librilight-dir", str(librilight),
                 "--output-dir", str(out), "--parts", "dev"]) == 0
    assert [s["id"] for s in _read(out / "libriheavy_supervisions_dev.jsonl.gz")] == [good["id"]]
    report = ValidationReport.read(out / "libriheavy_skipped_dev.tsv")
    assert [(e.cut_id, e.reason) for e in report.entries] == [
        ("small/100/x/no_sup", "no_supervision"), ("small/100/x/no_rec", "bad_manifest_item")]
    assert "KeyError" in report.entries[1].detail

"""The LibriTTS and LJSpeech recipes, stage by stage as a user runs them, on small corpora in
the real on-disk layouts (fake audio; the download stage skipped by pointing at the corpus)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from data_testlib import make_libritts, make_ljspeech, run_recipe

from valle.data.validation import ValidationReport

PARTS = {"dev-clean": ["84"], "test-clean": ["121"], "train-clean-100": ["19", "26"], "train-clean-360": ["14"]}
TOKENIZER_FLAGS = "--allow-random-encodec --download-encodec false --chunk-size 3 --batch-duration 3"


def _read(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _write(path: Path, items: list[dict]) -> None:
    with gzip.open(path, "wt") as f:
        for d in items:
            f.write(json.dumps(d) + "\n")


def _inject_manifest_problems(man: Path) -> dict:
    """What real manifests contain: a recording with several supervisions, a supervision
    whose recording is missing, repeated ids, a recording nobody transcribed, and a cut id
    that appears in two parts."""
    recs_path, sups_path = man / "libritts_recordings_train-clean-100.jsonl.gz", man / "libritts_supervisions_train-clean-100.jsonl.gz"
    recs, sups = _read(recs_path), _read(sups_path)
    first = sups[0]
    half = round(first["duration"] / 2, 3)
    multi = [dict(first, id=first["id"] + "_a", duration=half, text="The cat.", custom=None),
             dict(first, id=first["id"] + "_b", start=half, duration=round(first["duration"] - half, 3),
                  text="Sat down.", custom=None)]
    ghost = dict(sups[1], id="ghost_utt", recording_id="ghost_rec")
    lonely = dict(recs[1], id="lonely_rec")
    _write(recs_path, recs + [recs[2], lonely])
    _write(sups_path, multi + sups[1:] + [sups[2], ghost])
    # the same utterance id in another train part: combine must drop the second copy
    recs360, sups360 = man / "libritts_recordings_train-clean-360.jsonl.gz", man / "libritts_supervisions_train-clean-360.jsonl.gz"
    _write(recs360, _read(recs360) + [recs[3]])
    _write(sups360, _read(sups360) + [sups[3]])
    return {"multi": [m["id"] for m in multi], "dup_rec": recs[2]["id"], "dup_sup": sups[2]["id"],
            "cross_part": sups[3]["id"]}


@pytest.fixture(scope="module")
def libritts(tmp_path_factory):
    root = tmp_path_factory.mktemp("libritts")
    corpus = make_libritts(root, PARTS)
    data = root / "data"
    common = ["--data-dir", str(data), "--corpus-dir", str(corpus), "--dataset-parts", " ".join(PARTS),
              "--num-jobs", "1", "--extra-tokenizer-flags", TOKENIZER_FLAGS]
    first = run_recipe("egs/libritts/prepare.sh", *common, "--stage", "0", "--stop-stage", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "no download" in first.stdout
    injected = _inject_manifest_problems(data / "manifests")
    rest = run_recipe("egs/libritts/prepare.sh", *common, "--stage", "2", "--stop-stage", "5")
    assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:]
    return data, rest.stdout + rest.stderr, injected


def test_libritts_recipe_runs_every_stage(libritts):
    from lhotse import CutSet
    from lhotse.qa import validate

    data, log, injected = libritts
    tok = data / "tokenized"
    train = CutSet.from_file(tok / "libritts_cuts_train.jsonl.gz")
    ids = [c.id for c in train]
    # train-clean-100: 4 utterances, one recording split in two -> 5; train-clean-360: 2 + 1 repeated
    assert len(ids) == len(set(ids)) == 7
    assert set(injected["multi"]) <= set(ids)
    assert f"combine: dropped {injected['cross_part']}: duplicate_id" in log  # the cross-part copy
    validate(train, read_data=True)
    for name in ("dev", "test"):
        assert len(CutSet.from_file(tok / f"libritts_cuts_{name}.jsonl.gz")) == 2
    assert "libritts_cuts_train.jsonl.gz: 7 cuts" in log  # stage 4
    assert sorted(p.name for p in (data / "shar" / "train").iterdir()) == ["cuts.000000.jsonl.gz", "features.000000.tar"]
    # codes go to one HDF5 file per chunk, not one file per cut
    assert sorted(p.name for p in (tok / "libritts_encodec_train-clean-100").iterdir()) == ["chunk-000000.h5", "chunk-000001.h5"]


def test_libritts_manifest_problems_each_get_a_line(libritts):
    data, log, injected = libritts
    report = ValidationReport.read(data / "tokenized" / "libritts_bad_cuts_train-clean-100.tsv")
    got = sorted((e.cut_id, e.reason) for e in report.entries)
    assert got == sorted([(injected["dup_rec"], "duplicate_id"), (injected["dup_sup"], "duplicate_id"),
                          ("ghost_utt", "no_recording"), ("lonely_rec", "no_supervision")])
    assert "Traceback" not in log


def test_text_stats_are_stored_next_to_the_manifests(libritts):
    data, log, _ = libritts
    stats = json.loads((data / "tokenized" / "libritts_text_stats.json").read_text())
    assert set(stats["parts"]) == set(PARTS)
    total = stats["total"]
    assert total["cuts"] == 2 + 2 + 5 + 3
    assert 5 < total["phones_per_second"] < 20
    assert total["text_tokens_per_second"] > total["phones_per_second"]
    assert total["text_tokens_per_second_p99"] >= total["text_tokens_per_second"]
    assert "en-us" in total["languages"] and "per language (espeak voice)" in log


@pytest.fixture(scope="module")
def ljspeech(tmp_path_factory):
    root = tmp_path_factory.mktemp("ljspeech")
    rows = [("Printing, in 1839, was new.", "Printing, in eighteen thirty-nine, was new."),
            ("He left.", "He left."), ("It was Mr. Lee.", "It was Mister Lee."),
            ("The end came.", "The end came."), ("Then rain.", "Then rain.")]
    corpus = make_ljspeech(root, rows)
    data = root / "data"
    proc = run_recipe("egs/ljspeech/prepare.sh", "--data-dir", str(data), "--corpus-dir", str(corpus),
                      "--num-jobs", "0", "--num-dev", "1", "--num-test", "1",
                      "--extra-tokenizer-flags", TOKENIZER_FLAGS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return data, rows, proc.stdout + proc.stderr


def test_ljspeech_recipe_resamples_cuts_and_reads_normalized_text(ljspeech):
    from lhotse import CutSet
    from lhotse.qa import validate

    from valle.data.text import TextTokenizer

    data, rows, log = ljspeech
    tok = data / "tokenized"
    parts = {p: CutSet.from_file(tok / f"ljspeech_cuts_{p}.jsonl.gz") for p in ("train", "dev", "test")}
    assert {p: len(c) for p, c in parts.items()} == {"train": 3, "dev": 1, "test": 1}
    cut = parts["dev"][0]
    # 22.05 kHz recordings: the cut is at the codec's rate, so lhotse's checks and loads agree
    assert cut.sampling_rate == 24000 and cut.features.sampling_rate == 24000
    validate(parts["train"] + parts["dev"], read_data=True)
    assert cut.load_audio().shape[-1] == cut.num_samples
    # "1839" is spoken "eighteen thirty-nine": the normalized text is phonemized
    tokenizer = TextTokenizer()
    assert cut.supervisions[0].custom["tokens"]["text"] == tokenizer.phonemize_one(rows[0][1]).symbols
    assert cut.supervisions[0].custom["tokens"]["text"] != tokenizer.phonemize_one(rows[0][0]).symbols
    assert "ljspeech_cuts_train.jsonl.gz: 3 cuts" in log

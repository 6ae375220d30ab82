"""The Emilia recipe (egs/emilia), every stage as a user runs it, on a small corpus in the layout
lhotse's emilia recipe reads (raw/{EN,ZH,DE,FR,JA,KO}/*.jsonl rows, mp3 files under per-speaker
folders, written here with soundfile's MP3 support); each language phonemized in its own voice,
Mandarin through pypinyin, DNSMOS filtering by flag; then a 2-step VALL-E X training run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import soundfile as sf
from data_testlib import run_recipe, run_sh_launches, tone, train_two_steps

pytestmark = pytest.mark.timeout(600)

TOKENIZER_FLAGS = "--allow-random-encodec --download-encodec false --chunk-size 4 --batch-duration 4"
SR = 24000
TEXTS = {
    "en": ["The cat sat down.", "Rain fell today.", "Where is it?"],
    "zh": ["我们回家。", "天气很好。", "请开门！"],
    "de": ["Guten Tag.", "Das Haus ist alt.", "Wir gehen heim."],
    "fr": ["Bonjour à tous.", "Il pleut encore.", "Ouvre la porte."],
    "ja": ["きょうはいいてんきです。", "おはようございます。", "ありがとう。"],
    "ko": ["안녕하세요.", "비가 와요.", "문을 열어요."],
}
VOICES = {"en": "en-us", "zh": "cmn", "de": "de", "fr": "fr-fr", "ja": "ja", "ko": "ko"}
# Japanese as Emilia mostly writes it, with kanji: read as kana (pykakasi), then espeak's ja.
KANJI_TEXT, KANJI_READING = "東京に行きました。", "とうきょうにいきました。"


def _row(lang: str, n: int, text: str, dnsmos: float = 3.4) -> dict:
    up = lang.upper()
    spk = f"{up}_B00000_S{n // 2:05d}"
    utt = f"{spk}_W{n:06d}"
    return {"id": utt, "wav": f"{up}_B00000/{spk}/mp3/{utt}.mp3", "text": f" {text}", "duration": 1.2,
            "speaker": spk, "language": lang, "dnsmos": dnsmos}


def make_emilia(root: Path) -> tuple[Path, dict]:
    """{root}/Emilia/raw/{LANG}/{LANG}_B00000.jsonl and the rows' mp3s. English also has a row
    below DNSMOS 3.0, a row whose mp3 is missing and a repeated id; Japanese a row with kanji."""
    corpus = root / "Emilia"
    extra = {"low": _row("en", 3, "Too noisy here.", dnsmos=2.7), "missing": _row("en", 4, "Nobody recorded it."),
             "kanji": _row("ja", 3, KANJI_TEXT)}
    k = 0
    for lang, texts in TEXTS.items():
        lang_dir = corpus / "raw" / lang.upper()
        rows = [_row(lang, n, text) for n, text in enumerate(texts)]
        rows += [r for r in extra.values() if r["language"] == lang]
        if lang == "en":
            rows.append(dict(rows[0], text=" A second row with the same id."))
        for row in rows:
            if row is extra["missing"] or (lang == "en" and row is rows[-1]):
                continue
            mp3 = lang_dir / row["wav"]
            mp3.parent.mkdir(parents=True, exist_ok=True)
            sf.write(mp3, tone(1.2, SR, k), SR, format="MP3")
            k += 1
        lang_dir.mkdir(parents=True, exist_ok=True)
        (lang_dir / f"{lang.upper()}_B00000.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return corpus, {name: r["id"] for name, r in extra.items()} | {"repeated": _row("en", 0, "")["id"]}


def _cuts(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def emilia(tmp_path_factory):
    root = tmp_path_factory.mktemp("emilia")
    corpus, extra = make_emilia(root)
    data = root / "data"
    rc, out, err = run_recipe("egs/emilia/prepare.sh", "--data-dir", str(data), "--corpus-dir", str(corpus),
                              "--min-dnsmos", "3.0", "--num-dev", "1", "--num-test", "1", "--num-jobs", "0",
                              "--stop-stage", "5", "--shar-shard-size", "4",
                              "--extra-tokenizer-flags", TOKENIZER_FLAGS, timeout=500)
    assert rc == 0, out[-3000:] + err[-3000:]
    return data, extra, out + err


def test_every_stage_runs(emilia):
    data, _, log = emilia
    assert "Traceback" not in log
    assert "corpus found at" in log
    tok = data / "tokenized"
    parts = {p: _cuts(tok / f"emilia_cuts_{p}.jsonl.gz") for p in ("train", "dev", "test")}
    # per language: 3 usable rows -> 1 dev, 1 test, 1 train; Japanese's 4th (kanji) -> train
    assert {p: len(c) for p, c in parts.items()} == {"train": 7, "dev": 6, "test": 6}
    for p, cuts in parts.items():
        expected = sorted([*VOICES.values(), *(["ja"] if p == "train" else [])])
        assert sorted(c["supervisions"][0]["custom"]["espeak_voice"] for c in cuts) == expected, p
    assert (data / "shar" / "train").is_dir()  # stage 5
    from lhotse import CutSet

    from valle.data.extremes import Extremes

    for p in ("train", "dev", "test"):  # the trainer's start-up reads these, not the manifests
        record = Extremes.read(tok / f"emilia_extremes_{p}.json")
        assert record.to_json() == Extremes.of(CutSet.from_file(tok / f"emilia_cuts_{p}.jsonl.gz")).to_json()
    assert "cuts per language: cmn 1, de 1, en-us 1, fr-fr 1, ja 1, ko 1" in log  # stage 4


def test_each_language_is_phonemized_in_its_own_voice_and_mandarin_by_pypinyin(emilia):
    from valle.data.text import TextTokenizer, pinyin_symbols

    data, _, _ = emilia
    tokenizer = TextTokenizer()
    for part in ("train", "dev", "test"):
        for cut in _cuts(data / "tokenized" / f"emilia_cuts_{part}.jsonl.gz"):
            sup = cut["supervisions"][0]
            voice = sup["custom"]["espeak_voice"]
            assert voice == VOICES[sup["language"]]
            assert sup["text"] == sup["text"].strip() and sup["text"] in [*TEXTS[sup["language"]], KANJI_TEXT]
            said = KANJI_READING if sup["text"] == KANJI_TEXT else sup["text"]
            expected = (pinyin_symbols(said) if voice == "cmn" else tokenizer.phonemize_one(said, voice)).symbols
            assert sup["custom"]["tokens"]["text"] == expected
            assert sup["custom"]["dnsmos"] >= 3.0


def test_every_row_left_out_is_listed_with_its_reason(emilia):
    from valle.data.validation import ValidationReport

    data, extra, log = emilia
    skipped = ValidationReport.read(data / "manifests" / "emilia_skipped_en.tsv")
    assert sorted((e.cut_id, e.reason) for e in skipped.entries) == sorted([
        (extra["low"], "low_dnsmos"), (extra["missing"], "missing_audio"), (extra["repeated"], "duplicate_id")])
    assert "DNSMOS 2.700 < --min-dnsmos 3" in log or "low_dnsmos 1" in log
    # the kanji row was read as kana: nothing Japanese is reported
    assert not ValidationReport.read(data / "tokenized" / "emilia_bad_cuts_ja.tsv").entries
    for lang in ("zh", "de", "fr", "ko"):
        assert not ValidationReport.read(data / "manifests" / f"emilia_skipped_{lang}.tsv").entries


def test_run_sh_trains_two_steps_with_six_languages(emilia, tmp_path):
    data, _, _ = emilia
    launches = run_sh_launches("egs/emilia/run.sh", tmp_path)
    assert len(launches) == 2  # AR, then NAR
    assert all("--dataset emilia" in x and "--languages en-us,cmn,de,fr-fr,ja,ko" in x for x in launches)
    log = train_two_steps(data / "tokenized", "emilia", tmp_path / "exp", "--num-languages", "6",
                          "--languages", "en-us,cmn,de,fr-fr,ja,ko")
    assert "languages (id order): en-us, cmn, de, fr-fr, ja, ko" in log


def test_malformed_and_unreadable_rows_are_listed_and_the_rest_kept(tmp_path):
    from valle.data.emilia import main
    from valle.data.validation import ValidationReport

    lang_dir = tmp_path / "Emilia" / "raw" / "DE"
    good, broken = _row("de", 0, "Guten Tag."), _row("de", 1, "Das Haus.")
    sf.write(_mkdirs(lang_dir / good["wav"]), tone(1.0, SR, 0), SR, format="MP3")
    _mkdirs(lang_dir / broken["wav"]).write_bytes(b"not an mp3 at all" * 20)
    no_text = {k: v for k, v in _row("de", 2, "x").items() if k != "text"}
    odd_score = dict(_row("de", 3, "Hallo."), dnsmos="n/a")
    (lang_dir / "DE_B00000.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in (good, broken, no_text, odd_score)), encoding="utf-8")
    out = tmp_path / "manifests"
    assert main(["prepare", "--corpus-dir", str(tmp_path / "Emilia"), "--output-dir", str(out),
                 "--languages", "de", "--num-jobs", "2"]) == 0
    assert [s["id"] for s in _cuts(out / "emilia_supervisions_de.jsonl.gz")] == [good["id"]]
    report = ValidationReport.read(out / "emilia_skipped_de.tsv")
    assert [(e.cut_id, e.reason) for e in report.entries] == [
        (no_text["id"], "bad_manifest_item"), (odd_score["id"], "bad_manifest_item"),
        (broken["id"], "unreadable_audio")]
    assert "no text" in report.entries[0].detail and "DE_B00000.jsonl:3" in report.entries[0].detail


def test_a_wrong_corpus_dir_or_language_is_one_error_line(tmp_path, capsys):
    from valle.data.emilia import main

    assert main(["prepare", "--corpus-dir", str(tmp_path), "--output-dir", str(tmp_path / "o"),
                 "--languages", "en"]) == 2
    assert f"{tmp_path}/raw/EN: no such directory" in capsys.readouterr().err
    assert main(["prepare", "--corpus-dir", str(tmp_path), "--output-dir", str(tmp_path / "o"),
                 "--languages", "es"]) == 2
    assert "unknown Emilia language(s) ['es']" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def _mkdirs(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_interleave_spreads_each_language_evenly_over_train(tmp_path):
    from valle.data.emilia import main

    sizes = {"en": 60, "zh": 30, "ja": 10}
    inputs = []
    for lang, n in sizes.items():
        path = tmp_path / f"emilia_{lang}_cuts_train.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": f"{lang}-{k:03d}"}) + "\n" for k in range(n))
        inputs.append(str(path))
    out = tmp_path / "train.jsonl.gz"
    assert main(["interleave", str(out), *inputs]) == 0
    ids = [c["id"] for c in _cuts(out)]
    # each input's cuts, in their own order, and nothing else
    assert sorted(ids) == sorted(f"{lang}-{k:03d}" for lang, n in sizes.items() for k in range(n))
    for lang in sizes:
        mine = [i for i in ids if i.startswith(lang)]
        assert mine == sorted(mine)
    # every prefix holds each language in proportion, within one cut
    total = sum(sizes.values())
    for length in range(1, total + 1):
        for lang, n in sizes.items():
            have = sum(1 for i in ids[:length] if i.startswith(lang))
            assert abs(have - length * n / total) <= 1, (length, lang)
    assert main(["interleave", str(out), *inputs]) == 0 and [c["id"] for c in _cuts(out)] == ids  # deterministic


def test_japanese_without_the_kanji_reader_stops_before_tokenizing(tmp_path):
    # most of Emilia's JA holds kanji: without pykakasi they would all be reported and left out
    shim = tmp_path / "python"  # a python without pykakasi; anything else it would run fails too
    shim.write_text('#!/usr/bin/env bash\nif [ "$1" = -c ] && [ "$2" = "import pykakasi" ]; then exit 1; fi\n'
                    'echo "RAN $*"; exit 3\n')
    shim.chmod(0o755)
    rc, out, err = run_recipe("egs/emilia/prepare.sh", "--python", str(shim), "--data-dir", str(tmp_path / "data"),
                              "--stage", "2", "--stop-stage", "2", "--languages", "en ja", timeout=60)
    assert rc == 1 and "ja needs pykakasi to read kanji as kana: pip install -e '.[ja]'" in err
    assert "RAN" not in out  # bin/tokenizer.py never started

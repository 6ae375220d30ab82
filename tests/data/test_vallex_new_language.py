"""A language VALL-E X does not read, for a checkpoint that gains it (bin/trainer.py
--add-language): espeak's IPA written in bpe_69.json's characters, characters the table lacks
left out, counted and named; bin/tokenizer.py --text-extractor vallex-bpe --language de makes
a corpus of the table's ids and reports them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("phonemizer")
pytest.importorskip("espeakng_loader")

from valle.data.vallex_text import (  # noqa: E402
    TABLE_CHARACTERS,
    describe_lacking,
    symbols_and_lacking,
    to_table,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vallex"
# espeak's German for "Schöne Grüße": ʃˈøːnə ɡɾˈyːsə (ø: none of the table's; ː: not written)
GERMAN = ("Schöne Grüße", list("ʃˈnə_gɾˈysə."), {"ø": 1})


def test_the_table_characters_are_bpe_69s():
    vocab = json.loads((FIXTURE / "bpe_69.json").read_text(encoding="utf-8"))["model"]["vocab"]
    assert TABLE_CHARACTERS == {s for s in vocab if len(s) == 1 and not s.isspace()}


def test_espeak_ipa_is_written_in_the_table_characters():
    said, lacking = to_table("ɡˈuːtən ʁˈɑt, ʧˈaʊ; ɲˈø¿")
    # ɡ -> g, no length marks, ʁ -> ɹ, ʧ -> tʃ, ; -> , ɲ -> n^, ¿ not said; ø lacks
    assert said == "gˈutən ɹˈɑt, tʃˈaʊ, n^ˈ"
    assert lacking == Counter({"ø": 1})
    assert set(said) - {" "} <= TABLE_CHARACTERS
    assert describe_lacking(Counter({"ø": 2, "œ": 1})) == (
        "'ø' (LATIN SMALL LETTER O WITH STROKE) x2, 'œ' (LATIN SMALL LIGATURE OE) x1")


@pytest.mark.parametrize("language", ["de", "german", "deu"])  # espeak's voice, its name, ISO 639-3
def test_a_new_language_is_read_by_espeak(language):
    text, symbols, lacking = GERMAN
    said, found = symbols_and_lacking(text, language)
    assert said == symbols and found == Counter(lacking)
    assert set(said) <= TABLE_CHARACTERS  # every symbol has an id in bpe_69.json


def test_its_own_languages_keep_their_frontends():
    # en/zh/ja (and their espeak spellings) are not espeak's: they need the vallex extra
    from valle.data.vallex_text import is_new_language

    assert not any(is_new_language(x) for x in ("en", "en-us", "zh", "cmn", "ja", "mix", "auto"))
    assert all(is_new_language(x) for x in ("de", "fr-fr", "ko"))


def test_the_tokenizer_encodes_a_new_language_and_names_what_it_left_out(caplog):
    pytest.importorskip("tokenizers", reason="the vallex extra: pip install -e '.[vallex]'")
    from valle.data.vallex_text import VallexTokenizer

    tokenizer = VallexTokenizer(FIXTURE / "bpe_69.json")
    text, symbols, lacking = GERMAN
    ids, languages = tokenizer.encode(text, "de")
    vocab = tokenizer.bpe.get_vocab()
    assert ids == [vocab[s] for s in symbols] and languages == ["de"] * len(ids)
    assert tokenizer.lacking == Counter(lacking)
    assert "left out 1 character(s) the table bpe_69.json lacks: 'ø' (LATIN SMALL LETTER O WITH STROKE) x1" in caplog.text


def _german_corpus(root: Path) -> Path:
    import soundfile as sf
    from data_testlib import tone
    from lhotse import Recording, RecordingSet, SupervisionSegment, SupervisionSet

    texts = ["Schöne Grüße aus München.", "Guten Tag, wie geht es dir?", "Der Hund schläft."]
    recs, sups = [], []
    (root / "wavs").mkdir(parents=True)
    for i, text in enumerate(texts):
        path = root / "wavs" / f"de{i}.wav"
        sf.write(path, tone(1.5, 24000, i), 24000, subtype="PCM_16")
        recs.append(Recording.from_file(path, recording_id=f"de{i}"))
        sups.append(SupervisionSegment(id=f"de{i}", recording_id=f"de{i}", start=0.0, duration=1.5,
                                       channel=0, text=text, speaker="s1", language="de"))  # fmt: skip
    man = root / "manifests"
    man.mkdir()
    RecordingSet.from_recordings(recs).to_file(man / "de_recordings_train.jsonl.gz")
    SupervisionSet.from_segments(sups).to_file(man / "de_supervisions_train.jsonl.gz")
    return man


@pytest.mark.timeout(300)
def test_a_corpus_in_the_new_language_is_tokenized_into_the_table(tmp_path, tokenizer_cli, capsys):
    from lhotse import CutSet

    from valle.data.symbols import SymbolTable
    from valle.data.vallex_text import main

    table = tmp_path / "vallex.k2symbols"
    assert main(["symbols", "--bpe-vocab", str(FIXTURE / "bpe_69.json"), "--output", str(table)]) == 0
    man, out = _german_corpus(tmp_path), tmp_path / "tokenized"
    assert tokenizer_cli.main([
        "--src-dir", str(man), "--output-dir", str(out), "--prefix", "de", "--dataset-parts", "train",
        "--text-extractor", "vallex-bpe", "--text-tokens", str(table), "--language", "de",
        "--allow-random-encodec"]) == 0  # fmt: skip
    log = capsys.readouterr().out
    cuts = CutSet.from_file(out / "de_cuts_train.jsonl.gz")
    assert len(cuts) == 3  # none refused: the characters the table lacks are left out
    symbols = SymbolTable.from_file(table)
    for cut in cuts:
        sup = cut.supervisions[0]
        assert sup.custom["espeak_voice"] == "de"
        assert all(s in symbols for s in sup.custom["tokens"]["text"])
    # Schöne, München: counted in the part's stats, and in the corpus's total
    assert json.loads((out / "de_stats_train.json").read_text())["lacking"] == {"ø": 1, "ʏ": 1}
    assert json.loads((out / "de_text_stats.json").read_text())["total"]["lacking"] == {"ø": 1, "ʏ": 1}
    assert "left out, not in the vallex-bpe table" in log and "'ø' (LATIN SMALL LETTER O WITH STROKE) x1" in log

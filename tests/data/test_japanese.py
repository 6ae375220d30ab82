"""Japanese with kanji: pykakasi reads the kanji as hiragana, espeak's ja voice phonemizes the
kana; without pykakasi such text is reported (training) or refused (synthesis), with the fix."""

from __future__ import annotations

import pytest

from valle.data import scripts

pytest.importorskip("pykakasi")


@pytest.fixture
def no_kanji_reader(monkeypatch):
    """As on a machine without the `ja` extra."""
    monkeypatch.setattr(scripts, "KANJI_READER", "valle_test_no_such_kanji_reader")
    scripts.kanji_reader_available.cache_clear()
    yield
    scripts.kanji_reader_available.cache_clear()


@pytest.mark.parametrize(
    "text, kana",
    [
        ("東京に行きました。", "とうきょうにいきました。"),
        ("日本語のテキスト", "にほんごのテキスト"),  # katakana stays as written
        ("私の名前はJohnです、123円", "わたしのなまえはJohnです、123えん"),  # Latin, digits kept
        ("雨 が 降る", "あめ が ふる"),  # spaces kept
        ("ありがとう。", "ありがとう。"),
    ],
)
def test_kanji_words_become_their_hiragana_reading(text, kana):
    from valle.data.japanese import kanji_to_kana

    assert kanji_to_kana(text) == kana


def test_ja_text_with_kanji_is_phonemized_as_its_kana_reading():
    from valle.data.text import TextTokenizer
    from valle.data.validation import check_text_symbols

    tokenizer = TextTokenizer("ja")
    kanji = tokenizer.phonemize_one("東京に行きました。", "ja")
    assert kanji.language_switches == []
    assert kanji.symbols == tokenizer.phonemize_one("とうきょうにいきました。", "ja").symbols
    assert kanji.symbols[:6] == ["t", "o̞", "ɯᵝ", "kʲ", "o̞", "ɯᵝ"]  # to-u-kyo-u
    assert check_text_symbols("東京に行きました。", "ja", kanji.symbols, kanji.language_switches, 2.0) is None
    # other voices never go through the reader: Mandarin Han stays Mandarin
    assert tokenizer.phonemize_one("你好", "cmn").symbols != tokenizer.phonemize_one("你好", "ja").symbols


def test_han_is_a_ja_script_only_with_the_kanji_reader(no_kanji_reader):
    from valle.infer_checks import script_problem

    assert "Han" not in scripts.language_scripts("ja")
    assert "ja" not in scripts.languages_for_script("Han")
    problem = script_problem("東京に行きました", "ja", "text")
    assert problem is not None and "Han letters ('東京行')" in problem.message
    assert "install pykakasi (pip install -e '.[ja]')" in problem.message
    assert script_problem("とうきょうにいきました", "ja", "text") is None  # kana needs no reader


def test_with_the_reader_ja_reads_han(monkeypatch):
    from valle.infer_checks import script_problem

    scripts.kanji_reader_available.cache_clear()
    assert "Han" in scripts.language_scripts("ja")
    assert scripts.languages_for_script("Han") == ["cmn", "yue", "hak", "ja", "ko"]
    assert script_problem("東京に行きました", "ja", "text") is None


def test_without_the_reader_a_kanji_cut_is_reported_with_the_fix(no_kanji_reader):
    from valle.data.text import TextTokenizer
    from valle.data.validation import LANGUAGE_SWITCH, check_text_symbols

    ph = TextTokenizer("ja").phonemize_one("東京に行きました。", "ja")
    assert ph.language_switches  # espeak says "chinese letter" in English
    reason, detail = check_text_symbols("東京に行きました。", "ja", ph.symbols, ph.language_switches, 2.0)
    assert reason == LANGUAGE_SWITCH and "install pykakasi" in detail

"""--text-extractor pypinyin: Mandarin characters -> pinyin initials/finals with tones."""

import pytest

pytest.importorskip("pypinyin")

from valle.data.text import TextTokenizationError, TextTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer("cmn", backend="pypinyin")


@pytest.mark.parametrize("text, symbols", [
    ("中国人，你好！", ["zh", "ong1", "g", "uo2", "r", "en2", ",", "n", "i3", "h", "ao3", "!"]),
    ("我爱北京天安门。", ["uo3", "ai4", "b", "ei3", "j", "ing1", "t", "ian1", "an1", "m", "en2", "."]),
    ("他们的朋友", ["t", "a1", "m", "en5", "d", "e5", "p", "eng2", "iou3"]),
])
def test_exact_symbols(tok, text, symbols):
    assert tok([text]) == [symbols]


def test_non_chinese_characters_are_an_error_not_dropped(tok):
    with pytest.raises(TextTokenizationError, match=r"'3aelp'"):
        tok.phonemize_one("我有3个apple")


def test_unknown_extractor_is_refused():
    with pytest.raises(ValueError, match="espeak, pypinyin"):
        TextTokenizer(backend="g2p")


def test_bad_item_names_the_cut_in_the_tokenizer_report(tok):
    from types import SimpleNamespace

    from lhotse import MonoCut, SupervisionSegment

    from valle.data import validation as V
    from valle.data.pipeline import Options, PartTokenizer, Stats

    sup = SupervisionSegment("utt-latin", "rec", 0.0, 2.0, text="我有3个apple", language="Chinese")
    cut = MonoCut("cut-latin", 0.0, 2.0, 0, supervisions=[sup])
    runner = SimpleNamespace(opts=Options("src", "out", "p"), text=tok, fixed_table=None)
    report = V.ValidationReport()
    assert PartTokenizer.tokenize_text(runner, cut, report, Stats(), set()) is None
    [entry] = report.entries
    assert entry.cut_id == "cut-latin" and "'3aelp'" in entry.detail

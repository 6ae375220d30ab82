"""The vallex-bpe text frontend gives the ids and languages of Plachtaa/VALL-E-X's own tokenizer.

tests/fixtures/vallex/text_frontend.json was written once by VALL-E X's ``PhonemeBpeTokenizer``
after its ``generate_audio``'s steps (see PROVENANCE.md there); ``bpe_69.json`` is VALL-E X's
vocabulary (MIT), copied with attribution.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

for _module in ("tokenizers", "inflect", "unidecode", "eng_to_ipa", "cn2an", "jieba", "pypinyin", "langid"):
    pytest.importorskip(_module, reason="the vallex extra: pip install -e '.[vallex]'")

from valle.data.vallex_text import (  # noqa: E402
    FrontendError,
    VallexTokenizer,
    detect_language,
    pyopenjtalk_module,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vallex"
CASES = json.loads((FIXTURE / "text_frontend.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def tokenizer():
    return VallexTokenizer(FIXTURE / "bpe_69.json")


def _japanese_here() -> bool:
    try:
        pyopenjtalk_module()
    except FrontendError:
        return False
    return True


@pytest.mark.parametrize("case", CASES, ids=[f"{c['language']}:{c['text'][:24]}" for c in CASES])
def test_equal_to_vallex_tokenizer(tokenizer, case):
    if "ja" in case["languages"] and not _japanese_here():
        pytest.skip("Japanese needs pyopenjtalk and its dictionary (OPEN_JTALK_DICT_DIR)")
    ids, languages = tokenizer.encode(case["text"], case["language"])
    assert ids == case["ids"]
    assert languages == case["languages"]


def test_fixture_covers_every_kind_of_text():
    kinds = {c["language"] for c in CASES}
    assert kinds == {"en", "zh", "ja", "mix", "auto"}
    assert {c["resolved"] for c in CASES if c["language"] == "auto"} == {"en", "zh", "ja"}
    mixed = [set(c["languages"]) for c in CASES if c["language"] == "mix"]
    assert {"en", "zh"} in mixed and {"ja", "en"} in mixed


def test_auto_detects_among_its_three_languages():
    assert detect_language("Guten Morgen, wie geht es dir?") in ("en", "zh", "ja")
    assert detect_language("我们明天去北京。") == "zh"


def test_bad_input_is_refused_by_name(tokenizer, tmp_path):
    # a language of none of its frontends is espeak's (a checkpoint that gained it with
    # --add-language): one espeak has no voice for is refused by name
    with pytest.raises(FrontendError, match="no espeak voice for language 'xx'"):
        tokenizer.encode("bonjour", "xx")
    with pytest.raises(FrontendError, match="gave no phonemes"):
        tokenizer.encode("hello", "mix")  # untagged mixed text: nothing to say
    with pytest.raises(FrontendError, match=r"missing\.json is not there.*--bpe-vocab"):
        VallexTokenizer(tmp_path / "missing.json")


def test_japanese_without_its_dictionary_is_refused_by_name(tokenizer, monkeypatch):
    if _japanese_here():  # as where it is absent: the dictionary folder points nowhere
        import pyopenjtalk

        monkeypatch.setattr(pyopenjtalk, "OPEN_JTALK_DICT_DIR", b"/nonexistent/open_jtalk_dic")
    with pytest.raises(FrontendError, match=r"Japanese \(ja\) needs pyopenjtalk"):
        tokenizer.encode("こんにちは", "ja")
    # English and Mandarin still work
    assert tokenizer.encode("Hello.", "en")[0] and tokenizer.encode("你好。", "zh")[0]


VOICE = {"en": "en-us", "zh": "cmn", "ja": "ja", "mix": "mix", "auto": "auto"}


def test_a_corpus_tokenized_with_it_trains_on_the_frontend_ids(tmp_path):
    """bin/tokenizer.py --text-extractor vallex-bpe stores per cut the symbols that the table
    of ``python -m valle.data.vallex_text symbols`` maps to the frontend's ids; the collater
    adds no BOS/EOS (VALL-E X's text has none)."""
    from valle.data.collation import get_text_token_collater
    from valle.data.text import TextTokenizer
    from valle.data.vallex_text import main

    table = tmp_path / "vallex.k2symbols"
    assert main(["symbols", "--bpe-vocab", str(FIXTURE / "bpe_69.json"), "--output", str(table)]) == 0
    collater = get_text_token_collater(table)
    text = TextTokenizer("en-us", backend="vallex-bpe")
    japanese = _japanese_here()
    for case in CASES:
        if "ja" in case["languages"] and not japanese:
            continue
        if 0 in case["ids"]:  # VALL-E X's [UNK]: bin/tokenizer.py reports the cut instead
            with pytest.raises(KeyError, match="unknown text symbol"):
                collater.encode(text.phonemize_one(case["text"], VOICE[case["language"]]).symbols)
            continue
        # the corpus's language as bin/tokenizer.py passes it: an espeak voice
        said = text.phonemize_one(case["text"], VOICE[case["language"]]).symbols
        assert collater.encode(said) == case["ids"], case["text"]
        padded, lens = collater([said])
        assert lens.tolist() == [len(case["ids"])]

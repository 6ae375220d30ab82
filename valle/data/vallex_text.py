"""The text frontend of Plachtaa/VALL-E-X checkpoints (``text_frontend: vallex-bpe``).

Text -> (token ids, the language of each token), equal to VALL-E X's ``PhonemeBpeTokenizer``
after its ``generate_audio`` (Plachtaa/VALL-E-X, MIT License, Copyright (c) 2023 Songting;
its rules are re-implemented here, tests/fixtures/vallex/PROVENANCE.md says how they are
proven equal):

* a text in one language is wrapped in its tag (``[EN]..[EN]``, ``[ZH]..[ZH]``,
  ``[JA]..[JA]``); ``mix``: the text carries its tags; ``auto``: langid picks en, zh or ja;
* each tagged span becomes an IPA string: English by inflect/unidecode expansion then
  eng_to_ipa, Mandarin by cn2an, jieba, pypinyin's bopomofo, Japanese by pyopenjtalk; a span
  ends with a space, and a text without end punctuation gets a full stop;
* spaces become ``_`` and the byte-pair table ``bpe_69.json`` (Hugging Face ``tokenizers``)
  maps each character to one id: a token's language is its span's.

A language VALL-E X does not read (one a checkpoint gained with ``bin/trainer.py
--add-language NAME``) is read by espeak (NAME, or the espeak voice it names) and its IPA
written with the table's characters (``ESPEAK_TO_TABLE``, its author's recipe for a new
language); characters the table lacks are left out, counted and reported by name.

The model's language ids are a checkpoint's ``languages`` (en 0, zh 1, ja 2); prompt files
(``.npz``) number languages otherwise (``PROMPT_FILE_LANGUAGES``). Needs the ``vallex``
extra (``pip install -e '.[vallex]'``); Japanese also needs pyopenjtalk and its dictionary.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import unicodedata
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

FRONTEND = "vallex-bpe"
BPE_VOCAB = "bpe_69.json"
LANGUAGES = ("en", "zh", "ja")
TAGS = {"en": "[EN]", "zh": "[ZH]", "ja": "[JA]"}
MIX, AUTO = "mix", "auto"
# Plachtaa's macros.lang2code: how a prompt .npz file's lang_code names its language.
PROMPT_FILE_LANGUAGES = {0: "zh", 1: "ja", 2: "en"}
# The espeak voices bin/tokenizer.py records for a corpus in these languages, and the other
# spellings users of this project type for them.
VOICES = {"en": "en-us", "zh": "cmn", "ja": "ja"}
ALIASES = {"en-us": "en", "en-gb": "en", "english": "en", "cmn": "zh", "zh-cn": "zh",
           "mandarin": "zh", "chinese": "zh", "jpn": "ja", "japanese": "ja"}  # fmt: skip
_SPAN = re.compile(r"\[(EN|ZH|JA)\](.*?)\[\1\]")
_END_MARKS = ".,!?-…~"


class FrontendError(ValueError):
    """A text this frontend cannot read (missing dependency, unknown language, empty)."""


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise FrontendError(
            f"the vallex-bpe text frontend needs {module.split('.')[0]}: pip install -e '.[vallex]'"
        ) from e


# ------------------------------------------------------------------- English
_ABBREVIATIONS = (
    ("mrs", "misess"), ("mr", "mister"), ("dr", "doctor"), ("st", "saint"), ("co", "company"),
    ("jr", "junior"), ("maj", "major"), ("gen", "general"), ("drs", "doctors"),
    ("rev", "reverend"), ("lt", "lieutenant"), ("hon", "honorable"), ("sgt", "sergeant"),
    ("capt", "captain"), ("esq", "esquire"), ("ltd", "limited"), ("col", "colonel"),
    ("ft", "fort"),
)  # fmt: skip
_ABBREVIATION_RES = [(re.compile(rf"\b{short}\.", re.IGNORECASE), long) for short, long in _ABBREVIATIONS]


@functools.cache
def _inflect():
    return _need("inflect").engine()


def _unit(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _dollars(m: re.Match) -> str:
    amount = m.group(1)
    parts = amount.split(".")
    if len(parts) > 2:
        return f"{amount} dollars"
    dollars = int(parts[0] or 0)
    cents = int(parts[1]) if len(parts) > 1 and parts[1] else 0
    said = [_unit(dollars, "dollar", "dollars")] if dollars else []
    said += [_unit(cents, "cent", "cents")] if cents else []
    return ", ".join(said) or "zero dollars"


def _cardinal(m: re.Match) -> str:
    n, words = int(m.group(0)), _inflect().number_to_words
    if not 1000 < n < 3000:
        return words(n, andword="")
    # years: 2000, 2001-2009 "two thousand X", 1900 "nineteen hundred", else in pairs
    if n == 2000:
        return "two thousand"
    if 2000 < n < 2010:
        return "two thousand " + words(n % 100)
    if n % 100 == 0:
        return words(n // 100) + " hundred"
    return words(n, andword="", zero="oh", group=2).replace(", ", " ")


def _spell_numbers(text: str) -> str:
    text = re.sub(r"([0-9][0-9,]+[0-9])", lambda m: m.group(1).replace(",", ""), text)
    text = re.sub(r"£([0-9,]*[0-9]+)", r"\1 pounds", text)
    text = re.sub(r"\$([0-9.,]*[0-9]+)", _dollars, text)
    text = re.sub(r"([0-9]+\.[0-9]+)", lambda m: m.group(1).replace(".", " point "), text)
    text = re.sub(r"[0-9]+(st|nd|rd|th)", lambda m: _inflect().number_to_words(m.group(0)), text)
    return re.sub(r"[0-9]+", _cardinal, text)


def english_ipa(text: str) -> str:
    """English -> IPA as VALL-E X writes it (dark l as ɫ, r as ɹ, affricates spelt out)."""
    unidecode = _need("unidecode").unidecode
    eng_to_ipa = _need("eng_to_ipa")
    text = unidecode(text).lower()
    for pattern, long in _ABBREVIATION_RES:
        text = pattern.sub(long, text)
    ipa = re.sub(r"\s+", " ", eng_to_ipa.convert(_spell_numbers(text)))
    ipa = re.sub(r"l([^aeiouæɑɔəɛɪʊ ]*(?: |$))", r"ɫ\1", ipa)
    ipa = ipa.replace("r", "ɹ").replace("ʤ", "dʒ").replace("ʧ", "tʃ")
    return ipa.replace("...", "…")


# ------------------------------------------------------------------ Mandarin
# Latin letters inside Mandarin text, read as a Mandarin speaker names them (in bopomofo).
_LETTERS = dict(
    a="ㄟˉ", b="ㄅㄧˋ", c="ㄙㄧˉ", d="ㄉㄧˋ", e="ㄧˋ", f="ㄝˊㄈㄨˋ", g="ㄐㄧˋ", h="ㄝˇㄑㄩˋ",
    i="ㄞˋ", j="ㄐㄟˋ", k="ㄎㄟˋ", l="ㄝˊㄛˋ", m="ㄝˊㄇㄨˋ", n="ㄣˉ", o="ㄡˉ", p="ㄆㄧˉ",
    q="ㄎㄧㄡˉ", r="ㄚˋ", s="ㄝˊㄙˋ", t="ㄊㄧˋ", u="ㄧㄡˉ", v="ㄨㄧˉ", w="ㄉㄚˋㄅㄨˋㄌㄧㄡˋ",
    x="ㄝˉㄎㄨˋㄙˋ", y="ㄨㄞˋ", z="ㄗㄟˋ",
)  # fmt: skip
# Bopomofo (and full-width punctuation) -> IPA; several-letter keys are read first.
_BOPOMOFO_IPA = {
    "ㄅㄛ": "p⁼wo", "ㄆㄛ": "pʰwo", "ㄇㄛ": "mwo", "ㄈㄛ": "fwo",
    "ㄧㄢ": "jɛn", "ㄩㄢ": "ɥæn", "ㄧㄣ": "in", "ㄩㄣ": "ɥn", "ㄧㄥ": "iŋ", "ㄨㄥ": "ʊŋ",
    "ㄩㄥ": "jʊŋ",
    "ㄅ": "p⁼", "ㄆ": "pʰ", "ㄇ": "m", "ㄈ": "f", "ㄉ": "t⁼", "ㄊ": "tʰ", "ㄋ": "n", "ㄌ": "l",
    "ㄍ": "k⁼", "ㄎ": "kʰ", "ㄏ": "x", "ㄐ": "tʃ⁼", "ㄑ": "tʃʰ", "ㄒ": "ʃ", "ㄓ": "ts`⁼",
    "ㄔ": "ts`ʰ", "ㄕ": "s`", "ㄖ": "ɹ`", "ㄗ": "ts⁼", "ㄘ": "tsʰ", "ㄙ": "s", "ㄚ": "a",
    "ㄛ": "o", "ㄜ": "ə", "ㄝ": "ɛ", "ㄞ": "aɪ", "ㄟ": "eɪ", "ㄠ": "ɑʊ", "ㄡ": "oʊ", "ㄢ": "an",
    "ㄣ": "ən", "ㄤ": "ɑŋ", "ㄥ": "əŋ", "ㄦ": "əɻ", "ㄧ": "i", "ㄨ": "u", "ㄩ": "ɥ",
    # tones: 1 level, 2 rising, 3 dipping, 4 falling, neutral unmarked
    "ˉ": "→", "ˊ": "↑", "ˇ": "↓↑", "ˋ": "↓", "˙": "",
    "，": ",", "。": ".", "！": "!", "？": "?", "—": "-",
}  # fmt: skip
_BOPOMOFO_RE = re.compile("|".join(sorted(_BOPOMOFO_IPA, key=len, reverse=True)))
_HAN = re.compile("[\u4e00-\u9fff]")


def _chinese_numerals(text: str) -> str:
    cn2an = _need("cn2an")
    # each number found, in order, replaces its first occurrence in the text as it is then
    for number in re.findall(r"\d+(?:\.?\d+)?", text):
        text = text.replace(number, cn2an.an2cn(number), 1)
    return text


def _bopomofo(text: str) -> str:
    """Mandarin words in bopomofo (level tone marked), separated by spaces; other runs kept."""
    jieba = _need("jieba")
    pypinyin = _need("pypinyin")
    for mark in "、；：":
        text = text.replace(mark, "，")
    out = ""
    for word in jieba.lcut(text, cut_all=False):
        if not _HAN.search(word):
            out += word
            continue
        syllables = pypinyin.lazy_pinyin(word, pypinyin.BOPOMOFO)
        # pypinyin leaves the level tone unmarked: a syllable ending in a letter gets ˉ
        syllables = [s + "ˉ" if s and "\u3105" <= s[-1] <= "\u3129" else s for s in syllables]
        out += (" " if out else "") + "".join(syllables)
    return out


def mandarin_ipa(text: str) -> str:
    """Mandarin (digits and Latin letters included) -> IPA as VALL-E X writes it."""
    text = _bopomofo(_chinese_numerals(text))
    text = re.sub("[A-Za-z]", lambda m: _LETTERS[m.group(0).lower()], text)
    text = _BOPOMOFO_RE.sub(lambda m: _BOPOMOFO_IPA[m.group(0)], text)
    text = re.sub("i([aoe])", r"j\1", text)
    text = re.sub("u([aoəe])", r"w\1", text)
    # the apical vowel after retroflex and dental sibilants (zhi, chi, shi, ri; si)
    text = re.sub("([sɹ]`[⁼ʰ]?)([→↓↑ ]+|$)", r"\1ɹ`\2", text).replace("ɻ", "ɹ`")
    return re.sub("(s[⁼ʰ]?)([→↓↑ ]+|$)", r"\1ɹ\2", text)


# ------------------------------------------------------------------ Japanese
_JA_WORD = r"A-Za-z\d\u3005\u3040-\u30ff\u4e00-\u9fff\uff11-\uff19\uff21-\uff3a\uff41-\uff5a\uff66-\uff9d"
_JA_CHARS, _JA_MARKS = re.compile(f"[{_JA_WORD}]"), re.compile(f"[^{_JA_WORD}]")
_SOKUON = ((r"Q([↑↓]*[kg])", r"k#\1"), (r"Q([↑↓]*[tdjʧ])", r"t#\1"),
           (r"Q([↑↓]*[sʃ])", r"s\1"), (r"Q([↑↓]*[pb])", r"p#\1"))  # fmt: skip
_HATSUON = ((r"N([↑↓]*[pbm])", r"m\1"), (r"N([↑↓]*[ʧʥj])", r"n^\1"),
            (r"N([↑↓]*[tdn])", r"n\1"), (r"N([↑↓]*[kg])", r"ŋ\1"))  # fmt: skip
_ROMAJI_IPA = (("u", "ɯ"), ("ʧ", "tʃ"), ("j", "dʑ"), ("y", "j"), ("ni", "n^i"), ("nj", "n^"),
               ("hi", "çi"), ("hj", "ç"), ("f", "ɸ"), ("I", "i*"), ("U", "ɯ*"), ("r", "ɾ"))  # fmt: skip


def pyopenjtalk_module():
    """pyopenjtalk with its dictionary on disk; refuses Japanese by name otherwise (it would
    try to download the dictionary at first use)."""
    try:
        import pyopenjtalk
    except ImportError as e:
        raise FrontendError("Japanese (ja) needs pyopenjtalk: pip install pyopenjtalk") from e
    import os

    folder = os.fsdecode(getattr(pyopenjtalk, "OPEN_JTALK_DICT_DIR", b""))
    if not folder or not Path(folder, "sys.dic").is_file():
        raise FrontendError(
            f"Japanese (ja) needs pyopenjtalk's dictionary, not found at {folder or '(unset)'}: "
            "set OPEN_JTALK_DICT_DIR to an open_jtalk_dic_utf_8 folder, or run "
            "`python -c 'import pyopenjtalk; pyopenjtalk.g2p(\"a\")'` once with network access"
        )
    return pyopenjtalk


def _japanese_romaji(text: str) -> str:
    """Japanese -> romaji with pitch accent marks (↑ rise, ↓ fall, space between phrases)."""
    unidecode = _need("unidecode").unidecode
    pyopenjtalk = pyopenjtalk_module()
    text = text.replace("％", "パーセント")
    sentences, marks = _JA_MARKS.split(text), _JA_MARKS.findall(text)
    out = ""
    for i, sentence in enumerate(sentences):
        if _JA_CHARS.match(sentence):
            out += " " if out else ""
            labels = pyopenjtalk.extract_fullcontext(sentence)
            for n, label in enumerate(labels):
                phoneme = re.search(r"\-([^\+]*)\+", label).group(1)
                if phoneme in ("sil", "pau"):
                    continue
                out += phoneme.replace("ch", "ʧ").replace("sh", "ʃ").replace("cl", "Q")
                a1 = int(re.search(r"/A:(\-?[0-9]+)\+", label).group(1))
                a2 = int(re.search(r"\+(\d+)\+", label).group(1))
                a3 = int(re.search(r"\+(\d+)/", label).group(1))
                following = labels[n + 1]
                if re.search(r"\-([^\+]*)\+", following).group(1) in ("sil", "pau"):
                    a2_next = -1
                else:
                    a2_next = int(re.search(r"\+(\d+)\+", following).group(1))
                if a3 == 1 and a2_next == 1:  # accent phrase boundary
                    out += " "
                elif a1 == 0 and a2_next == a2 + 1:  # falling
                    out += "↓"
                elif a2 == 1 and a2_next == 2:  # rising
                    out += "↑"
        if i < len(marks):
            out += unidecode(marks[i]).replace(" ", "")
    return out


def japanese_ipa(text: str) -> str:
    """Japanese -> IPA as VALL-E X writes it (sokuon and hatsuon assimilated)."""
    text = _japanese_romaji(text).replace("...", "…")
    for pattern, repl in _SOKUON + _HATSUON:
        text = re.sub(pattern, repl, text)
    for old, new in _ROMAJI_IPA:
        text = text.replace(old, new)
    return text


_TO_IPA = {"EN": english_ipa, "ZH": mandarin_ipa, "JA": japanese_ipa}


# ------------------------------------------------------------ a new language
# The phoneme characters of bpe_69.json (each one id; tests check this against the file).
TABLE_CHARACTERS = frozenset("!#*,-.=?NQ^_`abdefghijklmnopstuvwxyz~æçðŋɑɔəɛɥɪɫɯɸɹɾʃʊʑʒʰˈˌθ…⁼↑→↓")
# espeak's IPA -> the table's characters, where VALL-E X writes that sound (or mark) so.
ESPEAK_TO_TABLE = {
    # the same sound under another code point
    "ɡ": "g", "ʧ": "tʃ", "ʤ": "dʒ", "\u0361": "",  # tie bar
    # as VALL-E X's English writes it: one r (ɹ), no length marks, ə for the central vowels
    "r": "ɹ", "ʁ": "ɹ", "ː": "", "ˑ": "", "ʌ": "ə", "ɜ": "ə", "ɐ": "ə", "ɚ": "əɹ", "ɝ": "əɹ",
    "ɒ": "ɑ",
    # palatal(ised) consonants as its Japanese writes them (n^i, kj)
    "ɲ": "n^", "ʲ": "j",
    # punctuation: the table's marks; Spanish opening marks and quotes are not said
    ";": ",", ":": ",", "—": "-", "–": "-", "¿": "", "¡": "", "«": "", "»": "", '"': "",
}  # fmt: skip
_espeak_lock = threading.Lock()


@functools.cache
def _espeak(voice: str):
    from valle.data.espeak import configure_espeak

    configure_espeak()
    from phonemizer.backend import EspeakBackend

    return EspeakBackend(voice, preserve_punctuation=True, with_stress=True,
                         language_switch="remove-flags", logger=logging.getLogger(f"{__name__}.espeak"))


def espeak_ipa(text: str, language: str) -> str:
    """``text`` in espeak's IPA (stress marks kept, words separated by spaces) by the espeak
    voice ``language`` names (``de``, ``german``, ``fr``: valle/data/languages.py)."""
    from valle.data.languages import UnknownLanguageError, espeak_voice

    try:
        voice = espeak_voice(language)
    except UnknownLanguageError as e:
        raise FrontendError(str(e)) from e
    except ImportError as e:
        raise FrontendError(f"language {language!r} is read by espeak: pip install phonemizer "
                            f"espeakng-loader ({e})") from e
    from phonemizer.separator import Separator

    with _espeak_lock:
        out = _espeak(voice).phonemize([text], separator=Separator(word=" ", phone=""), strip=True,
                                       njobs=1)  # fmt: skip
    return re.sub(r"\s+", " ", " ".join(out)).strip()


def to_table(ipa: str, table: frozenset[str] | set[str] = TABLE_CHARACTERS) -> tuple[str, Counter]:
    """``ipa`` in the table's characters (``ESPEAK_TO_TABLE``) and the characters it lacks,
    left out, with their counts."""
    out, lacking = [], Counter()
    for ch in ipa:
        for mapped in ESPEAK_TO_TABLE.get(ch, ch):
            if mapped == " " or mapped in table:
                out.append(mapped)
            else:
                lacking[mapped] += 1
    return re.sub(" +", " ", "".join(out)).strip(), lacking


def describe_lacking(lacking: Counter) -> str:
    """"'ø' (LATIN SMALL LETTER O WITH STROKE) x3, ..." for a report."""
    return ", ".join(f"{ch!r} ({unicodedata.name(ch, f'U+{ord(ch):04X}')}) x{n}"
                     for ch, n in lacking.most_common())


def new_language_phonemes(text: str, language: str,
                          table: frozenset[str] | set[str] = TABLE_CHARACTERS) -> tuple[str, Counter]:
    """A text in a language VALL-E X does not read, as a span of its own languages is said
    (ends in a mark, a full stop added otherwise), and the characters the table lacks."""
    said, lacking = to_table(espeak_ipa(text, language), table)
    if said and said[-1] not in _END_MARKS:
        said += "."
    return said, lacking


def is_new_language(language: str) -> bool:
    """A language none of VALL-E X's own frontends reads (nor mix or auto): espeak reads it."""
    return language_code(language) not in (*LANGUAGES, MIX, AUTO)


# ------------------------------------------------------------------ the text
def phonemes(tagged: str) -> tuple[str, list[str]]:
    """The IPA string of every tagged span of ``tagged`` (text outside tags is dropped, as
    VALL-E X does) and the language of each of its characters."""
    out, languages = "", []
    # Spans of each tag, in text order (one search per tag, as VALL-E X: overlaps count twice).
    found = sorted(
        (m for tag in ("EN", "ZH", "JA")
         for m in re.finditer(rf"\[{tag}\](.*?)\[{tag}\]", tagged)),
        key=lambda m: m.start(),
    )  # fmt: skip
    for m in found:
        tag = m.group(0)[1:3]
        said = re.sub(r"\s+$", "", _TO_IPA[tag](m.group(1)) + " ")
        if said and said[-1] not in _END_MARKS:
            said += "."
        out += said
        languages += [tag.lower()] * len(said)
    return out, languages


def language_code(language: str) -> str:
    """VALL-E X's name of a language given as VALL-E X, espeak or a person writes it."""
    return ALIASES.get(str(language).lower(), str(language).lower())


def symbols(text: str, language: str) -> list[str]:
    """The phoneme characters VALL-E X's byte-pair table maps to one id each (spaces as
    ``_``), of ``text`` in ``language`` (its tag; espeak spellings accepted): what
    bin/tokenizer.py --text-extractor vallex-bpe stores per cut."""
    return symbols_and_lacking(text, language)[0]


def symbols_and_lacking(text: str, language: str) -> tuple[list[str], Counter]:
    """``symbols``, and the characters the table lacks (a new language's; left out)."""
    text = text.replace("\n", "").strip(" ")
    lacking: Counter = Counter()
    if is_new_language(language):
        said, lacking = new_language_phonemes(text, language)
    else:
        said, _ = phonemes(f"_{_tag(text, language_code(language))}".strip())
    return [ch for ch in said.replace(" ", "_") if not ch.isspace()], lacking


def symbol_table_text(bpe_vocab: str | Path) -> str:
    """A k2 symbol table (valle/data/symbols.py) giving each phoneme character of
    ``bpe_69.json`` its id there: a corpus tokenized with it trains a VALL-E X checkpoint on
    the ids its frontend gives. It holds ``<eps>`` and ``<pad>`` but no ``<bos>``/``<eos>``:
    VALL-E X's text has none, so the collater adds none (valle/data/collation.py)."""
    import json

    vocab = json.loads(Path(bpe_vocab).read_text(encoding="utf-8"))["model"]["vocab"]
    chars = {sym: i for sym, i in vocab.items() if len(sym) == 1 and not sym.isspace()}
    reserved = {"<eps>": 0, "<pad>": vocab.get("[PAD]", 3)}
    clash = [sym for sym, i in chars.items() if i in reserved.values()]
    if clash:
        raise FrontendError(f"{bpe_vocab}: ids of {clash} clash with <eps>/<pad>")
    rows = sorted({**reserved, **chars}.items(), key=lambda kv: kv[1])
    return "".join(f"{sym} {i}\n" for sym, i in rows)


def _tag(text: str, language: str) -> str:
    if language == AUTO:
        language = detect_language(text)
    if language == MIX:
        return text
    if language not in TAGS:
        raise FrontendError(f"language {language!r}: VALL-E X reads {', '.join(LANGUAGES)}, "
                            f"{MIX} (tagged text), {AUTO}, or a language its checkpoint gained "
                            "with --add-language")  # fmt: skip
    return TAGS[language] + text + TAGS[language]


@functools.cache
def _language_identifier():
    """langid restricted to en, zh, ja (VALL-E X's ``language='auto'``), not the global one."""
    langid = _need("langid.langid")
    identifier = langid.LanguageIdentifier.from_modelstring(langid.model)
    identifier.set_languages(list(LANGUAGES))
    return identifier


def detect_language(text: str) -> str:
    return _language_identifier().classify(text)[0]


class VallexTokenizer:
    """Texts -> (ids, per-token languages) with a checkpoint's ``bpe_69.json``."""

    name = FRONTEND

    def __init__(self, bpe_vocab: str | Path):
        path = Path(bpe_vocab)
        if not path.is_file():
            raise FrontendError(
                f"the vallex-bpe text frontend's vocabulary {path} is not there: put VALL-E X's "
                f"utils/g2p/{BPE_VOCAB} next to the checkpoint, or pass --bpe-vocab"
            )
        tokenizers = _need("tokenizers")
        self.path = path
        self.bpe = tokenizers.Tokenizer.from_file(str(path))
        self.table = frozenset(s for s in self.bpe.get_vocab() if len(s) == 1 and not s.isspace())
        # a new language's characters the table lacks, left out of every text encoded so far
        self.lacking: Counter = Counter()

    def tag(self, text: str, language: str) -> str:
        """``text`` wrapped in its language's tag (``mix``: as given; ``auto``: detected)."""
        return _tag(text, language)

    def encode_tagged(self, tagged: str) -> tuple[list[int], list[str]]:
        said, languages = phonemes(tagged)
        ids = self.bpe.encode(said.replace(" ", "_")).ids
        if len(ids) != len(languages):  # a character the byte-pair table splits or drops
            raise FrontendError(f"{tagged!r}: {len(ids)} tokens for {len(languages)} phonemes")
        return ids, languages

    def encode_new_language(self, text: str, language: str) -> tuple[list[int], list[str]]:
        """A language a checkpoint gained (--add-language): espeak's IPA in the table's
        characters; those it lacks are left out with a warning naming them."""
        said, lacking = new_language_phonemes(text, language, self.table)
        if lacking:
            self.lacking.update(lacking)
            logger.warning("%r (%s): left out %d character(s) the table %s lacks: %s", text, language,
                           sum(lacking.values()), self.path.name, describe_lacking(lacking))  # fmt: skip
        ids = self.bpe.encode(said.replace(" ", "_")).ids
        if len(ids) != len(said):
            raise FrontendError(f"{text!r}: {len(ids)} tokens for {len(said)} phonemes")
        return ids, [language_code(language)] * len(ids)

    def encode(self, text: str, language: str) -> tuple[list[int], list[str]]:
        """As VALL-E X's ``generate_audio`` tokenizes ``text`` in ``language`` (en, zh, ja,
        mix, auto; a language the checkpoint gained with --add-language: espeak's reading).
        An empty result raises ``FrontendError``."""
        text = text.replace("\n", "").strip(" ")
        if is_new_language(language):
            ids, languages = self.encode_new_language(text, language)
        else:
            ids, languages = self.encode_tagged(f"_{self.tag(text, language)}".strip())
        if not ids:
            raise FrontendError(f"{text!r} gave no phonemes ({language})")
        return ids, languages


def main(argv: list[str] | None = None) -> int:
    """``python -m valle.data.vallex_text symbols --bpe-vocab bpe_69.json --output T``: the
    symbol table for bin/tokenizer.py --text-extractor vallex-bpe --text-tokens T."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m valle.data.vallex_text", description=main.__doc__)
    p.add_argument("command", choices=["symbols"])
    p.add_argument("--bpe-vocab", required=True, help=f"VALL-E X's utils/g2p/{BPE_VOCAB}")
    p.add_argument("--output", required=True, help="the k2 symbol table to write")
    args = p.parse_args(argv)
    Path(args.output).write_text(symbol_table_text(args.bpe_vocab), encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Which writing systems a text uses, and which espeak languages can read them as words.

eSpeak reads a letter outside its voice's script by name ("chinese letter", Cyrillic letter
names), which no recording matches: lifeiteng/vall-e#110. The tokenizer refuses such
training items (``valle.data.validation``); synthesis refuses such texts (``valle.infer_checks``).
Only letters count: digits, punctuation and spaces are read in any script.
"""

from __future__ import annotations

import functools
import importlib.util
import unicodedata
from collections import Counter

# Voices whose languages are written in Latin script: text in another script is read
# letter by letter ("chinese letter", Cyrillic letter names), which no audio matches.
LATIN_SCRIPT_LANGUAGES = {
    "en", "fr", "de", "es", "it", "pt", "nl", "sv", "da", "nb", "no", "fi", "pl", "cs", "sk",
    "sl", "hr", "ro", "hu", "tr", "id", "ms", "vi", "ca", "eu", "gl", "et", "lv", "lt", "sq",
    "af", "sw", "cy", "ga", "is", "mt", "eo", "la",
}  # fmt: skip
# Languages of other scripts, by their base code (what precedes the first "-").
_OTHER_SCRIPT_LANGUAGES = {
    "Han": ("cmn", "yue", "hak", "ko"),  # and ja through the kanji reader (below)
    "Kana": ("ja",),
    "Hangul": ("ko",),
    "Cyrillic": ("ru", "uk", "be", "bg", "mk", "sr", "kk", "ky", "tt", "ba", "cv"),
    "Arabic": ("ar", "fa", "ur", "sd", "ug"),
    "Greek": ("el", "grc"),
    "Hebrew": ("he",),
    "Armenian": ("hy",),
    "Georgian": ("ka",),
    "Devanagari": ("hi", "mr", "ne"),
    "Bengali": ("bn", "as"),
    "Gurmukhi": ("pa",),
    "Gujarati": ("gu",),
    "Oriya": ("or",),
    "Tamil": ("ta",),
    "Telugu": ("te",),
    "Kannada": ("kn",),
    "Malayalam": ("ml",),
    "Sinhala": ("si",),
    "Thai": ("th",),
    "Myanmar": ("my",),
    "Ethiopic": ("am", "ti"),
}
# Languages that are written in more than one script (Serbian in Cyrillic and Latin).
_EXTRA_LATIN = {"sr", "az", "uz", "tk", "kk"}
# First words of Unicode character names that name a script differently.
_NAME_TO_SCRIPT = {"CJK": "Han", "IDEOGRAPHIC": "Han", "HIRAGANA": "Kana", "KATAKANA": "Kana",
                   "KATAKANA-HIRAGANA": "Kana"}  # fmt: skip
_WIDTH_PREFIXES = ("FULLWIDTH ", "HALFWIDTH ")
_BASE_ALIASES = {"zh": "cmn"}  # a code that is not espeak's own but names one of its voices
# eSpeak's ja voice reads kana only; kanji are read when this package turns them into kana
# first (valle.data.japanese), so Han counts as a ja script only where it is installed.
KANJI_READER = "pykakasi"
KANJI_READER_HINT = f"install {KANJI_READER} (pip install -e '.[ja]') for ja to read kanji as kana"


@functools.cache
def kanji_reader_available() -> bool:
    return importlib.util.find_spec(KANJI_READER) is not None


def base_language(language: str) -> str:
    return language.lower().replace("_", "-").split("-")[0]


def letter_script(ch: str) -> str | None:
    """The script of a letter ("Latin", "Han", "Cyrillic", ...); None for anything else."""
    if not ch.isalpha():
        return None
    name = unicodedata.name(ch, "")
    for prefix in _WIDTH_PREFIXES:
        name = name.removeprefix(prefix)
    first = name.split(" ")[0]
    if not first:
        return None
    return _NAME_TO_SCRIPT.get(first, first.title())


def text_scripts(text: str) -> Counter:
    """Letters of ``text`` per script, most frequent first."""
    return Counter(s for s in map(letter_script, text) if s is not None)


def language_scripts(language: str) -> frozenset[str] | None:
    """The scripts an espeak voice reads as words; None for a voice this table does not know
    (such texts are not checked). ``cmn-latn-pinyin`` and the like read Latin."""
    parts = language.lower().replace("_", "-").split("-")
    if "latn" in parts[1:]:
        return frozenset({"Latin"})
    base = _BASE_ALIASES.get(parts[0], parts[0])
    found = {script for script, langs in _OTHER_SCRIPT_LANGUAGES.items() if base in langs}
    if base == "ja" and kanji_reader_available():
        found.add("Han")
    if base in LATIN_SCRIPT_LANGUAGES or base in _EXTRA_LATIN:
        found.add("Latin")
    return frozenset(found) or None


def languages_for_script(script: str, among: list[str] | None = None) -> list[str]:
    """Languages that read ``script``: those of ``among`` (a model's languages) when given,
    else the common espeak voices for it."""
    if among is not None:
        return [lang for lang in among if script in (language_scripts(lang) or ())]
    if script == "Latin":
        return ["en-us", "en-gb", "fr-fr", "de", "es", "it", "pt"]
    common = list(_OTHER_SCRIPT_LANGUAGES.get(script, ()))
    if script == "Han" and "Han" in language_scripts("ja"):
        common.insert(common.index("ko"), "ja")
    return common


def script_runs(text: str) -> list[tuple[str | None, str]]:
    """``text`` cut where the script of its letters changes: (script, piece) pairs whose pieces
    join back to ``text``. What is not a letter (spaces, digits, marks) stays with the letters
    before it; a text without letters is one run of script None."""
    runs: list[tuple[str | None, str]] = []
    for ch in text:
        script = letter_script(ch)
        if runs and (script is None or runs[-1][0] in (None, script)):
            runs[-1] = (runs[-1][0] if script is None else script, runs[-1][1] + ch)
        else:
            runs.append((script, ch))
    return runs


def unreadable_letters(text: str, language: str) -> dict[str, str]:
    """Script -> the distinct letters of that script in ``text`` that ``language`` cannot read
    (empty when it reads them all, or when its scripts are unknown)."""
    readable = language_scripts(language)
    if readable is None:
        return {}
    out: dict[str, str] = {}
    for ch in text:
        script = letter_script(ch)
        if script is not None and script not in readable and ch not in out.get(script, ""):
            out[script] = out.get(script, "") + ch
    return out

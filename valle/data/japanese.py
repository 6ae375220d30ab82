"""Japanese text front end: kanji -> hiragana (pykakasi) before espeak's ``ja`` voice.

eSpeak's ``ja`` voice reads kana only; a kanji makes it switch to English and say "chinese
letter". pykakasi (the ``ja`` extra) gives each kanji word its reading in hiragana, which the
voice then phonemizes. Only the words that hold kanji change: kana, Latin, digits and
punctuation reach espeak as they were written. pykakasi picks one reading per word from its
dictionary (今日は -> こんにちは, not きょうは), a known limit of a dictionary reader.
"""

from __future__ import annotations

import functools
import threading

from valle.data.scripts import KANJI_READER_HINT, kanji_reader_available, letter_script

_kakasi_lock = threading.Lock()


class KanjiReaderMissingError(ImportError):
    """Japanese text with kanji, and pykakasi is not installed."""


def has_kanji(text: str) -> bool:
    return any(letter_script(ch) == "Han" for ch in text)


@functools.cache
def _kakasi():
    if not kanji_reader_available():
        raise KanjiReaderMissingError(f"Japanese text with kanji: {KANJI_READER_HINT}")
    import pykakasi

    return pykakasi.kakasi()  # loads its dictionaries once (about 2 s)


def kanji_to_kana(text: str) -> str:
    """``text`` with every word that holds kanji replaced by its hiragana reading."""
    if not has_kanji(text):
        return text
    with _kakasi_lock:  # one shared converter; its dictionary lookups are not documented thread-safe
        words = _kakasi().convert(text)
    return "".join(w["hira"] if has_kanji(w["orig"]) else w["orig"] for w in words)

"""Text -> phoneme symbols (phonemizer's espeak backend) and symbols -> padded id tensors."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from valle.data.espeak import configure_espeak
from valle.data.scripts import base_language, kanji_reader_available
from valle.data.symbols import SymbolTable

logger = logging.getLogger(__name__)

WORD_SEP = "_"
PHONE_SEP = "|"
# Punctuation kept as symbols of their own (phonemizer's defaults plus brackets).
PUNCTUATION = ';:,.!?¡¿—…"«»“”()[]{}'
# espeak's language-switch markers such as "(zh)" or "(en-us)" (language_switch="keep-flags").
_FLAG_RE = re.compile(r"\(([a-z]{2,3}(?:-[a-z0-9]+)*)\)")
_SPACE_RE = re.compile(r"\s+")

def _quiet_phonemizer_logger() -> logging.Logger:
    # phonemizer warns "words count mismatch" on nearly every line because punctuation is
    # kept as tokens; that is expected here, so only its errors are shown.
    log = logging.getLogger(f"{__name__}.phonemizer")
    log.setLevel(logging.ERROR)
    return log


class TextTokenizationError(ValueError):
    """A text that espeak could not phonemize."""


@dataclass
class Phonemized:
    symbols: list[str]
    # Languages espeak switched to (e.g. ["zh"]): the voice could not read part of the text.
    language_switches: list[str] = field(default_factory=list)
    # vallex-bpe, a language the model gained: characters its table lacks, left out (counts)
    lacking: dict[str, int] = field(default_factory=dict)


def split_phonemized(phonemized: str) -> list[str]:
    """Turn espeak output for one punctuation-free segment ('h|ə|l|oʊ_w|ɜː|l|d') into symbols.

    Phones are never split inside: espeak writes tone and length marks with characters that
    look like punctuation (Mandarin 's.', 'ts.h', 'i.5'), and they belong to their phone.
    Punctuation never reaches espeak (``segment_text`` takes it out first)."""
    symbols: list[str] = []
    words = [w for w in phonemized.strip().split(WORD_SEP) if w.strip()]
    for wi, word in enumerate(words):
        if wi > 0:
            symbols.append(WORD_SEP)
        for piece in word.split(PHONE_SEP):
            symbols.extend(p for p in piece.split() if p)
    return symbols


# Full-width and CJK punctuation -> the ASCII mark kept as a symbol.
_PUNCT_MAP = str.maketrans({"。": ".", "，": ",", "、": ",", "！": "!", "？": "?", "；": ";", "：": ":",
                            "（": "(", "）": ")", "《": "«", "》": "»", "「": "“", "」": "”"})
_PUNCT_RUN_RE = re.compile("([" + re.escape(PUNCTUATION) + r"]+)")


def segment_text(text: str) -> list[tuple[str, str]]:
    """Split text into ("text", words) and ("punct", marks + following whitespace) pieces."""
    pieces: list[tuple[str, str]] = []
    for i, chunk in enumerate(_PUNCT_RUN_RE.split(text.translate(_PUNCT_MAP))):
        if i % 2 == 1:
            pieces.append(("punct", chunk))
            continue
        if pieces and chunk[:1].isspace():  # whitespace after a mark: a word boundary follows
            pieces[-1] = ("punct", pieces[-1][1] + " ")
        if chunk.strip():
            pieces.append(("text", chunk.strip()))
    return pieces


def normalize_text(text: str) -> str:
    # phonemizer treats each line as an utterance: keep one text = one line.
    return _SPACE_RE.sub(" ", text).strip()


TEXT_EXTRACTORS = ("espeak", "pypinyin", "vallex-bpe")


def _is_hanzi(ch: str) -> bool:
    return "\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf"


def pinyin_symbols(text: str) -> Phonemized:
    """Mandarin through pypinyin (``--text-extractor pypinyin``): each character becomes its
    initial (omitted when it has none, e.g. 爱 -> "ai4") and its final with the tone number
    (5 = neutral), e.g. 中 -> "zh", "ong1". Punctuation is kept as a symbol; any other
    character (Latin, digits) is an error, so the caller reports the item instead of
    silently dropping what would not be spoken."""
    from pypinyin import Style, lazy_pinyin

    symbols: list[str] = []
    for kind, piece in segment_text(normalize_text(text)):
        if kind == "punct":
            symbols += [ch for ch in piece if not ch.isspace()]
            continue
        bad = sorted({ch for ch in piece if not ch.isspace() and not _is_hanzi(ch)})
        if bad:
            raise TextTokenizationError(
                f"pypinyin reads Chinese characters only; {text!r} has {''.join(bad)!r} "
                "(write numbers and Latin words out in characters, or use --text-extractor espeak)")
        hanzi = "".join(piece.split())  # whole runs: pypinyin picks polyphone readings in context
        initials = lazy_pinyin(hanzi, style=Style.INITIALS, strict=True)
        finals = lazy_pinyin(hanzi, style=Style.FINALS_TONE3, strict=True, neutral_tone_with_five=True)
        for ini, fin in zip(initials, finals):
            symbols += [s for s in (ini, fin) if s]
    return Phonemized(symbols)


class TextTokenizer:
    """Phonemize texts with espeak; one cached backend per language."""

    def __init__(self, language: str = "en-us", backend: str = "espeak", with_stress: bool = False):
        if backend not in TEXT_EXTRACTORS:
            raise ValueError(f"--text-extractor {backend!r} is not supported ({', '.join(TEXT_EXTRACTORS)})")
        self.language = language
        self.backend_name = backend
        self.with_stress = with_stress
        self._backends: dict[str, object] = {}
        self._lock = threading.Lock()

    def _backend(self, language: str):
        if language not in self._backends:
            configure_espeak()
            from phonemizer.backend import EspeakBackend

            try:
                self._backends[language] = EspeakBackend(
                    language,
                    preserve_punctuation=False,  # segment_text handles punctuation
                    with_stress=self.with_stress,
                    language_switch="keep-flags",
                    logger=_quiet_phonemizer_logger(),
                )
            except RuntimeError as e:
                raise TextTokenizationError(f"espeak has no voice for language {language!r}: {e}") from e
        return self._backends[language]

    def phonemize_one(self, text: str, language: str | None = None) -> Phonemized:
        if self.backend_name == "pypinyin":
            return pinyin_symbols(text)
        if self.backend_name == "vallex-bpe":  # Plachtaa/VALL-E-X's (valle/data/vallex_text.py)
            from valle.data.vallex_text import FrontendError, symbols_and_lacking

            try:
                said, lacking = symbols_and_lacking(text, language or self.language)
                return Phonemized(said, lacking=dict(lacking))
            except FrontendError as e:
                raise TextTokenizationError(str(e)) from e
        from phonemizer.separator import Separator

        language = language or self.language
        text = normalize_text(text)
        if base_language(language) == "ja" and kanji_reader_available():
            from valle.data.japanese import kanji_to_kana

            text = kanji_to_kana(text)  # the ja voice reads kana only (valle/data/japanese.py)
        pieces = segment_text(text)
        segments = [t for kind, t in pieces if kind == "text"]
        if not segments:
            return Phonemized([])
        sep = Separator(word=WORD_SEP, syllable="", phone=PHONE_SEP)
        with self._lock:
            backend = self._backend(language)
            try:
                out = backend.phonemize(segments, separator=sep, strip=True, njobs=1)
                if len(out) != len(segments):  # phonemizer dropped a line: one call each
                    out = [" ".join(backend.phonemize([s], separator=sep, strip=True, njobs=1))
                           for s in segments]
            except Exception as e:  # espeak/phonemizer raise various types
                raise TextTokenizationError(f"phonemizer failed on {text!r}: {e}") from e
        switches: list[str] = []
        symbols: list[str] = []
        outputs = iter(out)
        for kind, piece in pieces:
            if kind == "text":
                phonemized = next(outputs)
                switches += _FLAG_RE.findall(phonemized)
                if symbols and symbols[-1] != WORD_SEP and symbols[-1] not in PUNCTUATION:
                    symbols.append(WORD_SEP)
                symbols += split_phonemized(_FLAG_RE.sub("", phonemized))
            else:
                symbols += [ch for ch in piece if not ch.isspace()]
                if piece.endswith(" ") and symbols:
                    symbols.append(WORD_SEP)
        while symbols and symbols[-1] == WORD_SEP:
            symbols.pop()
        return Phonemized(symbols, switches)

    def __call__(self, texts: Sequence[str], language: str | None = None) -> list[list[str]]:
        if isinstance(texts, str):
            raise TypeError("TextTokenizer expects a list of texts, not a single str")
        return [self.phonemize_one(t, language).symbols for t in texts]


class UnknownSymbolError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class TextTokenCollater:
    """Symbols -> (B, S) LongTensor padded with the pad id, optional bos/eos, plus lengths."""

    def __init__(self, symbol_table: SymbolTable, add_bos: bool = True, add_eos: bool = True):
        self.symbol_table = symbol_table
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.pad_id = symbol_table.pad_id
        self.bos_id = symbol_table.bos_id if add_bos else None
        self.eos_id = symbol_table.eos_id if add_eos else None

    def encode(self, symbols: Sequence[str], cut_id: str | None = None) -> list[int]:
        ids = [self.bos_id] if self.add_bos else []
        for sym in symbols:
            if sym not in self.symbol_table:
                where = f" (cut {cut_id})" if cut_id is not None else ""
                raise UnknownSymbolError(
                    f"unknown text symbol {sym!r}{where}: not in the symbol table "
                    f"({len(self.symbol_table)} symbols); re-run bin/tokenizer.py or pass the "
                    "--text-tokens table the cuts were tokenized with"
                )
            ids.append(self.symbol_table.get(sym))
        if self.add_eos:
            ids.append(self.eos_id)
        return ids

    def __call__(
        self, texts: Sequence[Sequence[str]], ids: Sequence[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.encode(t, None if ids is None else ids[i]) for i, t in enumerate(texts)]
        lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
        width = int(lens.max()) if len(rows) else 0
        out = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return out, lens

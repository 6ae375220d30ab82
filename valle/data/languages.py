"""Supervision language -> espeak voice.

lhotse recipes spell languages as names ("English", "Mandarin"), corpora use ISO 639-1
("fr"), ISO 639-3 ("fra", "deu", "cmn") or tags ("en-US", "pt_BR"). Every voice espeak
knows is reachable by its own code, its name, and the ISO codes of its language.
"""

from __future__ import annotations

import functools
import re

# ISO 639-3 (terminological and bibliographic) -> ISO 639-1, for the languages espeak has a
# two-letter voice for. Codes espeak uses itself ("cmn", "yue", "haw", ...) need no entry.
ISO3_TO_ISO1 = {
    "afr": "af", "amh": "am", "arg": "an", "ara": "ar", "asm": "as", "aze": "az", "bak": "ba",
    "bel": "be", "bul": "bg", "ben": "bn", "bos": "bs", "cat": "ca", "ces": "cs", "cze": "cs",
    "chv": "cv", "cym": "cy", "wel": "cy", "dan": "da", "deu": "de", "ger": "de", "ell": "el",
    "gre": "el", "eng": "en", "epo": "eo", "spa": "es", "est": "et", "eus": "eu", "baq": "eu",
    "fas": "fa", "per": "fa", "fin": "fi", "fao": "fo", "fra": "fr", "fre": "fr", "gle": "ga",
    "gla": "gd", "grn": "gn", "guj": "gu", "heb": "he", "hin": "hi", "hrv": "hr", "hat": "ht",
    "hun": "hu", "hye": "hy", "arm": "hy", "ina": "ia", "ind": "id", "ido": "io", "isl": "is",
    "ice": "is", "ita": "it", "jpn": "ja", "kat": "ka", "geo": "ka", "kaz": "kk", "kal": "kl",
    "kan": "kn", "kor": "ko", "kur": "ku", "kir": "ky", "lat": "la", "ltz": "lb", "lit": "lt",
    "lav": "lv", "mri": "mi", "mao": "mi", "mkd": "mk", "mac": "mk", "mal": "ml", "mar": "mr",
    "msa": "ms", "may": "ms", "mlt": "mt", "mya": "my", "bur": "my", "nob": "nb", "nor": "nb",
    "no": "nb", "nep": "ne", "nld": "nl", "dut": "nl", "orm": "om", "ori": "or", "pan": "pa",
    "pol": "pl", "por": "pt", "que": "qu", "ron": "ro", "rum": "ro", "rus": "ru", "snd": "sd",
    "sin": "si", "slk": "sk", "slo": "sk", "slv": "sl", "sqi": "sq", "alb": "sq", "srp": "sr",
    "swe": "sv", "swa": "sw", "tam": "ta", "tel": "te", "tha": "th", "tir": "ti", "tuk": "tk",
    "tsn": "tn", "tur": "tr", "tat": "tt", "uig": "ug", "ukr": "uk", "urd": "ur", "uzb": "uz",
    "vie": "vi", "zho": "cmn", "chi": "cmn", "zh": "cmn",
}
# Where a language has several voices, the one a bare language name or code selects.
PREFERRED = {
    "en": "en-us", "fr": "fr-fr", "es": "es", "pt": "pt", "vi": "vi", "ca": "ca", "hy": "hy",
    "ru": "ru", "fa": "fa", "el": "el",
}
# Names lhotse recipes use that are not espeak's own names.
NAME_ALIASES = {
    "chinese": "cmn", "mandarin": "cmn", "mandarin chinese": "cmn", "cantonese": "yue",
    "english": "en-us", "american english": "en-us", "british english": "en-gb",
    "persian": "fa", "farsi": "fa", "norwegian": "nb", "burmese": "my", "irish": "ga",
    "scottish gaelic": "gd", "brazilian portuguese": "pt-br", "spanish": "es",
    "portuguese": "pt", "french": "fr-fr", "armenian": "hy", "vietnamese": "vi",
    "greek": "el", "catalan": "ca", "slovene": "sl", "maori": "mi",
}


class UnknownLanguageError(ValueError):
    """A supervision language no espeak voice speaks."""


@functools.lru_cache(maxsize=1)
def espeak_voices() -> dict[str, str]:
    """espeak's voices: code -> name (as phonemizer lists them)."""
    from valle.data.espeak import configure_espeak

    configure_espeak()
    from phonemizer.backend import EspeakBackend

    return {code.lower(): name for code, name in EspeakBackend.supported_languages().items()}


def _normalize(language: str) -> str:
    return re.sub(r"\s+", " ", language.strip().lower().replace("_", "-"))


@functools.cache
def _lookup(key: str) -> str | None:
    voices = espeak_voices()
    if key in voices:
        return key
    if key in NAME_ALIASES:
        return NAME_ALIASES[key]
    # espeak's own names: "german", "french (france)", "chinese (mandarin, latin as english)".
    by_name = {}
    for code, name in sorted(voices.items()):
        full = _normalize(name)
        by_name.setdefault(full, code)
        by_name.setdefault(full.split(" (")[0], code)
    if key in by_name:
        base = key.split(" (")[0]
        return NAME_ALIASES.get(base, by_name[key]) if key == base else by_name[key]
    base, _, region = key.partition("-")
    iso1 = ISO3_TO_ISO1.get(base, base)
    if iso1 in voices and not region:
        return PREFERRED.get(iso1, iso1)
    if region and f"{iso1}-{region}" in voices:  # "en-US" -> "en-us", "fra-FR" -> "fr-fr"
        return f"{iso1}-{region}"
    if iso1 in PREFERRED:
        return PREFERRED[iso1]
    if iso1 in voices:
        return iso1
    variants = sorted(c for c in voices if c.split("-")[0] == iso1)
    return variants[0] if variants else None


def split_languages(value: str | list[str] | None) -> list[str]:
    """A ``--languages`` value ("en-us,cmn" or a list, as checkpoints keep it) as a list."""
    if isinstance(value, str):
        return [x.strip() for x in value.split(",") if x.strip()]
    return list(value or [])


def espeak_voice(language: str | None, default: str = "en-us") -> str:
    """The espeak voice for a supervision's language (``default`` when it has none)."""
    if language is None or not str(language).strip():
        return default
    voice = _lookup(_normalize(str(language)))
    if voice is None:
        raise UnknownLanguageError(
            f"no espeak voice for language {language!r} (give a name, an ISO 639-1/3 code or an "
            "espeak voice code; `python -m valle.data.languages` lists them)")
    return voice


def main() -> None:
    for code, name in sorted(espeak_voices().items()):
        print(f"{code}\t{name}")


if __name__ == "__main__":
    main()

"""What synthesis refuses before any model work (issue #42), and the words it refuses with.

* Script: a text whose letters its language's voice cannot read as words (Han under en-us,
  Latin under cmn, ...) gives noise: eSpeak spells such letters out ("chinese letter").
* Length: a text far longer than anything the checkpoint was trained on becomes one attention
  over all of it (and up to --max-len-ratio times as many frames): an OOM or minutes of work.
  The limit comes from the checkpoint's training config (``text_limit``).

Each check returns a ``TextProblem`` (the field it concerns and the message) or None; the
callers decide what a refusal is (bin/infer.py: a failed item; the page: a 400 on the field).
Torch-free, phonemizer-free: the phonemes are counted by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from valle.data.scripts import (
    KANJI_READER_HINT,
    base_language,
    language_scripts,
    languages_for_script,
    script_runs,
    text_scripts,
    unreadable_letters,
)

# bin/trainer.py's (and lifeiteng's) --filter-max-duration default: the training length of a
# checkpoint whose config does not record one.
DEFAULT_TRAINING_SECONDS = 20.0


@dataclass(frozen=True)
class TextProblem:
    field: str  # the page's form field: "text" or "prompt_text"
    message: str


@dataclass(frozen=True)
class TextLimit:
    max_tokens: int  # text tokens (phonemes, word boundaries, punctuation) of one piece of text
    source: str  # how it was derived, said in the refusal


def text_limit(config: dict[str, Any]) -> TextLimit:
    """The most text tokens one synthesis piece may have: what the longest training item could
    carry (--filter-max-duration seconds at the trainer's text-budget rate), or the training
    batch's whole text budget (--max-text-tokens) when that is smaller."""
    from valle.data.datamodule import DEFAULT_TEXT_TOKENS_PER_SECOND, TEXT_BUDGET_MARGIN

    seconds = float(config.get("filter_max_duration") or DEFAULT_TRAINING_SECONDS)
    rate = TEXT_BUDGET_MARGIN * DEFAULT_TEXT_TOKENS_PER_SECOND
    longest = math.ceil(rate * seconds)
    budget = config.get("max_text_tokens")
    if isinstance(budget, int) and not isinstance(budget, bool) and 0 < budget < longest:
        return TextLimit(budget, f"its training batches held at most --max-text-tokens {budget}")
    return TextLimit(longest, f"its longest training items, --filter-max-duration {seconds:g} s, "
                              f"carry about {rate:g} text tokens/s")  # fmt: skip


def script_problem(text: str, language: str, field: str, model_languages: list[str] | None = None,
                   ) -> TextProblem | None:  # fmt: skip
    """Letters that the ``language`` voice cannot read; the message names their script and the
    languages (the model's own, for a VALL-E X checkpoint) that could say them."""
    unreadable = unreadable_letters(text, language)
    if not unreadable:
        return None
    what = "the text" if field == "text" else "the prompt's transcript"
    parts = []
    for script, letters in unreadable.items():
        can = languages_for_script(script, model_languages)
        said_by = (f"languages that can: {', '.join(can)}" if can else
                   "none of this checkpoint's languages can" if model_languages is not None else
                   "no language known here can")  # fmt: skip
        if script == "Han" and base_language(language) == "ja":
            said_by += f" ({KANJI_READER_HINT})"
        parts.append(f"{script} letters ({letters[:12]!r}) that the {language} voice cannot read as "
                     f"words (eSpeak would spell them out); {said_by}")  # fmt: skip
    return TextProblem(field, f"{what} has " + "; and ".join(parts))


def length_problem(tokens: int, limit: TextLimit, split_sentences: bool,
                   counted_sentences: tuple[int, int] | None = None) -> TextProblem | None:  # fmt: skip
    """Text longer than ``limit``: the way forward is sentence splitting, or a shorter sentence.
    ``counted_sentences`` (k, n): ``tokens`` counts only the first k of its n sentences."""
    if tokens <= limit.max_tokens:
        return None
    way = ("shorten this sentence (it is one piece even with sentence splitting)" if split_sentences
           else "turn on sentence splitting (bin/infer.py --split-sentences) or shorten it")  # fmt: skip
    size = f"{tokens} text tokens long"
    if counted_sentences is not None:
        size = (f"over {limit.max_tokens} text tokens long ({tokens} in its first "
                f"{counted_sentences[0]} of {counted_sentences[1]} sentences)")  # fmt: skip
    return TextProblem("text", f"the text is {size}, more than this checkpoint "
                               f"takes in one piece ({limit.max_tokens}: {limit.source}): {way}")  # fmt: skip


# ------------------------------------------------------------------ --language auto
AUTO = "auto"


@dataclass(frozen=True)
class Segment:
    text: str
    language: str


def _first_fitting(script: str, piece: str, model_languages: list[str] | None,
                   fits: Callable[[str, str], bool]) -> tuple[str | None, list[str]]:  # fmt: skip
    """(the first language that reads ``script`` and whose phonemes of ``piece`` the checkpoint
    knows, or None; the languages tried)."""
    tried = []
    for language in languages_for_script(script, model_languages):
        tried.append(language)
        if fits(piece, language):
            return language, tried
    return None, tried


def auto_segments(sentence: str, model_languages: list[str] | None, fits: Callable[[str, str], bool],
                  field: str = "text", default: str = "en-us") -> list[Segment] | TextProblem:  # fmt: skip
    """``--language auto`` for one sentence: its main script picks its language (the first of
    ``model_languages``, or of the common voices, that reads the script and whose phonemes the
    checkpoint's symbol table has: ``fits(piece, language)``). Letters of another script inside
    it (an English name in Chinese) are said in a language of their own, as VALL-E X says a
    prompt and a text in two languages. A script no such language reads is a problem."""
    runs = script_runs(sentence)
    counts = text_scripts(sentence)
    if not counts:  # digits and marks only: said in the default language
        return [Segment(sentence, model_languages[0] if model_languages else default)]
    main_script = counts.most_common(1)[0][0]
    main_piece = " ".join(piece for script, piece in runs if script == main_script)
    main, tried = _first_fitting(main_script, main_piece, model_languages, fits)
    segments: list[Segment] = []
    for script, piece in runs:
        language = main if main is not None and script in (language_scripts(main) or ()) else None
        if language is None:
            language, tried = _first_fitting(script, piece, model_languages, fits)
        if language is None:
            what = "the text" if field == "text" else "the prompt's transcript"
            why = (f"none of the languages that read it ({', '.join(tried)}) has phonemes this "
                   "checkpoint's symbol table holds" if tried else
                   "none of this checkpoint's languages reads it" if model_languages is not None else
                   "no language known here reads it")  # fmt: skip
            return TextProblem(field, f"{what} has {script} letters ({piece.strip()[:20]!r}): {why}")
        if segments and segments[-1].language == language:
            segments[-1] = Segment(segments[-1].text + piece, language)
        else:
            segments.append(Segment(piece, language))
    return segments

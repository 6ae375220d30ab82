"""The synthesis frontend: an ``Item`` (text, prompt transcript, prompt audio or VALL-E X .npz)
-> a ``Prepared`` unit (text ids, a language per id, prompt codes) for the decoding engine
(valle/engine.py), with every check that refuses a text before any model work.

``Synthesizer`` reads texts with the checkpoint's frontend (espeak/pypinyin phonemes and its
symbol table, or VALL-E X's BPE: valle/data/vallex_text.py) and prompts with its codec;
``bin/infer.py`` (valle/infer.py) and the synthesis server (valle/serve) both use it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from valle.data.languages import split_languages
from valle.engine import Failure, Prepared, decode_prepared
from valle.infer_checks import (
    AUTO,
    Segment,
    TextProblem,
    auto_segments,
    length_problem,
    script_problem,
    text_limit,
)
from valle.models.generation import DecodeOptions

logger = logging.getLogger(__name__)


class InputError(ValueError):
    """Bad user input (missing file, unknown symbol, empty text): reported without a traceback."""


class TextError(InputError):
    """A text synthesis refuses (a script its language cannot read, too long): ``field`` is the
    page's form field it concerns ("text" or "prompt_text")."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass
class Item:
    prompt_text: str
    prompt_wav: str | list[str]  # several: their codes are joined in time into one prompt
    text: str
    out_wav: Path
    name: str  # how messages refer to this item

    @property
    def prompt_wavs(self) -> list[str]:
        return [self.prompt_wav] if isinstance(self.prompt_wav, str) else list(self.prompt_wav)


class _PadOnly(NamedTuple):
    """What ``decode`` reads of a collater: the text's padding id."""

    pad_id: int


# ------------------------------------------------------------ VALL-E X prompts
VALLEX_FRONTEND = "vallex-bpe"
PROMPT_FILE_SUFFIX = ".npz"


class PromptFile(NamedTuple):
    codes: torch.Tensor  # (P, Q)
    text_ids: list[int]
    language: str


def is_prompt_file(path: str) -> bool:
    return str(path).lower().endswith(PROMPT_FILE_SUFFIX)


def read_prompt_file(path: str, name: str) -> PromptFile:
    """A VALL-E X prompt (``.npz``: ``audio_tokens`` (1, P, 8), ``text_tokens`` (1, S) and
    ``lang_code``, numbered as its ``macros.lang2code``: zh 0, ja 1, en 2)."""
    import numpy as np

    from valle.data.vallex_text import PROMPT_FILE_LANGUAGES

    keys = ("audio_tokens", "text_tokens", "lang_code")
    try:
        with np.load(path) as data:
            fields = {k: data[k] for k in keys if k in data.files}
    except Exception as e:  # missing, not an npz
        raise InputError(f"{name}: cannot read prompt file {path}: {e}") from e
    missing = [k for k in keys if k not in fields]
    if missing:
        raise InputError(f"{name}: prompt file {path} lacks {', '.join(missing)} (a VALL-E X "
                         "prompt holds audio_tokens, text_tokens and lang_code)")  # fmt: skip
    audio = fields["audio_tokens"]
    codes = torch.from_numpy(audio.astype("int64")).reshape(-1, audio.shape[-1])
    code = int(np.asarray(fields["lang_code"]).reshape(-1)[0])
    if code not in PROMPT_FILE_LANGUAGES:
        raise InputError(f"{name}: prompt file {path}: lang_code {code} is none of VALL-E X's "
                         f"{PROMPT_FILE_LANGUAGES}")  # fmt: skip
    return PromptFile(codes, [int(i) for i in fields["text_tokens"].reshape(-1)],
                      PROMPT_FILE_LANGUAGES[code])  # fmt: skip


def vallex_language(language: str, table: list[str], flag: str) -> str:
    """A VALL-E X checkpoint's language by its name (or auto/mix)."""
    from valle.data.vallex_text import AUTO as VALLEX_AUTO
    from valle.data.vallex_text import MIX, language_code

    lang = language_code(language)
    if lang not in (*table, VALLEX_AUTO, MIX):
        raise InputError(f"{flag} {language}: this VALL-E X checkpoint reads {', '.join(table)}, "
                         f"{MIX} ([EN]..[EN][ZH]..[ZH] tagged text) or {VALLEX_AUTO}")  # fmt: skip
    return lang


_SENTENCE_END = re.compile(r"(?<=[.!?;…])\s+|(?<=[。！？；])")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (the end punctuation kept); the text itself when it has one."""
    parts = [s.strip() for s in _SENTENCE_END.split(text.strip())]
    return [s for s in parts if s] or [text]


# ------------------------------------------------------------------ synthesis
class Synthesizer:
    """Tokenises texts and prompts, runs the model, decodes codes to audio."""

    def __init__(
        self,
        model,
        symbol_table_path: str | Path,
        audio_tokenizer,
        device,
        language: str = "en-us",
        prompt_language: str | None = None,
        checkpoint_config: dict[str, Any] | None = None,
        languages: list[str] | str | None = None,
        text_extractor: str = "espeak",
        decoder=None,
        accent: str | None = None,
    ):
        """``decoder``: what turns codes into audio instead of the codec's own decoder
        (--decoder vocos: a ``VocosDecoder``); None: the codec's. ``symbol_table_path``: the
        checkpoint's text vocabulary, a symbol table, or for a checkpoint whose config names
        the ``vallex-bpe`` text frontend (Plachtaa/VALL-E-X) its ``bpe_69.json``."""
        from valle.data.symbols import SymbolTable
        from valle.data.text import TextTokenCollater, TextTokenizer

        self.config = dict(checkpoint_config or {})
        self.frontend = self.config.get("text_frontend") or "espeak"
        if self.frontend == VALLEX_FRONTEND:
            self._init_vallex(model, symbol_table_path, device, language, prompt_language,
                              audio_tokenizer, decoder)  # fmt: skip
            # VALL-E X's accent option: every token of the text in this one language
            self.accent = vallex_language(accent, list(self.language_ids), "--accent") if accent else None
            if self.accent not in (None, *self.language_ids):
                raise InputError(f"--accent {accent}: one of {', '.join(self.language_ids)}")
            return
        if accent:
            raise InputError("--accent is for Plachtaa/VALL-E-X checkpoints (text frontend vallex-bpe)")
        path = Path(symbol_table_path)
        if not path.is_file():
            raise InputError(f"symbol table {path} not found (pass --text-tokens)")
        table = SymbolTable.from_file(path)
        largest = max(table.ids)
        if largest >= model.num_text_tokens:
            raise InputError(
                f"symbol table {path} has ids up to {largest} but the model has "
                f"{model.num_text_tokens} text tokens: wrong table for this checkpoint"
            )
        self.model, self.device = model, torch.device(device)
        self.language, self.prompt_language = language, prompt_language or language
        self.text_tokenizer = TextTokenizer(language=language, backend=text_extractor)
        self.collater = TextTokenCollater(table, add_bos=True, add_eos=True)
        self.audio_tokenizer = audio_tokenizer
        self.decoder = decoder
        self.language_ids = self._language_ids(model, languages or self.config.get("languages"))
        self.text_limit = text_limit(self.config)
        self._phoneme_cache: dict[tuple[str, str], list[str]] = {}
        self.symbols = table
        # --language auto picks among these (None: the common voices of each script)
        self.auto_languages = (list(self.language_ids) if self.language_ids is not None
                               else split_languages(languages or self.config.get("languages")) or None)  # fmt: skip

    def _init_vallex(self, model, bpe_vocab, device, language, prompt_language, audio_tokenizer,
                     decoder) -> None:
        """The vallex-bpe frontend (valle/data/vallex_text.py): VALL-E X's languages by name
        (en, zh, ja, mix, auto; espeak spellings of those accepted), ids from the checkpoint's
        language table."""
        from valle.data.vallex_text import FrontendError, VallexTokenizer

        try:
            self.text_tokenizer = VallexTokenizer(bpe_vocab)
        except FrontendError as e:
            raise InputError(str(e)) from e
        self.model, self.device = model, torch.device(device)
        self.audio_tokenizer, self.decoder = audio_tokenizer, decoder
        table = list(self.config.get("languages") or [])
        if len(table) != getattr(model, "num_languages", 0):
            raise InputError(f"the checkpoint's language table {table} does not fit its "
                             f"{getattr(model, 'num_languages', 0)} language rows")  # fmt: skip
        self.language_ids = {lang: i for i, lang in enumerate(table)}
        self.language = vallex_language(language, table, "--language")
        self.prompt_language = vallex_language(prompt_language or language, table, "--prompt-language")
        pad = self.text_tokenizer.bpe.token_to_id("[PAD]")
        self.collater = _PadOnly(0 if pad is None else pad)
        self.text_limit = None
        self.auto_languages = None

    def _language_ids(self, model, languages) -> dict[str, int] | None:
        """VALL-E X: espeak language -> id, checked against the model and the two languages."""
        n = getattr(model, "num_languages", 0)
        if not n:
            return None
        from valle.data.languages import split_languages

        languages = split_languages(languages)
        if not languages:
            raise InputError(
                f"the model has --num-languages {n} but the checkpoint lists no 'languages': "
                "pass --languages (e.g. en-us,cmn in training id order)"
            )
        if len(languages) > n:
            raise InputError(f"--languages lists {len(languages)} languages, the model has {n}")
        ids = {lang: i for i, lang in enumerate(languages)}
        for flag, lang in (
            ("--language", self.language),
            ("--prompt-language", self.prompt_language),
        ):
            if lang not in ids and lang != AUTO:
                raise InputError(
                    f"{flag} {lang}: not one of the model's languages {list(languages)}"
                )
        return ids

    def _phonemes(self, text: str, language: str, what: str, item: Item) -> list[str]:
        from valle.data.text import TextTokenizationError

        if not text.strip():
            return []
        key = (text, language)
        if key in self._phoneme_cache:  # text_problem phonemized it already
            return self._phoneme_cache[key]
        try:
            syms = self.text_tokenizer([text], language=language)[0]
        except TextTokenizationError as e:
            raise InputError(f"{item.name}: {what} ({language}): {e}") from e
        if not syms:
            raise InputError(f"{item.name}: {what} {text!r} gave no phonemes ({language})")
        if len(self._phoneme_cache) >= 256:
            self._phoneme_cache.clear()
        self._phoneme_cache[key] = syms
        return syms

    def _fits(self, piece: str, language: str) -> bool:
        """--language auto: ``language`` phonemizes ``piece`` into symbols of the checkpoint's table."""
        from valle.data.text import TextTokenizationError

        try:
            symbols = self.text_tokenizer.phonemize_one(piece, language)
        except TextTokenizationError:
            return False
        return bool(symbols.symbols) and all(sym in self.symbols for sym in symbols.symbols)

    def _segments(self, text: str, language: str, field_name: str) -> list[Segment] | TextProblem:
        """The pieces of ``text`` and the language each is said in: one, or with --language auto
        one or more per sentence (valle/infer_checks.py ``auto_segments``)."""
        if language != AUTO:
            return script_problem(text, language, field_name, self.auto_languages if self.language_ids
                                  is not None else None) or [Segment(text, language)]  # fmt: skip
        segments: list[Segment] = []
        for sentence in split_sentences(text) if text.strip() else []:
            found = auto_segments(sentence, self.auto_languages, self._fits, field_name)
            if isinstance(found, TextProblem):
                return found
            segments += found
        return segments

    def _said(self, text: str, language: str, field_name: str, item: Item) -> tuple[list[str], list[str]]:
        """(symbols of ``text``, the language of each): its segments phonemized, word-separated.
        A refused text raises ``TextError``."""
        from valle.data.text import WORD_SEP

        segments = self._segments(text, language, field_name)
        if isinstance(segments, TextProblem):
            raise TextError(segments.field, f"{item.name}: {segments.message}")
        symbols: list[str] = []
        languages: list[str] = []
        for segment in segments:
            part = self._phonemes(segment.text, segment.language, field_name.replace("_", " "), item)
            if symbols and part:
                symbols.append(WORD_SEP)
                languages.append(languages[-1])
            symbols += part
            languages += [segment.language] * len(part)
        return symbols, languages

    def text_problem(self, item: Item, split_sentences: bool = False) -> TextProblem | None:
        """Why ``item`` cannot be synthesised as given (valle/infer_checks.py), or None: letters
        its languages cannot read, or a text longer than the checkpoint takes in one piece."""
        if self.frontend == VALLEX_FRONTEND:
            return self._vallex_problem(item)
        for text, language, field_name in ((item.text, self.language, "text"),
                                           (item.prompt_text, self.prompt_language, "prompt_text")):  # fmt: skip
            segments = self._segments(text, language, field_name)
            if isinstance(segments, TextProblem):
                return segments
        if item.text.strip():
            early = too_long_early(self, item, split_sentences)
            if early is not None:
                return early
            tokens = len(self._said(item.text, self.language, "text", item)[0])
            return length_problem(tokens, self.text_limit, split_sentences)
        return None

    def _text_ids(self, item: Item, continual: bool) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """Token ids of BOS + prompt transcript + text + EOS, the prompt part's length, and
        the language id of each token (VALL-E X; else None).

        The prompt's transcript and the text are phonemized separately, each in its own
        language; a word separator joins them and counts as part of the prompt. BOS takes the
        prompt's language, EOS the text's.
        """
        from valle.data.text import WORD_SEP

        if not item.text.strip() and not continual:
            raise InputError(f"{item.name}: the text to synthesise is empty")
        if self.frontend == VALLEX_FRONTEND:
            return self._vallex_text_ids(item)
        if any(is_prompt_file(p) for p in item.prompt_wavs):
            raise InputError(f"{item.name}: a VALL-E X prompt file (.npz) holds VALL-E X text ids, "
                             "for a vallex-bpe checkpoint only: give a wav and its transcript")  # fmt: skip
        prompt, prompt_langs = self._said(item.prompt_text, self.prompt_language, "prompt_text", item)
        text, text_langs = self._said(item.text, self.language, "text", item)
        if prompt and text:
            prompt, prompt_langs = prompt + [WORD_SEP], prompt_langs + prompt_langs[-1:]
        if not prompt and not text:
            raise InputError(f"{item.name}: empty text (and empty prompt text)")
        try:
            ids = self.collater.encode(prompt + text, item.name)
        except KeyError as e:
            raise InputError(str(e)) from e
        if self.language_ids is None:
            return torch.tensor(ids, dtype=torch.long), len(prompt), None
        bos = prompt_langs[:1] or ([self.prompt_language] if self.prompt_language != AUTO else text_langs[:1])
        eos = text_langs[-1:] or ([self.language] if self.language != AUTO else prompt_langs[-1:])
        langs = [self.language_ids[lang] for lang in bos + prompt_langs + text_langs + eos]
        return torch.tensor(ids, dtype=torch.long), len(prompt), torch.tensor(langs, dtype=torch.long)

    def _vallex_encode(self, text: str, language: str, what: str, item: Item) -> tuple[list[int], list[str]]:
        from valle.data.vallex_text import FrontendError

        try:
            return self.text_tokenizer.encode(text, language)
        except FrontendError as e:
            raise TextError(what, f"{item.name}: {what.replace('_', ' ')} ({language}): {e}") from e

    def _vallex_prompt_text(self, item: Item) -> tuple[list[int], list[str]]:
        """The prompt's ids and the language of each: from its .npz files (VALL-E X's own
        prompts), else its transcript. Each prompt's ids take its one language, as VALL-E X
        gives the whole prompt one."""
        files = item.prompt_wavs
        if files and all(is_prompt_file(p) for p in files):
            ids, langs = [], []
            for path in files:
                prompt = read_prompt_file(path, item.name)
                ids += prompt.text_ids
                langs += [prompt.language] * len(prompt.text_ids)
            return ids, langs
        if any(is_prompt_file(p) for p in files):
            raise InputError(f"{item.name}: prompt files mix .npz and audio: give one kind")
        if not item.prompt_text.strip():
            return [], []
        ids, langs = self._vallex_encode(item.prompt_text, self.prompt_language, "prompt_text", item)
        return ids, [langs[0]] * len(ids)

    def _vallex_text_ids(self, item: Item) -> tuple[torch.Tensor, int, torch.Tensor]:
        """VALL-E X's ids: the prompt's, then the text's (no BOS/EOS), languages per token."""
        prompt, prompt_langs = self._vallex_prompt_text(item)
        text, text_langs = [], []
        if item.text.strip():
            text, text_langs = self._vallex_encode(item.text, self.language, "text", item)
            if self.accent:
                text_langs = [self.accent] * len(text)
        if not prompt and not text:
            raise InputError(f"{item.name}: empty text (and empty prompt text)")
        ids = self.language_ids
        missing = sorted(set(prompt_langs + text_langs) - set(ids))
        if missing:
            raise InputError(f"{item.name}: language(s) {missing} not in the checkpoint's table {list(ids)}")
        langs = [ids[lang] for lang in prompt_langs + text_langs]
        return (torch.tensor(prompt + text, dtype=torch.long), len(prompt),
                torch.tensor(langs, dtype=torch.long))  # fmt: skip

    def _vallex_problem(self, item: Item) -> TextProblem | None:
        try:
            self._vallex_text_ids(item)
        except TextError as e:
            return TextProblem(e.field, str(e))
        except InputError:
            return None  # reported by prepare, naming the item
        return None

    def _prompt_codes(self, item: Item) -> torch.Tensor:
        """The prompt's codes (P, Q): every prompt file of ``item`` encoded (a VALL-E X .npz
        prompt: its codes), joined in time."""
        from valle.codec.audio import load_audio_24k

        q = self.model.num_quantizers
        if not item.prompt_wavs or not all(item.prompt_wavs):
            raise InputError(f"{item.name}: no prompt audio file")
        parts = []
        for wav_path in item.prompt_wavs:
            if is_prompt_file(wav_path):
                c = read_prompt_file(wav_path, item.name).codes
                if c.shape[1] < q:
                    raise InputError(f"{item.name}: prompt {wav_path} has {c.shape[1]} codebooks, "
                                     f"the model needs {q}")  # fmt: skip
                parts.append(c[:, :q])
                continue
            try:
                wav = load_audio_24k(wav_path)
            except Exception as e:  # unreadable, missing, empty: the message names the file
                raise InputError(f"{item.name}: cannot read prompt audio {wav_path}: {e}") from e
            c = self.audio_tokenizer.encode(wav)[0].T  # (T, 8)
            if c.shape[1] < q:
                raise InputError(
                    f"the audio tokenizer gives {c.shape[1]} codebooks, the model needs {q}"
                )
            parts.append(c[:, :q].cpu())
        return torch.cat(parts, dim=0)

    def prepare(self, item: Item, continual: bool = False) -> Prepared:
        """``item`` as the model takes it (the frontend's half of synthesis): its text ids, their
        languages and the prompt's codes. Bad input raises ``InputError``."""
        text, prompt_text_len, languages = self._text_ids(item, continual)
        return Prepared(item.name, text, prompt_text_len, self._prompt_codes(item), languages)

    def _code_vectors(self, nar_decoding: str) -> list[torch.Tensor] | None:
        """The codec's code vectors for ``--nar-decoding mmse`` (None for argmax)."""
        if nar_decoding == "argmax":
            return None
        get = getattr(self.audio_tokenizer, "code_vectors", None)
        if get is None:
            raise InputError(f"--nar-decoding {nar_decoding}: the codec "
                             f"{type(self.audio_tokenizer).__name__} gives no code vectors")  # fmt: skip
        return [v.to(self.device) for v in get()]

    def decode(
        self, prepared: list[Prepared], *, continual: bool = False,
        options: DecodeOptions = DecodeOptions(), row_seeds: list[int | None] | None = None,
        should_stop=None, to_audio: bool = True,
    ) -> list[torch.Tensor | Failure]:
        """One (N,) float waveform at 24 kHz per prepared unit, decoded as one batch, or a
        ``Failure`` for a unit that has none (the decoding half: ``valle.engine``)."""
        return decode_prepared(
            self.model, prepared, pad_id=self.collater.pad_id, device=self.device,
            audio_tokenizer=self.audio_tokenizer, decoder=self.decoder, options=options,
            continual=continual, code_vectors=self._code_vectors(options.nar_decoding),
            row_seeds=row_seeds, should_stop=should_stop, to_audio=to_audio,
        )  # fmt: skip

    def synthesize(
        self, items: list[Item], *, continual: bool = False,
        options: DecodeOptions = DecodeOptions(),
    ) -> list[torch.Tensor | Failure]:
        """One (N,) float waveform at 24 kHz per item, or a ``Failure`` for an item that has none."""
        prepared = [self.prepare(item, continual) for item in items]
        return self.decode(prepared, continual=continual, options=options)


def too_long_early(synth: Synthesizer, item: Item, split: bool) -> TextProblem | None:
    """A text of many sentences, counted sentence by sentence until it is over the limit:
    a 25,000-character text is refused after its first sentences, not after all of them."""
    limit = synth.text_limit.max_tokens
    # only for texts far past the limit: one near it gets its exact count in ``text_problem``
    sentences = [] if split or len(item.text) <= 2 * limit else split_sentences(item.text)
    counted = 0
    for k, sentence in enumerate(sentences if len(sentences) > 1 else [], start=1):
        counted += len(synth._said(sentence, synth.language, "text", item)[0])
        if counted > limit:
            return length_problem(counted, synth.text_limit, split, counted_sentences=(k, len(sentences)))
    return None



"""The decoding engine: prepared units (text ids, prompt codes) -> waveforms, one padded batch
at a time. ``bin/infer.py`` (``valle.infer``: a file's items in batches) and the synthesis
server (``valle.serve.batcher``: concurrent requests gathered into batches) both decode here.

What reads texts and prompts (``valle.synthesizer.Synthesizer.prepare``, the frontend) makes
``Prepared`` units; this module only decodes them. A batch may give each row its own sampling
seed (its tokens then do not depend on the rows beside it) and a stop hook (rows whose
requester left end at the next decoding step and come back as ``Abandoned``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from valle.codec.constants import NUM_AUDIO_TOKENS
from valle.models import generation
from valle.models.generation import DecodeOptions

EMPTY_REASON = ("the AR model emitted EOS as its first token: no audio (untrained checkpoint, "
                "or text/prompt mismatch)")  # fmt: skip


@dataclass
class Failure:
    """An item that produced no audio, and why (the other items of its batch still do)."""

    name: str
    reason: str


class Abandoned(Failure):
    """A row stopped by the stop hook: nobody waits for it."""


@dataclass
class Prepared:
    """One unit ready to decode (``Synthesizer.prepare``): CPU tensors, no padding.

    The boundary between the text/prompt frontend and the decoding engine: whatever reads a
    text or a prompt makes these, whatever decodes takes them.
    """

    name: str  # how messages refer to it
    text: torch.Tensor  # (S,) ids: BOS + prompt transcript + text + EOS
    prompt_text_len: int  # ids of the prompt transcript part (its word separator included)
    prompt: torch.Tensor  # (P, Q) the prompt's codes
    text_languages: torch.Tensor | None = None  # (S,) a language id per token (VALL-E X)


class PreparedBatch(NamedTuple):
    text: torch.Tensor  # (B, S) padded with the symbol table's pad id
    text_lens: torch.Tensor  # (B,)
    prompt_text_lens: torch.Tensor  # (B,)
    text_languages: torch.Tensor | None  # (B, S), each row padded with its last language
    prompt: torch.Tensor  # (B, P, Q) padded with NUM_AUDIO_TOKENS
    prompt_lens: torch.Tensor  # (B,)


def collate_prepared(prepared: list[Prepared], pad_id: int, device) -> PreparedBatch:
    """Prepared units as one padded batch on ``device``."""
    text_lens = torch.tensor([u.text.numel() for u in prepared])
    prompt_lens = torch.tensor([u.prompt.shape[0] for u in prepared])
    text = torch.full((len(prepared), int(text_lens.max())), pad_id, dtype=torch.long)
    q = prepared[0].prompt.shape[1]
    prompt = torch.full((len(prepared), int(prompt_lens.max()), q), NUM_AUDIO_TOKENS, dtype=torch.long)
    for b, unit in enumerate(prepared):
        text[b, : unit.text.numel()] = unit.text
        prompt[b, : unit.prompt.shape[0]] = unit.prompt
    languages = None
    if prepared[0].text_languages is not None:
        languages = torch.stack([
            torch.cat([u.text_languages, u.text_languages[-1:].expand(text.shape[1] - u.text.numel())])
            for u in prepared
        ])  # fmt: skip
        languages = languages.to(device)
    return PreparedBatch(
        text.to(device), text_lens.to(device),
        torch.tensor([u.prompt_text_len for u in prepared], device=device),
        languages, prompt.to(device), prompt_lens.to(device),
    )  # fmt: skip


def decode_codes(
    codes: torch.Tensor, checkpoint_config: dict[str, Any] | None, audio_tokenizer, decoder=None
) -> torch.Tensor:
    """Codes (T, Q) -> (N,) float waveform at 24 kHz: the one place codes become audio
    (``decoder``: --decoder vocos; None: the codec's own decoder). ``checkpoint_config`` is
    the checkpoint's config, so a checkpoint that records its codec can be decoded with it."""
    del checkpoint_config  # EnCodec 24 kHz for now
    if decoder is not None:  # --decoder vocos (valle/codec/vocos.py)
        return decoder.decode(codes)
    return audio_tokenizer.decode(codes.T.unsqueeze(0)).reshape(-1).float().cpu()


CODEC_BATCH_ROWS = 8  # a codec's activations are large (EnCodec: 512 channels at 24 kHz): rows per call


def codes_to_audio(codes: list[torch.Tensor], audio_tokenizer, decoder=None) -> list[torch.Tensor]:
    """Several rows' codes (T_i, Q) -> their waveforms. A causal codec (EnCodec: ``causal``)
    decodes them as right-padded batches of up to ``CODEC_BATCH_ROWS``, each row cut to its own
    frames (what comes after a frame cannot change it); any other decoder one row at a time."""
    if decoder is not None or not getattr(audio_tokenizer, "causal", False) or len(codes) < 2:
        return [decode_codes(c, None, audio_tokenizer, decoder) for c in codes]
    if len(codes) > CODEC_BATCH_ROWS:
        return [wav for start in range(0, len(codes), CODEC_BATCH_ROWS)
                for wav in codes_to_audio(codes[start : start + CODEC_BATCH_ROWS], audio_tokenizer)]  # fmt: skip
    lens = [int(c.shape[0]) for c in codes]
    batch = codes[0].new_zeros((len(codes), max(lens), codes[0].shape[1]))
    for b, c in enumerate(codes):
        batch[b, : lens[b]] = c
    wavs = audio_tokenizer.decode(batch.transpose(1, 2)).float().cpu()
    hop = audio_tokenizer.hop_length
    return [wavs[b, 0, : n * hop] for b, n in enumerate(lens)]


def decode_prepared(
    model: Any,
    prepared: list[Prepared],
    *,
    pad_id: int,
    device,
    audio_tokenizer,
    decoder=None,
    options: DecodeOptions = DecodeOptions(),
    continual: bool = False,
    code_vectors: list[torch.Tensor] | None = None,
    row_seeds: list[int | None] | None = None,
    should_stop: Callable[[], torch.Tensor | None] | None = None,
    to_audio: bool = True,
) -> list[torch.Tensor | Failure]:
    """One (N,) float waveform at 24 kHz per unit, decoded as one batch, or a ``Failure``
    (``Abandoned`` for the rows ``should_stop`` named). ``to_audio=False``: the codes (T, Q)
    instead of the waveform (``codes_to_audio`` later, e.g. on another thread).

    ``row_seeds``: each row's sampling seed (None: ``options.seed``; both None: torch's global
    RNG for every row), so a row samples the same tokens alone or in any batch.
    """
    batch = collate_prepared(prepared, pad_id, device)
    if continual:
        codes, lens = generation.continual(
            model, batch.text, batch.text_lens, batch.prompt, batch.prompt_lens,
            text_languages=batch.text_languages, code_vectors=code_vectors,
        )  # fmt: skip
    else:
        codes, lens = generation.synthesize(
            model, batch.text, batch.text_lens, batch.prompt, batch.prompt_lens,
            prompt_text_lens=batch.prompt_text_lens, text_languages=batch.text_languages,
            options=dataclasses.replace(options, on_empty="mark"),
            code_vectors=code_vectors, row_seeds=_seeds(row_seeds, options, len(prepared)),
            should_stop=should_stop,
        )  # fmt: skip
    gone = should_stop() if should_stop is not None else None
    out: list[torch.Tensor | Failure] = [Failure(u.name, EMPTY_REASON) for u in prepared]
    rows = []
    for b, unit in enumerate(prepared):
        if gone is not None and bool(gone[b]):
            out[b] = Abandoned(unit.name, "abandoned: its requester left")
        elif int(lens[b]) > 0:
            rows.append(b)
    kept = [codes[b, : int(lens[b])] for b in rows]
    for b, wav in zip(rows, codes_to_audio(kept, audio_tokenizer, decoder) if to_audio else kept):
        out[b] = wav
    return out


def _seeds(row_seeds: list[int | None] | None, options: DecodeOptions, n: int) -> torch.Tensor | None:
    """(B,) seeds for ``generation.synthesize``, or None for its single-seed behaviour."""
    seeds = [options.seed if s is None else s for s in (row_seeds or [None] * n)]
    if all(s is None for s in seeds):
        return None
    # a row without a seed draws one from torch's global RNG (unseeded, as without row seeds)
    return torch.tensor([int(torch.randint(0, 2**62, ())) if s is None else int(s) for s in seeds])

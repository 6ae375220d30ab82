"""Sequence layouts: how codes, prompts and text are laid out in the AR and NAR inputs.

Pure tensor functions (no parameters): the training losses and the decoders in
``generation.py`` build their rows here, so both read the same layout. Padding is handled
by per-row lengths and masks, never by per-row Python loops.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from valle.codec.constants import NUM_AUDIO_TOKENS  # the audio pad id and the AR EOS id

from .rng import randint_per_row, row_uniforms

MAX_PROMPT_FRAMES = 225  # 3 s at 75 Hz: cap on the training prefix, as in VALL-E recipes
IGNORE = -100  # target id the cross entropy skips

# Random streams drawn per row from sample_seeds (distinct streams are independent).
STREAM_NAR_STAGE = 0
STREAM_PREFIX_LEN = 1
STREAM_PREFIX_START = 2


class PrefixMode(IntEnum):
    """What the NAR is given as its prompt in training (--prefix-mode; the values are the
    flag's and the checkpoints' ints, as in lifeiteng/vall-e)."""

    NONE = 0  # no prompt: codebooks below the stage only
    UTTERANCE_PREFIX = 1  # a prefix of the same utterance, [len/4, len/2) frames, <= 3 s
    RANDOM_SEGMENT = 2  # a random segment of the utterance, placed in front
    OTHER_UTTERANCE = 4  # a neighbouring utterance of the same speaker (prompt_features)

    @classmethod
    def parse(cls, value: object) -> PrefixMode:
        """From a flag or checkpoint value (int, numeric str or name); ValueError otherwise."""
        try:
            if isinstance(value, str) and not value.strip().lstrip("-").isdigit():
                return cls[value.strip().upper()]
            return cls(int(value))  # type: ignore[arg-type]
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"--prefix-mode must be 0, 1, 2 or 4, got {value!r}") from None

    @property
    def text_to_say_only(self) -> bool:
        """Modes whose NAR was trained on the target's text alone (no prompt transcript)."""
        return self in (PrefixMode.RANDOM_SEGMENT, PrefixMode.OTHER_UTTERANCE)


def language_ids(text: torch.Tensor, languages: torch.Tensor | None,
                 num_languages: int) -> torch.Tensor | None:
    """Per-token language ids (B, S) from (B,) or (B, S); None for a model without them
    (``num_languages`` 0)."""
    if num_languages == 0:
        if languages is not None:
            raise ValueError("text_languages given to a model built with --num-languages 0")
        return None
    if languages is None:
        raise ValueError(
            f"this model has --num-languages {num_languages}: pass text_languages "
            "(the language id of each row, or of each text token)"
        )
    languages = languages.to(device=text.device, dtype=torch.long)
    if languages.dim() == 1:
        languages = languages[:, None].expand(-1, text.shape[1])
    if languages.shape != text.shape:
        raise ValueError(
            f"text_languages {tuple(languages.shape)} must be (B,) or like the text {tuple(text.shape)}"
        )
    if int(languages.min()) < 0 or int(languages.max()) >= num_languages:
        raise ValueError(
            f"language ids must be in [0, {num_languages}), got {languages.unique().tolist()}"
        )
    return languages


def classes_to_ids(logits: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """AR logits over K codes + EOS laid out by id, as decoding reads them: 1025 wide,
    EOS at 1024, codes K..1023 at -inf."""
    k = codebook_size
    if k == NUM_AUDIO_TOKENS:
        return logits
    full = logits.new_full((*logits.shape[:-1], NUM_AUDIO_TOKENS + 1), float("-inf"))
    full[..., :k] = logits[..., :k]
    full[..., NUM_AUDIO_TOKENS] = logits[..., k]
    return full


def check_training_inputs(text: torch.Tensor, audio: torch.Tensor, num_quantizers: int) -> None:
    """Text (B, S) and audio codes (B, T, Q) with at least the model's Q codebooks."""
    if text.dim() != 2 or audio.dim() != 3:
        raise ValueError(
            f"expected text (B, S) and audio (B, T, Q), got {tuple(text.shape)} and {tuple(audio.shape)}"
        )
    if audio.shape[-1] < num_quantizers:
        raise ValueError(f"audio has {audio.shape[-1]} codebooks, the model needs {num_quantizers}")


def lengths_to_valid(lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """(B, max_len) bool: column < the row's length."""
    return torch.arange(max_len, device=lens.device)[None, :] < lens[:, None]


def pack_sequences(
    a: torch.Tensor, a_lens: torch.Tensor, b: torch.Tensor, b_lens: torch.Tensor, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise concatenation a[:a_len] ++ b[:b_len] of (B, L, Q) code tensors, padded with ``pad``."""
    lens = a_lens + b_lens
    total = int(lens.max()) if lens.numel() else 0
    bsz, _, q = b.shape
    cols = torch.arange(total, device=b.device)[None, :].expand(bsz, total)
    ib = (cols - a_lens[:, None]).clamp(0, max(b.shape[1] - 1, 0))
    out = (
        b.gather(1, ib[..., None].expand(-1, -1, q))
        if b.shape[1]
        else b.new_full((bsz, total, q), pad)
    )
    if a.shape[1]:
        ia = cols.clamp(max=a.shape[1] - 1)
        from_a = cols < a_lens[:, None]
        out = torch.where(from_a[..., None], a.gather(1, ia[..., None].expand(-1, -1, q)), out)
    return out.masked_fill(~(cols < lens[:, None])[..., None], pad), lens


# ------------------------------------------------------------------------ AR
def ar_group_layout(
    codes0: torch.Tensor, audio_lens: torch.Tensor, group_size: int, prepend_bos: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced AR rows in groups of G frames: inputs (B, L, G), targets (B, L, G)
    (IGNORE after each row's EOS), valid input groups per row (B,); (B, L) when G = 1.

    The frames and then EOS, cut into groups: input group i predicts group i + 1. The
    first group is given (by the prompt at inference), as frame 0 is when G = 1; with
    --prepend-bos a group of BOS comes first and every group is predicted.
    """
    g, eos = group_size, NUM_AUDIO_TOKENS
    bsz, t_max = codes0.shape
    n_groups = -(-(t_max + 1) // g)  # frames + EOS, rounded up to whole groups
    y = codes0.masked_fill(~lengths_to_valid(audio_lens, t_max), eos)
    y = torch.cat([y, y.new_full((bsz, n_groups * g - t_max), eos)], dim=1)
    frame = torch.arange(n_groups * g, device=y.device)[None, :]
    beyond_eos = frame > audio_lens[:, None]  # the EOS itself (frame T) is a target
    groups = y.view(bsz, n_groups, g)
    targets = y.masked_fill(beyond_eos, IGNORE).view(bsz, n_groups, g)
    n_in = torch.div(audio_lens, g, rounding_mode="floor")
    if prepend_bos:
        inputs = torch.cat([groups.new_full((bsz, 1, g), eos + 1), groups[:, :-1]], dim=1)
        n_in = n_in + 1
    else:
        inputs, targets = groups[:, :-1], targets[:, 1:]
    if g == 1:  # one frame per position: the plain (B, L) layout
        return inputs[..., 0], targets[..., 0], n_in
    return inputs, targets, n_in


def ar_prompt_layout(
    prompt0: torch.Tensor, prompt_lens: torch.Tensor, group_size: int, prepend_bos: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The AR's prompt input: tokens (B, W) or groups (B, W, G), positions (B, W), valid
    columns (B, W), valid groups per row (B,).

    Rows are right-aligned, so every row's last prompt group is the last column: one
    shared column for the next group, per-row positions stay exact. With G > 1 a row
    keeps its last whole groups (its first ``len % G`` frames are dropped); with
    --prepend-bos a BOS group goes first, as in training.
    """
    g, eos, device = group_size, NUM_AUDIO_TOKENS, prompt0.device
    bsz, bos = prompt0.shape[0], int(prepend_bos)
    n_groups = torch.div(prompt_lens, g, rounding_mode="floor") + bos
    if int(n_groups.min()) < 1:
        raise ValueError(
            f"AR decoding needs at least {g} prompt frame(s) per row (or --prepend-bos true)"
        )
    width = int(n_groups.max())
    col = torch.arange(width * g, device=device)[None, :]
    j = col - (width - n_groups)[:, None] * g  # index into the row's [BOS group; groups]
    skip = (prompt_lens % g)[:, None]  # leading frames that do not fill a group
    src = (skip + j - bos * g).clamp(min=0, max=max(prompt0.shape[1] - 1, 0))
    frames = prompt0.gather(1, src) if prompt0.shape[1] else prompt0.new_full(src.shape, eos)
    frames = torch.where(j < bos * g, eos + 1, frames).masked_fill(j < 0, eos)
    group_col = torch.arange(width, device=device)[None, :]
    positions = group_col - (width - n_groups)[:, None]
    valid = positions >= 0
    tokens = frames.view(bsz, width, g) if g > 1 else frames
    return tokens, positions.clamp(min=0), valid, n_groups


# ----------------------------------------------------------------------- NAR
def nar_layout(
    codes: torch.Tensor,
    audio_lens: torch.Tensor,
    sample_seeds: torch.Tensor | None,
    prompt: torch.Tensor | None,
    prompt_lens: torch.Tensor | None,
    prefix_mode: PrefixMode,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row NAR training input: packed codes, prompt length, valid length, loss mask."""
    bsz, t_max, _ = codes.shape
    device = codes.device
    valid = lengths_to_valid(audio_lens, t_max)
    if prefix_mode == PrefixMode.NONE:
        return codes, torch.zeros_like(audio_lens), audio_lens, valid
    # Drawn in every prompted mode: without seeds it comes from torch's global RNG, whose
    # sequence the later draws of a plain training run depend on.
    u = row_uniforms(sample_seeds, bsz, STREAM_PREFIX_LEN, device)
    if prefix_mode == PrefixMode.UTTERANCE_PREFIX:
        # Prefix of the same utterance, length in [len/4, len/2), at most 3 s.
        quarter = audio_lens // 4
        p = randint_per_row(u, quarter, 2 * quarter).clamp(max=MAX_PROMPT_FRAMES)
        cols = torch.arange(t_max, device=device)[None, :]
        return codes, p, audio_lens, valid & (cols >= p[:, None])
    start = None
    if prefix_mode == PrefixMode.RANDOM_SEGMENT:
        # A random segment of the utterance, placed in front as the prompt; its own
        # frames are not predicted (the model would copy them).
        p = (audio_lens // 4).clamp(max=MAX_PROMPT_FRAMES)
        start = randint_per_row(
            row_uniforms(sample_seeds, bsz, STREAM_PREFIX_START, device), 0, audio_lens - p + 1
        )
        seg_len = max(int(p.max()), 1)
        idx = (start[:, None] + torch.arange(seg_len, device=device)).clamp(max=t_max - 1)
        prompt = codes.gather(1, idx[..., None].expand(-1, -1, codes.shape[2]))
    else:  # OTHER_UTTERANCE
        if prompt is None or prompt_lens is None:
            raise ValueError("--prefix-mode 4 needs prompt_features and prompt_features_lens")
        p = prompt_lens.to(audio_lens.dtype)
        prompt = prompt[..., : codes.shape[2]]
    packed, lens = pack_sequences(prompt, p, codes, audio_lens, NUM_AUDIO_TOKENS)
    cols = torch.arange(packed.shape[1], device=device)[None, :]
    target = (cols >= p[:, None]) & (cols < lens[:, None])
    if start is not None:
        t = cols - p[:, None]
        target &= (t < start[:, None]) | (t >= start[:, None] + p[:, None])
    return packed, p, lens, target


def nar_text(
    text: torch.Tensor,
    text_lens: torch.Tensor,
    prompt_text_lens: torch.Tensor | None,
    prefix_mode: PrefixMode,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The NAR's text at inference: all of it, or (prefix modes 2, 4) BOS + the text after
    the prompt's transcript (the ``prompt_text_lens`` tokens after BOS)."""
    if not prefix_mode.text_to_say_only:
        return text, text_lens
    if prompt_text_lens is None:
        raise ValueError(
            f"--prefix-mode {int(prefix_mode)} needs prompt_text_lens at inference: its NAR "
            "was trained on the target text alone"
        )
    ptl = prompt_text_lens.to(device=text.device, dtype=torch.long)
    if bool((ptl < 0).any()) or bool((ptl + 2 > text_lens).any()):
        raise ValueError(
            f"prompt_text_lens {ptl.tolist()} do not fit text lengths {text_lens.tolist()}"
        )
    lens = text_lens - ptl
    cols = torch.arange(text.shape[1], device=text.device)[None, :]
    src = torch.where(cols == 0, cols, cols + ptl[:, None]).clamp(max=text.shape[1] - 1)
    out = text.gather(1, src)
    out = torch.where(cols < lens[:, None], out, text[:, -1:].expand_as(out))
    return out[:, : int(lens.max())], lens


def generated_frames(
    packed: torch.Tensor, prompt_lens: torch.Tensor, gen_lens: torch.Tensor, width: int
) -> torch.Tensor:
    """The frames after each row's prompt, (B, width, Q), padded with NUM_AUDIO_TOKENS."""
    idx = (prompt_lens[:, None] + torch.arange(width, device=packed.device)).clamp(
        max=packed.shape[1] - 1
    )
    out = packed.gather(1, idx[..., None].expand(-1, -1, packed.shape[2]))
    return out.masked_fill(~lengths_to_valid(gen_lens, width)[..., None], NUM_AUDIO_TOKENS)

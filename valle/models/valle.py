"""VALL-E (decoder-only) and VALL-F (text as cross-attention memory).

Both have two halves with separate parameters (``ar_*`` and ``nar_*``):

* AR: predicts codebook 0 frame by frame from the text, EOS id ``NUM_AUDIO_TOKENS``.
* NAR: predicts codebook j (1..Q-1) of every frame at once from the text and the sum
  of the embeddings of codebooks < j, conditioned on j through adaptive layer norm.

Training draws, per row, the NAR stage j and the prompt/prefix length from that
row's ``sample_seeds`` entry (see ``rng.py``), so any split of a batch gives the same
per-row values. Layout of a batch: text padded to S columns, then audio; padding is
handled by key masks and per-row positions, never by per-row Python loops.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .embedding import AudioPrenet, SinePositionalEncoding, TextPrenet
from .rng import randint_per_row, row_uniforms
from .sampling import nearest_to_expectation, sample
from .transformer import (
    AttentionProbe,
    LayerCache,
    TransformerStack,
    key_padding_mask,
    prefix_causal_mask,
)

NUM_AUDIO_TOKENS = 1024  # EnCodec codebook size; also the audio pad id and the AR EOS id
MAX_PROMPT_FRAMES = 225  # 3 s at 75 Hz: cap on the training prefix, as in VALL-E recipes
IGNORE = -100

# Random streams drawn per row from sample_seeds (distinct streams are independent).
STREAM_NAR_STAGE = 0
STREAM_PREFIX_LEN = 1
STREAM_PREFIX_START = 2

NAR_HEAD_TIES = ("lifeiteng", "same")
POSITION_LAYOUTS = ("interleaved", "concatenated")
NAR_POSITION_SCALES = ("fixed", "learned")
STOP_RULES = ("argmax_or_sampled", "sampled")
# Best-of-N: subtracted from the mean log-likelihood of a candidate that ran to the length cap,
# so that it ranks below every candidate that stopped (log-likelihoods per frame are far smaller).
CAPPED_CANDIDATE_PENALTY = 1e4


def _lengths_to_valid(lens: torch.Tensor, max_len: int) -> torch.Tensor:
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


class GuidedAttention:
    """Guided attention loss (Tachibana et al. 2017, DC-TTS; ESPnet's guided multi-head
    form): the AR's attention from audio frame t to text token s is penalised by
    ``1 - exp(-(s/S - t/T)^2 / (2 sigma^2))``, zero on the diagonal of the (T, S) grid of
    each row's own lengths. Text and speech advance together, so this only tells the model
    where to look sooner: a decoder-only AR otherwise discovers the alignment from data
    alone, which a small corpus or a short budget may not give it (docs/training.md).

    Applied to the first ``heads`` heads of the last ``layers`` layers (the others stay
    free), in training only; inference is unchanged. Summed over audio frames like the
    cross entropy it is added to, averaged over the guided heads, times ``weight``.
    """

    def __init__(self, weight: float, sigma: float, heads: int, layers: int):
        self.weight, self.sigma, self.heads = weight, sigma, heads
        self.layers = layers if weight > 0 else 0

    def penalty_grid(self, text_valid: torch.Tensor, audio_valid: torch.Tensor) -> torch.Tensor:
        """(B, T, S) penalty, zero at padded text keys and padded audio queries."""
        s_len = text_valid.sum(1, keepdim=True).clamp(min=1).float()
        t_len = audio_valid.sum(1, keepdim=True).clamp(min=1).float()
        s_pos = torch.arange(text_valid.shape[1], device=text_valid.device)[None, :] / s_len
        t_pos = torch.arange(audio_valid.shape[1], device=audio_valid.device)[None, :] / t_len
        dist = s_pos[:, None, :] - t_pos[:, :, None]
        grid = 1.0 - torch.exp(-dist.square() / (2 * self.sigma**2))
        return grid * (audio_valid[:, :, None] & text_valid[:, None, :])

    def loss(
        self, scores: list[torch.Tensor], text_valid: torch.Tensor, audio_valid: torch.Tensor
    ) -> torch.Tensor:
        """``scores``: per probed layer, (B, H, T, S) attention scores of audio frames on the
        text. The penalty is taken on each head's attention renormalised over the text: on
        the full softmax a decoder-only head escapes it by looking at past audio instead
        (measured: guided heads' text mass fell to 0.01 and nothing aligned)."""
        grid = self.penalty_grid(text_valid, audio_valid)[:, None]
        total = sum((s[:, : self.heads].softmax(dim=-1) * grid).sum() for s in scores)
        return self.weight * total / (self.heads * len(scores))


class _VALLEBase(nn.Module):
    """Everything VALL-E and VALL-F share; subclasses say how text and audio meet."""

    cross_attention = False

    def __init__(
        self,
        *,
        decoder_dim: int = 1024,
        nhead: int = 16,
        num_decoder_layers: int = 12,
        scale_factor: float = 1.0,
        norm_first: bool = True,
        add_prenet: bool = False,
        prefix_mode: int = 1,
        share_embedding: bool = True,
        prepend_bos: bool = False,
        num_quantizers: int = 8,
        num_text_tokens: int = 512,
        dropout: float = 0.1,
        model_name: str = "valle",
        tie_ar_head: bool = False,
        nar_head_tie: str = "lifeiteng",
        positions: str = "interleaved",
        nar_position_scale: str = "fixed",
        num_languages: int = 0,
        guided_attention_weight: float = 0.0,
        guided_attention_sigma: float = 0.2,
        guided_attention_heads: int = 2,
        guided_attention_layers: int = 2,
        paired_prompts: bool = False,
        ar_codebook_size: int = NUM_AUDIO_TOKENS,
        ar_group_size: int = 1,
    ):
        super().__init__()
        if prefix_mode not in (0, 1, 2, 4):
            raise ValueError(f"--prefix-mode must be 0, 1, 2 or 4, got {prefix_mode}")
        if paired_prompts and prefix_mode != 1:
            raise ValueError(
                f"--paired-prompts needs --prefix-mode 1, got {prefix_mode}: the paired row's text "
                "holds the prompt's transcript, which the NAR of modes 0, 2 and 4 is not given at "
                "inference"
            )
        # Training rows are [same-speaker utterance; target] with the loss on the target
        # (docs/training.md "Paired prompts"); a training setting, not architecture.
        self.paired_prompts = paired_prompts
        if num_quantizers < 1:
            raise ValueError(f"--num-quantizers must be >= 1, got {num_quantizers}")
        for flag, value, choices in (
            ("--nar-head-tie", nar_head_tie, NAR_HEAD_TIES),
            ("--positions", positions, POSITION_LAYOUTS),
            ("--nar-position-scale", nar_position_scale, NAR_POSITION_SCALES),
        ):
            if value not in choices:
                raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        self.hparams: dict[str, Any] = dict(
            model_name=model_name, decoder_dim=decoder_dim, nhead=nhead,
            num_decoder_layers=num_decoder_layers, scale_factor=scale_factor,
            norm_first=norm_first, add_prenet=add_prenet, prefix_mode=prefix_mode,
            share_embedding=share_embedding, prepend_bos=prepend_bos,
            num_quantizers=num_quantizers, num_text_tokens=num_text_tokens, dropout=dropout,
            tie_ar_head=tie_ar_head, nar_head_tie=nar_head_tie, positions=positions,
            nar_position_scale=nar_position_scale, num_languages=num_languages,
            guided_attention_weight=guided_attention_weight,
            guided_attention_sigma=guided_attention_sigma,
            guided_attention_heads=guided_attention_heads,
            guided_attention_layers=guided_attention_layers, paired_prompts=paired_prompts,
            ar_codebook_size=ar_codebook_size, ar_group_size=ar_group_size,
        )  # fmt: skip
        self.prefix_mode, self.num_quantizers = prefix_mode, num_quantizers
        self.share_embedding, self.prepend_bos = share_embedding, prepend_bos
        self.num_text_tokens = num_text_tokens
        if num_languages < 0:
            raise ValueError(f"--num-languages must be >= 0, got {num_languages}")
        self.num_languages = num_languages
        if guided_attention_weight < 0 or guided_attention_sigma <= 0:
            raise ValueError(
                "--guided-attention-weight must be >= 0 and --guided-attention-sigma > 0, got "
                f"{guided_attention_weight} and {guided_attention_sigma}"
            )
        if guided_attention_weight and (guided_attention_heads < 1 or guided_attention_layers < 1):
            raise ValueError(
                "--guided-attention-heads and --guided-attention-layers must be >= 1, got "
                f"{guided_attention_heads} and {guided_attention_layers}"
            )
        # AR training only: heads x layers whose attention to the text is pulled to the diagonal.
        self.guided = GuidedAttention(
            guided_attention_weight, guided_attention_sigma,
            min(guided_attention_heads, nhead), min(guided_attention_layers, num_decoder_layers),
        )  # fmt: skip
        d = decoder_dim
        nar_d = int(decoder_dim * scale_factor)
        nar_heads = max(1, int(nhead * scale_factor))
        nar_layers = max(1, int(num_decoder_layers * scale_factor))
        self.ar_dim, self.nar_dim = d, nar_d
        # Entered around the NAR forward only: the trainer sets it to hold its NAR
        # backward reserve there (valle.train.resilience.memory.BackwardReserve).
        self.nar_forward_context = nullcontext
        vocab = NUM_AUDIO_TOKENS
        if not 1 <= ar_codebook_size <= NUM_AUDIO_TOKENS:
            raise ValueError(
                f"--ar-codebook-size must be in [1, {NUM_AUDIO_TOKENS}], got {ar_codebook_size}"
            )
        # Codebook 0's codes are 0..K-1. The AR's classes are those K codes and EOS (class K;
        # BOS is row K+1 of the input table): a codec whose first codebook is small (the demo's
        # mel-rvq, 128 codes) then costs a K+1-wide head, not 1025 (docs/inference.md). Outside
        # the AR, EOS and padding stay id 1024 (_ar_classes maps them in).
        self.ar_codebook_size = ar_codebook_size
        if ar_group_size < 1:
            raise ValueError(f"--ar-group-size must be >= 1, got {ar_group_size}")
        if ar_group_size > 1 and paired_prompts:
            raise ValueError("--paired-prompts needs --ar-group-size 1 (the paired row's prompt "
                             "and target would have to start on group boundaries)")
        # VALL-E 2's grouped code modeling: each AR position reads and predicts G consecutive
        # frames of codebook 0, so the AR's audio sequence is G times shorter (a cheaper
        # step and G frames per decoding step). Each slot has its own input table (their
        # embeddings are summed: a linear map of the G one-hot codes) and its own K+1 outputs.
        self.ar_group_size = ar_group_size
        self._ar_rows = ar_codebook_size + 1 + int(prepend_bos)  # rows of one slot's table

        # --- AR: text + codebook 0 (+ EOS, + BOS when prepended) ---
        self.ar_text_embedding = nn.Embedding(num_text_tokens, d)
        # VALL-E X: a language-ID embedding added to every text token (its language).
        self.ar_language_embedding = nn.Embedding(num_languages, d) if num_languages else None
        self.ar_audio_embedding = nn.Embedding(ar_group_size * self._ar_rows, d)
        self.ar_text_prenet = TextPrenet(d, dropout) if add_prenet else None
        self.ar_audio_prenet = AudioPrenet(d, dropout) if add_prenet else None
        interleaved = positions == "interleaved"
        self.ar_text_position = SinePositionalEncoding(d, dropout, interleaved)
        self.ar_audio_position = SinePositionalEncoding(d, dropout, interleaved)
        self.ar_decoder = TransformerStack(
            num_decoder_layers, d, nhead, dropout, norm_first, cross=self.cross_attention
        )
        # lifeiteng keeps the AR head untied even under --share-embedding (tying hurt its
        # accuracy); --tie-ar-head ties it to the audio embedding rows 0..K (EOS included).
        self.tie_ar_head = tie_ar_head
        self.ar_predict_layer = (
            None if tie_ar_head else nn.Linear(d, ar_group_size * (ar_codebook_size + 1), bias=False)
        )

        # --- NAR: codebooks 1..Q-1 ---
        if num_quantizers > 1:
            self.nar_text_embedding = nn.Embedding(num_text_tokens, nar_d)
            self.nar_language_embedding = (
                nn.Embedding(num_languages, nar_d) if num_languages else None
            )
            # One table per codebook, stacked so all Q lookups are one embedding call;
            # row 1024 (pad) exists so padded frames index safely (they are masked out).
            self.nar_audio_embedding = nn.Parameter(torch.randn(num_quantizers, vocab + 1, nar_d))
            # As in lifeiteng: no dropout on the NAR text positions; alpha fixed unless
            # --nar-position-scale learned.
            learned = nar_position_scale == "learned"
            self.nar_text_position = SinePositionalEncoding(nar_d, 0.0, interleaved, learned)
            self.nar_audio_position = SinePositionalEncoding(nar_d, dropout, interleaved, learned)
            self.nar_stage_embedding = nn.Embedding(num_quantizers - 1, nar_d)
            self.nar_decoder = TransformerStack(
                nar_layers, nar_d, nar_heads, dropout, norm_first, adaptive=True,
                cross=self.cross_attention,
            )  # fmt: skip
            # Output heads, gathered per row (see _nar_head). Untied: one stacked table.
            # Tied (--share-embedding), lifeiteng's layout: the head of stage j is the
            # embedding table of codebook j+1 and the last stage has its own head;
            # --nar-head-tie same: the head of stage j is codebook j's table (what it predicts).
            self.nar_head_tie = nar_head_tie if share_embedding else "none"
            self.nar_predict_weight = self.nar_predict_last = None
            if not share_embedding:
                self.nar_predict_weight = nn.Parameter(
                    torch.randn(num_quantizers - 1, vocab, nar_d) * nar_d**-0.5
                )
            elif nar_head_tie == "lifeiteng":
                self.nar_predict_last = nn.Parameter(torch.randn(vocab, nar_d) * nar_d**-0.5)

    # ------------------------------------------------------------------ params
    def stage_parameters(self, train_stage: int) -> list[tuple[str, nn.Parameter]]:
        """Parameters trained in ``train_stage``: 0 all, 1 the ``ar_*`` ones, 2 the ``nar_*`` ones.

        The AR and NAR halves share nothing (each has its own text embedding), so
        stage 1 and 2 partition the parameters, as in lifeiteng/vall-e.
        """
        if train_stage not in (0, 1, 2):
            raise ValueError(f"train_stage must be 0, 1 or 2, got {train_stage}")
        named = list(self.named_parameters())
        if train_stage == 0:
            return named
        prefix = "ar_" if train_stage == 1 else "nar_"
        return [(n, p) for n, p in named if n.startswith(prefix)]

    # --------------------------------------------------------------- embedding
    def _languages(self, text: torch.Tensor, languages: torch.Tensor | None) -> torch.Tensor | None:
        """Per-token language ids (B, S) from (B,) or (B, S); None for a model without them."""
        if self.num_languages == 0:
            if languages is not None:
                raise ValueError("text_languages given to a model built with --num-languages 0")
            return None
        if languages is None:
            raise ValueError(
                f"this model has --num-languages {self.num_languages}: pass text_languages "
                "(the language id of each row, or of each text token)"
            )
        languages = languages.to(device=text.device, dtype=torch.long)
        if languages.dim() == 1:
            languages = languages[:, None].expand(-1, text.shape[1])
        if languages.shape != text.shape:
            raise ValueError(
                f"text_languages {tuple(languages.shape)} must be (B,) or like the text {tuple(text.shape)}"
            )
        if int(languages.min()) < 0 or int(languages.max()) >= self.num_languages:
            raise ValueError(
                f"language ids must be in [0, {self.num_languages}), got {languages.unique().tolist()}"
            )
        return languages

    def _ar_embed_text(
        self, text: torch.Tensor, text_valid: torch.Tensor, languages: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.ar_text_embedding(text)
        if self.ar_language_embedding is not None and languages is not None:
            x = x + self.ar_language_embedding(languages)
        if self.ar_text_prenet is not None:
            x = self.ar_text_prenet(x, text_valid)
        pos = torch.arange(text.shape[1], device=text.device)
        return self.ar_text_position(x, pos)

    def _ar_classes(self, ids: torch.Tensor) -> torch.Tensor:
        """Codebook-0 ids (codes, EOS/pad 1024, BOS 1025) -> the AR's rows/classes."""
        shift = NUM_AUDIO_TOKENS - self.ar_codebook_size
        return ids if shift == 0 else torch.where(ids >= NUM_AUDIO_TOKENS, ids - shift, ids)

    def _ar_embed_audio(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens (B, L), or (B, L, G) groups of codebook-0 ids, -> (B, L, D)."""
        g = self.ar_group_size
        if tokens.dim() == 2 and g == 1:
            y = self.ar_audio_embedding(self._ar_classes(tokens))
        else:
            if tokens.shape[-1] != g:
                raise ValueError(f"expected groups of {g} codes, got {tuple(tokens.shape)}")
            slot_offsets = torch.arange(g, device=tokens.device) * self._ar_rows
            y = self.ar_audio_embedding(self._ar_classes(tokens) + slot_offsets).sum(dim=-2)
        if self.ar_audio_prenet is not None:
            y = self.ar_audio_prenet(y)
        return self.ar_audio_position(y, positions)

    def _ar_logits(self, h: torch.Tensor, by_id: bool = True) -> torch.Tensor:
        """Logits over the AR's K+1 classes, (..., K+1), or (..., G, K+1) per slot of a
        group; ``by_id``: laid out by id (1025 wide, EOS at 1024, codes K..1023 at -inf)
        as decoding reads them. Training takes the classes."""
        k, g = self.ar_codebook_size, self.ar_group_size
        if self.ar_predict_layer is not None:
            logits = self.ar_predict_layer(h)
        else:
            # Scale keeps tied logits O(1) at init (embeddings are N(0, 1)). Slot j's head
            # is its own table's rows 0..K (codes and EOS).
            weight = self.ar_audio_embedding.weight.view(g, self._ar_rows, -1)[:, : k + 1]
            logits = F.linear(h * self.ar_dim**-0.5, weight.reshape(g * (k + 1), -1))
        if g > 1:
            logits = logits.unflatten(-1, (g, k + 1))
        if not by_id or k == NUM_AUDIO_TOKENS:
            return logits
        full = logits.new_full((*logits.shape[:-1], NUM_AUDIO_TOKENS + 1), float("-inf"))
        full[..., :k] = logits[..., :k]
        full[..., NUM_AUDIO_TOKENS] = logits[..., k]
        return full

    def _nar_embed_text(
        self, text: torch.Tensor, languages: torch.Tensor | None = None
    ) -> torch.Tensor:
        pos = torch.arange(text.shape[1], device=text.device)
        x = self.nar_text_embedding(text)
        if self.nar_language_embedding is not None and languages is not None:
            x = x + self.nar_language_embedding(languages)
        return self.nar_text_position(x, pos)

    def _nar_embed_audio(self, codes: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
        """Sum over codebooks k of E_k(codes[..., k]) where ``use[b, t, k]``.

        codes (B, T, Q) with pad 1024 allowed; use (B, T, Q) bool. One gather from the
        stacked table, then a weighted sum over Q: per-row stages, no loops.
        """
        q = codes.shape[-1]
        table = self.nar_audio_embedding
        offsets = torch.arange(q, device=codes.device) * table.shape[1]
        emb = F.embedding(codes + offsets, table.reshape(-1, table.shape[-1]))  # (B, T, Q, D)
        y = torch.einsum("btqd,btq->btd", emb, use.to(emb.dtype))
        pos = torch.arange(codes.shape[1], device=codes.device)
        return self.nar_audio_position(y, pos)

    def _nar_head(self, h: torch.Tensor, stage: torch.Tensor) -> torch.Tensor:
        """Per-row output head: logits (B, T, 1024) of stage ``stage[b]`` for row b."""
        table = self.nar_audio_embedding
        if self.nar_predict_weight is not None:
            weight = self.nar_predict_weight[stage - 1]
        elif self.nar_head_tie == "same":
            weight = table[stage, :NUM_AUDIO_TOKENS] * self.nar_dim**-0.5
        else:  # lifeiteng: stage j -> table j+1 (unscaled); the last stage has its own head
            last = stage == self.num_quantizers - 1
            tied = table[(stage + 1).clamp(max=self.num_quantizers - 1), :NUM_AUDIO_TOKENS]
            weight = torch.where(last[:, None, None], self.nar_predict_last, tied)
        return torch.bmm(h, weight.transpose(1, 2).to(h.dtype))

    # ----------------------------------------------- architecture-specific cores
    def _ar_core(
        self, x, text_valid, y, audio_valid, caches=None, probe=None, probe_last=0
    ):  # pragma: no cover
        """AR decoder output over the audio columns. ``probe`` (an AttentionProbe; its rows
        and columns are set here) receives the audio-to-text attention scores
        (B, probe.heads, T, S) of the last ``probe_last`` layers."""
        raise NotImplementedError

    def _ar_core_step(self, y, text_valid, audio_valid, caches):  # pragma: no cover
        raise NotImplementedError

    def _nar_core(self, x, text_valid, y, audio_valid, cond):  # pragma: no cover
        raise NotImplementedError

    # ---------------------------------------------------------------- training
    def forward(
        self,
        text_tokens: torch.Tensor,
        text_tokens_lens: torch.Tensor,
        audio_features: torch.Tensor,
        audio_features_lens: torch.Tensor,
        *,
        train_stage: int = 0,
        sample_seeds: torch.Tensor | None = None,
        prompt_features: torch.Tensor | None = None,
        prompt_features_lens: torch.Tensor | None = None,
        text_languages: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed cross entropy (AR + NAR) and detached sum metrics for this batch.

        ``text_languages``: language ids (B,) or (B, S), required when --num-languages > 0.
        """
        if train_stage not in (0, 1, 2):
            raise ValueError(f"train_stage must be 0, 1 or 2, got {train_stage}")
        self._check_inputs(text_tokens, text_tokens_lens, audio_features, audio_features_lens)
        device = audio_features.device
        zero = torch.zeros((), device=device)
        loss = zero
        metrics = {k: zero for k in ("ar_loss", "nar_loss", "ar_top10_correct", "ar_frames",
                                     "nar_top10_correct", "nar_frames")}  # fmt: skip
        text_valid = _lengths_to_valid(text_tokens_lens, text_tokens.shape[1])
        langs = self._languages(text_tokens, text_languages)
        if self.paired_prompts and (prompt_features is None or prompt_features_lens is None):
            raise ValueError("--paired-prompts needs prompt_features and prompt_features_lens "
                             "(the data module's paired rows)")
        if train_stage in (0, 1):
            pair = (prompt_features[..., 0], prompt_features_lens) if self.paired_prompts else None
            ar_loss, correct, frames, guided = self._ar_loss(
                text_tokens, text_valid, audio_features[..., 0], audio_features_lens, langs, pair
            )
            # The ar_loss metric stays the cross entropy; the guided term only steers training.
            loss = loss + ar_loss + (guided if guided is not None else 0.0)
            metrics.update(ar_loss=ar_loss.detach(), ar_top10_correct=correct, ar_frames=frames)
        if train_stage in (0, 2) and self.num_quantizers > 1:
            with self.nar_forward_context():
                nar_loss, correct, frames = self._nar_loss(
                    text_tokens, text_valid, audio_features, audio_features_lens,
                    sample_seeds, prompt_features, prompt_features_lens, langs,
                )  # fmt: skip
            loss = loss + nar_loss
            metrics.update(nar_loss=nar_loss.detach(), nar_top10_correct=correct, nar_frames=frames)
        return loss, metrics

    def _check_inputs(self, text, text_lens, audio, audio_lens) -> None:
        if text.dim() != 2 or audio.dim() != 3:
            raise ValueError(
                f"expected text (B, S) and audio (B, T, Q), got {tuple(text.shape)} and {tuple(audio.shape)}"
            )
        if audio.shape[-1] < self.num_quantizers:
            raise ValueError(
                f"audio has {audio.shape[-1]} codebooks, the model needs {self.num_quantizers}"
            )

    @staticmethod
    def _loss_and_top10(logits: torch.Tensor, targets: torch.Tensor):
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
            ignore_index=IGNORE, reduction="sum",
        )  # fmt: skip
        with torch.no_grad():
            valid = targets != IGNORE
            top10 = logits.topk(min(10, logits.shape[-1]), dim=-1).indices
            hit = (top10 == targets.unsqueeze(-1)).any(-1) & valid
            return loss, hit.sum().float(), valid.sum().float()

    def _ar_loss(self, text, text_valid, codes0, audio_lens, langs=None, pair=None):
        """Teacher-forced AR loss over codebook 0; the target after the last frame is EOS.
        Also the weighted guided-attention penalty (None when off or not training).

        ``pair`` (prompt codebook 0 (B, P), lengths (B,)): the prompt's frames go first and
        are context only: the loss covers the frames after them (as inference continues it).
        """
        eos = NUM_AUDIO_TOKENS
        p = None
        if pair is not None:
            p = pair[1].to(audio_lens.dtype)
            codes0, audio_lens = pack_sequences(pair[0][..., None], p, codes0[..., None], audio_lens, eos)
            codes0 = codes0[..., 0]
        inputs, targets, n_in = self._ar_group_layout(codes0, audio_lens)
        in_valid = _lengths_to_valid(n_in, inputs.shape[1])
        if p is not None:  # targets inside the prompt are context, not loss
            first_target = p if self.prepend_bos else p - 1
            cols = torch.arange(targets.shape[1], device=targets.device)[None, :]
            targets = targets.masked_fill(cols < first_target[:, None], IGNORE)
        x = self._ar_embed_text(text, text_valid, langs)
        pos = torch.arange(inputs.shape[1], device=inputs.device)
        guided = self.training and self.guided.weight > 0
        probe = AttentionProbe(heads=self.guided.heads) if guided else None
        y = self._ar_embed_audio(inputs, pos)
        h = self._ar_core(x, text_valid, y, in_valid, probe=probe, probe_last=self.guided.layers)
        targets = self._ar_classes(targets)  # IGNORE (< 0) stays
        loss, correct, frames = self._loss_and_top10(self._ar_logits(h, by_id=False), targets)
        penalty = self.guided.loss(probe.scores, text_valid, in_valid) if guided else None
        return loss, correct, frames, penalty

    def _ar_group_layout(self, codes0, audio_lens):
        """Teacher-forced AR rows in groups of G frames: inputs (B, L, G), targets (B, L, G)
        (IGNORE after each row's EOS), valid input groups per row (B,); (B, L) when G = 1.

        The frames and then EOS, cut into groups: input group i predicts group i + 1. The
        first group is given (by the prompt at inference), as frame 0 is when G = 1; with
        --prepend-bos a group of BOS comes first and every group is predicted.
        """
        g, eos = self.ar_group_size, NUM_AUDIO_TOKENS
        bsz, t_max = codes0.shape
        n_groups = -(-(t_max + 1) // g)  # frames + EOS, rounded up to whole groups
        y = codes0.masked_fill(~_lengths_to_valid(audio_lens, t_max), eos)
        y = torch.cat([y, y.new_full((bsz, n_groups * g - t_max), eos)], dim=1)
        frame = torch.arange(n_groups * g, device=y.device)[None, :]
        beyond_eos = frame > audio_lens[:, None]  # the EOS itself (frame T) is a target
        groups = y.view(bsz, n_groups, g)
        targets = y.masked_fill(beyond_eos, IGNORE).view(bsz, n_groups, g)
        n_in = torch.div(audio_lens, g, rounding_mode="floor")
        if self.prepend_bos:
            inputs = torch.cat([groups.new_full((bsz, 1, g), eos + 1), groups[:, :-1]], dim=1)
            n_in = n_in + 1
        else:
            inputs, targets = groups[:, :-1], targets[:, 1:]
        if g == 1:  # one frame per position: the plain (B, L) layout
            return inputs[..., 0], targets[..., 0], n_in
        return inputs, targets, n_in

    def _nar_layout(self, codes, audio_lens, sample_seeds, prompt, prompt_lens):
        """Per-row NAR input: packed codes, prompt length, valid length, loss mask."""
        bsz, t_max, _ = codes.shape
        device, mode = codes.device, self.prefix_mode
        valid = _lengths_to_valid(audio_lens, t_max)
        if mode == 0:
            return codes, torch.zeros_like(audio_lens), audio_lens, valid
        u = row_uniforms(sample_seeds, bsz, STREAM_PREFIX_LEN, device)
        if mode == 1 and self.paired_prompts:
            # Paired rows: the same-speaker utterance in front is the prompt (as at inference).
            p, start = prompt_lens.to(audio_lens.dtype), None
            prompt = prompt[..., : codes.shape[2]]
        elif mode == 1:
            # Prefix of the same utterance, length in [len/4, len/2), at most 3 s.
            quarter = audio_lens // 4
            p = randint_per_row(u, quarter, 2 * quarter).clamp(max=MAX_PROMPT_FRAMES)
            cols = torch.arange(t_max, device=device)[None, :]
            return codes, p, audio_lens, valid & (cols >= p[:, None])
        if mode == 2:
            # A random segment of the utterance, placed in front as the prompt; its own
            # frames are not predicted (the model would copy them).
            p = (audio_lens // 4).clamp(max=MAX_PROMPT_FRAMES)
            start = randint_per_row(
                row_uniforms(sample_seeds, bsz, STREAM_PREFIX_START, device), 0, audio_lens - p + 1
            )
            seg_len = max(int(p.max()), 1)
            idx = (start[:, None] + torch.arange(seg_len, device=device)).clamp(max=t_max - 1)
            prompt = codes.gather(1, idx[..., None].expand(-1, -1, codes.shape[2]))
        elif mode == 4:
            if prompt is None or prompt_lens is None:
                raise ValueError("--prefix-mode 4 needs prompt_features and prompt_features_lens")
            p, start = prompt_lens.to(audio_lens.dtype), None
            prompt = prompt[..., : codes.shape[2]]
        packed, lens = pack_sequences(prompt, p, codes, audio_lens, NUM_AUDIO_TOKENS)
        cols = torch.arange(packed.shape[1], device=device)[None, :]
        target = (cols >= p[:, None]) & (cols < lens[:, None])
        if start is not None:
            t = cols - p[:, None]
            target &= (t < start[:, None]) | (t >= start[:, None] + p[:, None])
        return packed, p, lens, target

    def _nar_loss(
        self, text, text_valid, codes, audio_lens, sample_seeds, prompt, prompt_lens, langs=None
    ):
        q = self.num_quantizers
        codes = codes[..., :q]
        bsz = codes.shape[0]
        u = row_uniforms(sample_seeds, bsz, STREAM_NAR_STAGE, codes.device)
        stage = randint_per_row(u, 1, q)  # (B,) in 1..Q-1
        packed, p, lens, target_mask = self._nar_layout(
            codes, audio_lens, sample_seeds, prompt, prompt_lens
        )
        length = packed.shape[1]
        audio_valid = _lengths_to_valid(lens, length)
        targets = packed.gather(2, stage[:, None, None].expand(-1, length, 1)).squeeze(2)
        targets = targets.masked_fill(~target_mask, IGNORE)
        h = self._nar_hidden(
            text, text_valid, packed, p, audio_valid, stage, prompt_full=True, langs=langs
        )
        return self._loss_and_top10(self._nar_head(h, stage), targets)

    def _nar_hidden(
        self, text, text_valid, packed, p, audio_valid, stage, prompt_full: bool, langs=None
    ):
        """NAR decoder output over the audio columns for per-row stages ``stage``."""
        q = self.num_quantizers
        k = torch.arange(q, device=packed.device)
        use = k[None, None, :] < stage[:, None, None]  # codebooks below the stage
        if prompt_full:  # prompt frames carry every codebook
            cols = torch.arange(packed.shape[1], device=packed.device)
            use = use | (cols[None, :] < p[:, None])[..., None]
        use = use & audio_valid[..., None]
        x = self._nar_embed_text(text, langs)
        y = self._nar_embed_audio(packed, use)
        cond = self.nar_stage_embedding(stage - 1)
        return self._nar_core(x, text_valid, y, audio_valid, cond)

    # --------------------------------------------------------------- inference
    @torch.no_grad()
    def inference(
        self,
        text_tokens: torch.Tensor,
        text_tokens_lens: torch.Tensor,
        prompt_codes: torch.Tensor,
        prompt_lens: torch.Tensor | None = None,
        *,
        prompt_text_lens: torch.Tensor | None = None,
        text_languages: torch.Tensor | None = None,
        top_k: int = -100,
        top_p: float = 1.0,
        temperature: float = 1.0,
        max_len_ratio: float = 16.0,
        min_len_ratio: float = 0.0,
        use_kv_cache: bool = True,
        seed: int | None = None,
        force_len: int | None = None,
        stop_rule: str = "argmax_or_sampled",
        num_candidates: int = 1,
        repetition_aware: bool = False,
        ras_window: int = 10,
        ras_threshold: float = 0.1,
        on_empty: str = "raise",
        code_vectors: list[torch.Tensor] | None = None,
        return_lens: bool = False,
    ):
        """Synthesize codes (B, T, Q) for several texts at once, each after its prompt.

        ``text_tokens`` is BOS + the prompt's transcript + the text to say + EOS; the AR
        continues the prompt's codebook 0 until it stops (per row) or reaches
        ``max_len_ratio`` x the row's text length frames; the NAR then fills codebooks
        1..Q-1 greedily. Rows shorter than T are padded with 1024; ``return_lens=True``
        also returns lengths.

        * ``text_languages`` (B,) or (B, S): language ids (--num-languages > 0); per token
          for cross-lingual synthesis (the prompt's transcript in its own language).
        * ``prompt_text_lens`` (B,): tokens after BOS that belong to the prompt's
          transcript. Prefix modes 2 and 4 need it: their NAR was trained on the target
          text alone, so it is given BOS + the text to say + EOS (as in lifeiteng).
        * ``min_len_ratio`` > 0: EOS is not allowed before ``min_len_ratio`` x the number of
          tokens of the text to say (prompt transcript, BOS and EOS not counted) frames, so
          an undertrained model cannot end a row before it began (lifeiteng has no floor: 0).
        * ``stop_rule``: ``argmax_or_sampled`` (lifeiteng) stops a row when EOS is the most
          likely token or is sampled; ``sampled`` only when it is sampled.
        * ``num_candidates`` N > 1: N AR samples per row, keep the one with the highest
          mean log-likelihood per frame under the model (EOS included when it stopped); a
          candidate that ran to the length cap only when all of its row's did.
        * ``repetition_aware``: VALL-E 2's repetition-aware sampling: a token that already
          fills more than ``ras_threshold`` of the last ``ras_window`` generated tokens is
          redrawn from the full (temperature-scaled, unfiltered) distribution.
        * ``force_len`` ignores EOS and generates exactly that many frames (benchmarks).
        * ``code_vectors``: one (K_j, D) tensor per codebook, the codec's vector of each code
          (``code_vectors()`` of the codecs in valle/codec and valle/data/audio.py). Given,
          the NAR picks in codebooks 1..Q-1 the code nearest the expected vector under its
          distribution (``nearest_to_expectation``) instead of the most likely code.
        * A row whose first generated token is EOS has nothing to synthesise:
          ``on_empty="raise"`` raises ValueError naming the rows; ``"mark"`` returns
          length 0 for them (the other rows are decoded normally).
        """
        if stop_rule not in STOP_RULES:
            raise ValueError(f"stop_rule must be one of {STOP_RULES}, got {stop_rule!r}")
        if on_empty not in ("raise", "mark"):
            raise ValueError(f"on_empty must be 'raise' or 'mark', got {on_empty!r}")
        if num_candidates < 1:
            raise ValueError(f"--num-candidates must be >= 1, got {num_candidates}")
        device = text_tokens.device
        bsz, p_max = prompt_codes.shape[0], prompt_codes.shape[1]
        if prompt_lens is None:
            prompt_lens = torch.full((bsz,), p_max, dtype=torch.long, device=device)
        prompt_codes = prompt_codes[..., : self.num_quantizers]
        langs = self._languages(text_tokens, text_languages)
        nar_text, nar_text_lens = self._nar_text(text_tokens, text_tokens_lens, prompt_text_lens)
        nar_langs = None
        if langs is not None:
            nar_langs = self._nar_text(langs, text_tokens_lens, prompt_text_lens)[0]
        n = num_candidates
        rep = (lambda t: t.repeat_interleave(n, dim=0)) if n > 1 else (lambda t: t)
        min_lens = None
        if min_len_ratio > 0:
            to_say = text_tokens_lens.to(device) - 2
            if prompt_text_lens is not None:
                to_say = to_say - prompt_text_lens.to(device=device, dtype=torch.long)
            min_lens = rep(torch.floor(to_say.clamp(min=0).double() * min_len_ratio).long())
        gen0, gen_lens, scores, ended_on_eos = self._ar_generate(
            rep(text_tokens), rep(text_tokens_lens), rep(prompt_codes[..., 0]), rep(prompt_lens),
            top_k=top_k, top_p=top_p, temperature=temperature, max_len_ratio=max_len_ratio,
            min_lens=min_lens,
            use_kv_cache=use_kv_cache, seed=seed, force_len=force_len, stop_rule=stop_rule,
            want_scores=n > 1, repetition_aware=repetition_aware, ras_window=ras_window,
            ras_threshold=ras_threshold, langs=None if langs is None else rep(langs),
        )  # fmt: skip
        if n > 1:
            # A candidate that never emitted EOS ran to the length cap, often looping on a few
            # codes the model finds likely: it wins only when every candidate of its row did.
            scores = torch.where(ended_on_eos, scores, scores - CAPPED_CANDIDATE_PENALTY)
            scores = scores.masked_fill(gen_lens == 0, float("-inf")).view(bsz, n)
            pick = torch.arange(bsz, device=device) * n + scores.argmax(dim=1)
            gen0, gen_lens = gen0[pick], gen_lens[pick]
            gen0 = gen0[:, : int(gen_lens.max())]
        empty = gen_lens == 0
        if on_empty == "raise" and bool(empty.any()):
            rows = empty.nonzero().flatten().tolist()
            raise ValueError(
                f"the AR model emitted EOS as the first token for batch row(s) {rows}: "
                "no audio to synthesise (untrained checkpoint, or text/prompt mismatch)"
            )
        codes = self._nar_generate(
            nar_text, nar_text_lens, prompt_codes, prompt_lens, gen0, gen_lens, nar_langs,
            code_vectors=code_vectors,
        )
        return (codes, gen_lens) if return_lens else codes

    def _nar_text(self, text, text_lens, prompt_text_lens):
        """The NAR's text: all of it, or (prefix modes 2, 4) BOS + the text after the prompt's."""
        if self.prefix_mode not in (2, 4):
            return text, text_lens
        if prompt_text_lens is None:
            raise ValueError(
                f"--prefix-mode {self.prefix_mode} needs prompt_text_lens at inference: its NAR "
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

    @torch.no_grad()
    def continual(
        self,
        text_tokens: torch.Tensor,
        text_tokens_lens: torch.Tensor,
        audio_features: torch.Tensor,
        audio_features_lens: torch.Tensor | None = None,
        *,
        prompt_lens: torch.Tensor | None = None,
        text_languages: torch.Tensor | None = None,
        code_vectors: list[torch.Tensor] | None = None,
        return_lens: bool = False,
    ):
        """Codebook 0 from ground truth, the NAR predicts the rest (``code_vectors``: as in
        ``inference``).

        The first ``prompt_lens`` frames (default min(len/2, 3 s) per row) are the
        prompt; returns codes (B, T, Q) of the frames after it (padded with 1024).
        ``text_tokens`` is the text of the whole utterance.
        """
        bsz, t_max, _ = audio_features.shape
        device = audio_features.device
        audio_features = audio_features[..., : self.num_quantizers]
        if audio_features_lens is None:
            audio_features_lens = torch.full((bsz,), t_max, dtype=torch.long, device=device)
        if prompt_lens is None:
            prompt_lens = (audio_features_lens // 2).clamp(max=MAX_PROMPT_FRAMES)
        gen_lens = audio_features_lens - prompt_lens
        g_max = max(int(gen_lens.max()), 0)
        idx = (prompt_lens[:, None] + torch.arange(g_max, device=device)).clamp(max=t_max - 1)
        gen0 = audio_features[..., 0].gather(1, idx)
        gen0 = gen0.masked_fill(~_lengths_to_valid(gen_lens, g_max), NUM_AUDIO_TOKENS)
        langs = self._languages(text_tokens, text_languages)
        codes = self._nar_generate(
            text_tokens, text_tokens_lens, audio_features, prompt_lens, gen0, gen_lens, langs,
            code_vectors=code_vectors,
        )
        return (codes, gen_lens) if return_lens else codes

    def _ar_generate(
        self, text, text_lens, prompt0, prompt_lens, *, top_k, top_p, temperature,
        max_len_ratio, use_kv_cache, seed, force_len, stop_rule="argmax_or_sampled",
        want_scores=False, repetition_aware=False, ras_window=10, ras_threshold=0.1, langs=None,
        min_lens=None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:  # fmt: skip
        """Codebook 0 per row after its prompt: (codes (B, T), lengths (B,), scores or None,
        ended on EOS (B,): False where the row ran to its length cap).

        A row whose first token is EOS gets length 0. Every step is one batched model
        call and tensor ops: no Python loop over rows or tokens inside a step.
        """
        device, bsz = text.device, text.shape[0]
        eos = NUM_AUDIO_TOKENS
        if int(text.max()) >= self.num_text_tokens or int(text.min()) < 0:
            raise ValueError(
                f"text token ids must be in [0, {self.num_text_tokens}), got {int(text.max())}"
            )
        text_valid = _lengths_to_valid(text_lens, text.shape[1])
        g = self.ar_group_size
        tokens, positions, audio_valid, n_in = self._ar_prompt_layout(prompt0, prompt_lens)
        width = tokens.shape[1]
        if force_len is not None:
            caps = torch.full((bsz,), int(force_len), device=device, dtype=torch.long)
        else:
            caps = torch.floor(text_lens.double() * max_len_ratio).long()
        if bool((caps < 1).any()):
            rows = (caps < 1).nonzero().flatten().tolist()
            raise ValueError(
                f"no frames allowed for batch row(s) {rows}: max_len_ratio={max_len_ratio} too small"
            )
        max_new = -(-int(caps.max()) // g)  # decoding steps: G frames each
        generator = None
        if seed is not None:
            generator = torch.Generator(device=device).manual_seed(int(seed))

        x = self._ar_embed_text(text, text_valid, langs)
        caches: list[LayerCache] | None = None
        if use_kv_cache:
            own = width + max_new + (0 if self.cross_attention else text.shape[1])
            caches = self.ar_decoder.new_caches(own)
        h = self._ar_core(
            x, text_valid, self._ar_embed_audio(tokens, positions), audio_valid, caches
        )
        logits = self._ar_logits(h[:, -1])

        out: list[torch.Tensor] = []
        done = torch.zeros(bsz, dtype=torch.bool, device=device)
        lens = torch.zeros(bsz, dtype=torch.long, device=device)
        ended_on_eos = torch.zeros(bsz, dtype=torch.bool, device=device)
        score = torch.zeros(bsz, dtype=torch.float32, device=device)
        counted = torch.zeros(bsz, dtype=torch.float32, device=device)
        history = torch.full((bsz, max(1, ras_window)), -1, dtype=torch.long, device=device)
        slot = torch.arange(g, device=device)
        for i in range(max_new):
            logits = logits.reshape(bsz, g, -1)  # (B, G, 1025): one distribution per frame
            frame = i * g + slot  # (G,) the frame index each slot would be
            if force_len is not None:
                logits[..., eos] = float("-inf")
            elif min_lens is not None:  # no EOS before the row's floor (caps still win)
                early = (frame[None, :] < min_lens[:, None]) & (frame[None, :] < caps[:, None])
                logits[..., eos] = logits[..., eos].masked_fill(early, float("-inf"))
            flat = logits.reshape(bsz * g, -1)
            tok = sample(
                flat, top_k=top_k, top_p=top_p, temperature=temperature, generator=generator
            ).view(bsz, g)
            if repetition_aware:
                # VALL-E 2: a token repeated too often in the recent window is redrawn
                # from the full distribution (no top-k/top-p), which breaks loops.
                ratio = (history[:, None, :] == tok[..., None]).sum(-1).float() / history.shape[1]
                free = sample(flat, temperature=temperature, generator=generator).view(bsz, g)
                if force_len is not None:
                    free = torch.where(free == eos, tok, free)
                tok = torch.where(ratio > ras_threshold, free, tok)
            is_eos = tok == eos
            if stop_rule == "argmax_or_sampled":
                # lifeiteng: also stop when EOS is the most likely token, sampled or not.
                is_eos = is_eos | (logits.argmax(dim=-1) == eos)
            stop = is_eos | (frame[None, :] >= caps[:, None])  # (B, G)
            # A row ends at its group's first stopping slot: that frame and the ones after
            # it are not kept.
            stops_here = stop.any(dim=1) & ~done
            first = torch.where(stop.any(dim=1), stop.int().argmax(dim=1), g)
            kept = ~done[:, None] & (slot[None, :] < first[:, None])
            ends_on_eos = stops_here & is_eos.gather(1, first.clamp(max=g - 1)[:, None]).squeeze(1)
            if want_scores:
                logp = torch.log_softmax(logits.float(), dim=-1)
                picked = logp.gather(2, torch.where(is_eos, eos, tok)[..., None]).squeeze(2)
                # the frames kept, and the EOS that ended the row
                counts = kept | (ends_on_eos[:, None] & (slot[None, :] == first[:, None]))
                score = score + torch.where(counts, picked, torch.zeros_like(picked)).sum(1)
                counted = counted + counts.float().sum(1)
            lens = torch.where(stops_here, i * g + first, lens)
            ended_on_eos = ended_on_eos | ends_on_eos
            done = done | stops_here
            tok = tok.masked_fill(~kept, eos)
            out.append(tok)
            if bool(done.all()):
                break
            if repetition_aware:
                history = torch.cat([history[:, g:], tok], dim=1)[:, -history.shape[1]:]
            new_pos = n_in + i
            if i + 1 == max_new:
                break  # no further token will be sampled: skip the last model call
            step_tokens = tok.view(bsz, 1, g) if g > 1 else tok  # one column: (B, 1[, G])
            y_new = self._ar_embed_audio(step_tokens, new_pos[:, None])
            audio_valid = torch.cat([audio_valid, torch.ones_like(audio_valid[:, :1])], dim=1)
            if caches is not None:
                h = self._ar_core_step(y_new, text_valid, audio_valid, caches)
            else:
                tokens = torch.cat([tokens, step_tokens], dim=1)
                positions = torch.cat([positions, new_pos[:, None]], dim=1)
                h = self._ar_core(
                    x, text_valid, self._ar_embed_audio(tokens, positions), audio_valid
                )
            logits = self._ar_logits(h[:, -1])
        lens = torch.where(done, lens, torch.full_like(lens, len(out) * g))
        gen = torch.cat(out, dim=1)[:, : int(lens.max())]
        scores = score / counted.clamp(min=1) if want_scores else None
        return gen, lens, scores, ended_on_eos

    def _ar_prompt_layout(self, prompt0, prompt_lens):
        """The AR's prompt input: tokens (B, W) or groups (B, W, G), positions (B, W), valid
        columns (B, W), valid groups per row (B,).

        Rows are right-aligned, so every row's last prompt group is the last column: one
        shared column for the next group, per-row positions stay exact. With G > 1 a row
        keeps its last whole groups (its first ``len % G`` frames are dropped); with
        --prepend-bos a BOS group goes first, as in training.
        """
        g, eos, device = self.ar_group_size, NUM_AUDIO_TOKENS, prompt0.device
        bsz, bos = prompt0.shape[0], int(self.prepend_bos)
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

    def _nar_generate(
        self, text, text_lens, prompt, prompt_lens, gen0, gen_lens, langs=None, code_vectors=None
    ) -> torch.Tensor:
        """Greedy NAR over codebooks 1..Q-1 after the AR (or ground-truth) codebook 0: the most
        likely code, or with ``code_vectors`` the code nearest the expected vector."""
        q, bsz = self.num_quantizers, gen0.shape[0]
        if code_vectors is not None and len(code_vectors) < q:
            raise ValueError(f"code_vectors has {len(code_vectors)} codebooks, the model {q}")
        gen = gen0.new_full((bsz, gen0.shape[1], q), NUM_AUDIO_TOKENS)
        gen[..., 0] = gen0
        if q == 1 or gen0.shape[1] == 0:
            return gen
        text_valid = _lengths_to_valid(text_lens, text.shape[1])
        packed, lens = pack_sequences(prompt, prompt_lens, gen, gen_lens, NUM_AUDIO_TOKENS)
        length = packed.shape[1]
        cols = torch.arange(length, device=packed.device)[None, :]
        audio_valid = cols < lens[:, None]
        is_gen = audio_valid & (cols >= prompt_lens[:, None])
        # Prefix mode 0 never saw a prompt carrying all codebooks: give it what it was trained on.
        prompt_full = self.prefix_mode != 0
        for j in range(1, q):
            stage = torch.full((bsz,), j, dtype=torch.long, device=packed.device)
            h = self._nar_hidden(
                text, text_valid, packed, prompt_lens, audio_valid, stage, prompt_full, langs
            )
            logits = self._nar_head(h, stage)
            if code_vectors is None:
                pred = logits.argmax(-1)
            else:
                pred = nearest_to_expectation(logits, code_vectors[j])
            packed[..., j] = torch.where(is_gen, pred, packed[..., j])
        g_max = gen.shape[1]
        idx = (prompt_lens[:, None] + torch.arange(g_max, device=packed.device)).clamp(
            max=length - 1
        )
        out = packed.gather(1, idx[..., None].expand(-1, -1, q))
        return out.masked_fill(~_lengths_to_valid(gen_lens, g_max)[..., None], NUM_AUDIO_TOKENS)


class VALLE(_VALLEBase):
    """Decoder-only: one sequence [text; audio]; text sees text, audio sees text + past audio."""

    cross_attention = False

    def _ar_core(self, x, text_valid, y, audio_valid, caches=None, probe=None, probe_last=0):
        key_valid = torch.cat([text_valid, audio_valid], dim=1)
        s = x.shape[1]
        mask = prefix_causal_mask(key_valid, s)
        if probe is not None:  # audio queries, text keys
            probe = replace(probe, queries=slice(s, None), keys=slice(None, s))
        h = self.ar_decoder(
            torch.cat([x, y], dim=1), mask, caches=caches, probe=probe, probe_last=probe_last
        )
        return h[:, s:]

    def _ar_core_step(self, y, text_valid, audio_valid, caches):
        # One new query at the last column: it may see every valid key so far.
        mask = key_padding_mask(torch.cat([text_valid, audio_valid], dim=1))
        return self.ar_decoder(y, mask, caches=caches)

    def _nar_core(self, x, text_valid, y, audio_valid, cond):
        mask = key_padding_mask(torch.cat([text_valid, audio_valid], dim=1))
        h = self.nar_decoder(torch.cat([x, y], dim=1), mask, cond=cond)
        return h[:, x.shape[1] :]


class VALLF(_VALLEBase):
    """Audio decoder with the (embedded) text as cross-attention memory."""

    cross_attention = True

    def _ar_core(self, x, text_valid, y, audio_valid, caches=None, probe=None, probe_last=0):
        mask = prefix_causal_mask(audio_valid, 0)
        # The cross-attention's queries are the audio frames and its keys the text.
        return self.ar_decoder(
            y, mask, memory=x, memory_mask=key_padding_mask(text_valid), caches=caches,
            probe=probe, probe_last=probe_last,
        )  # fmt: skip

    def _ar_core_step(self, y, text_valid, audio_valid, caches):
        return self.ar_decoder(
            y, key_padding_mask(audio_valid), memory=None,
            memory_mask=key_padding_mask(text_valid), caches=caches,
        )  # fmt: skip

    def _nar_core(self, x, text_valid, y, audio_valid, cond):
        return self.nar_decoder(
            y,
            key_padding_mask(audio_valid),
            cond=cond,
            memory=x,
            memory_mask=key_padding_mask(text_valid),
        )

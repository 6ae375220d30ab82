"""VALL-E (decoder-only) and VALL-F (text as cross-attention memory): the modules.

Both have two halves with separate parameters (``ar_*`` and ``nar_*``):

* AR: predicts codebook 0 frame by frame from the text, EOS id ``NUM_AUDIO_TOKENS``.
* NAR: predicts codebook j (1..Q-1) of every frame at once from the text and the sum
  of the embeddings of codebooks < j, conditioned on j through adaptive layer norm.

This file holds the parameters and the building blocks (embeddings, cores, heads) and
``forward`` (the training loss); the hyper-parameters are ``config.ModelConfig``, the
sequence layouts ``layout.py``, the losses ``losses.py`` and decoding ``generation.py``.

Training draws, per row, the NAR stage j and the prompt/prefix length from that
row's ``sample_seeds`` entry (see ``rng.py``), so any split of a batch gives the same
per-row values. Layout of a batch: text padded to S columns, then audio; padding is
handled by key masks and per-row positions, never by per-row Python loops.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import generation
from .config import ModelConfig
from .embedding import AudioPrenet, SinePositionalEncoding, TextPrenet
from .layout import (
    NUM_AUDIO_TOKENS,
    check_training_inputs,
    classes_to_ids,
    language_ids,
    lengths_to_valid,
)
from .losses import GuidedAttention, ar_loss, nar_loss
from .transformer import LayerCache, TransformerStack, key_padding_mask, prefix_causal_mask


class _VALLEBase(nn.Module):
    """Everything VALL-E and VALL-F share; subclasses say how text and audio meet."""

    cross_attention = False

    def __init__(self, config: ModelConfig | None = None, /, **hparams: Any):
        """From a ``ModelConfig``, or its fields as keywords (``VALLE(decoder_dim=256)``)."""
        super().__init__()
        if config is None:
            config = ModelConfig(**hparams)
        elif hparams:
            raise TypeError("give a ModelConfig or keyword hyper-parameters, not both")
        self.config = config
        self.hparams: dict[str, Any] = config.hparams()
        c = config
        self.prefix_mode, self.num_quantizers = c.prefix_mode, c.num_quantizers
        self.share_embedding, self.prepend_bos = c.share_embedding, c.prepend_bos
        self.num_text_tokens = c.num_text_tokens
        self.num_languages = c.num_languages
        # AR training only: heads x layers whose attention to the text is pulled to the diagonal.
        self.guided = GuidedAttention(
            c.guided_attention_weight, c.guided_attention_sigma,
            min(c.guided_attention_heads, c.nhead),
            min(c.guided_attention_layers, c.num_decoder_layers),
        )  # fmt: skip
        d = c.decoder_dim
        nar_d = int(c.decoder_dim * c.scale_factor)
        nar_heads = max(1, int(c.nhead * c.scale_factor))
        nar_layers = max(1, int(c.num_decoder_layers * c.scale_factor))
        self.ar_dim, self.nar_dim = d, nar_d
        # Codebook 0's codes are 0..K-1. The AR's classes are those K codes and EOS (class K;
        # BOS is row K+1 of the input table): a codec whose first codebook is small (the demo's
        # mel-rvq, 128 codes) then costs a K+1-wide head, not 1025 (docs/inference.md). Outside
        # the AR, EOS and padding stay id 1024 (ar_classes maps them in).
        self.ar_codebook_size = c.ar_codebook_size
        # VALL-E 2's grouped code modeling: each AR position reads and predicts G consecutive
        # frames of codebook 0, so the AR's audio sequence is G times shorter (a cheaper
        # step and G frames per decoding step). Each slot has its own input table (their
        # embeddings are summed: a linear map of the G one-hot codes) and its own K+1 outputs.
        self.ar_group_size = c.ar_group_size
        self._ar_rows = c.ar_codebook_size + 1 + int(c.prepend_bos)  # rows of one slot's table
        self._build_ar(c, d)
        if c.num_quantizers > 1:
            self._build_nar(c, nar_d, nar_heads, nar_layers)

    def _build_ar(self, c: ModelConfig, d: int) -> None:
        """AR: text + codebook 0 (+ EOS, + BOS when prepended)."""
        self.ar_text_embedding = nn.Embedding(c.num_text_tokens, d)
        # VALL-E X: a language-ID embedding added to every text token (its language).
        self.ar_language_embedding = nn.Embedding(c.num_languages, d) if c.num_languages else None
        self.ar_audio_embedding = nn.Embedding(c.ar_group_size * self._ar_rows, d)
        self.ar_text_prenet = TextPrenet(d, c.dropout) if c.add_prenet else None
        self.ar_audio_prenet = AudioPrenet(d, c.dropout) if c.add_prenet else None
        interleaved = c.positions == "interleaved"
        self.ar_text_position = SinePositionalEncoding(d, c.dropout, interleaved)
        self.ar_audio_position = SinePositionalEncoding(d, c.dropout, interleaved)
        self.ar_decoder = TransformerStack(
            c.num_decoder_layers, d, c.nhead, c.dropout, c.norm_first, cross=self.cross_attention
        )
        # lifeiteng keeps the AR head untied even under --share-embedding (tying hurt its
        # accuracy); --tie-ar-head ties it to the audio embedding rows 0..K (EOS included).
        self.tie_ar_head = c.tie_ar_head
        self.ar_predict_layer = (
            None
            if c.tie_ar_head
            else nn.Linear(d, c.ar_group_size * (c.ar_codebook_size + 1), bias=False)
        )

    def _build_nar(self, c: ModelConfig, nar_d: int, nar_heads: int, nar_layers: int) -> None:
        """NAR: codebooks 1..Q-1."""
        vocab, q = NUM_AUDIO_TOKENS, c.num_quantizers
        interleaved = c.positions == "interleaved"
        self.nar_text_embedding = nn.Embedding(c.num_text_tokens, nar_d)
        self.nar_language_embedding = (
            nn.Embedding(c.num_languages, nar_d) if c.num_languages else None
        )
        # One table per codebook, stacked so all Q lookups are one embedding call;
        # row 1024 (pad) exists so padded frames index safely (they are masked out).
        self.nar_audio_embedding = nn.Parameter(torch.randn(q, vocab + 1, nar_d))
        # As in lifeiteng: no dropout on the NAR text positions; alpha fixed unless
        # --nar-position-scale learned.
        learned = c.nar_position_scale == "learned"
        self.nar_text_position = SinePositionalEncoding(nar_d, 0.0, interleaved, learned)
        self.nar_audio_position = SinePositionalEncoding(nar_d, c.dropout, interleaved, learned)
        self.nar_stage_embedding = nn.Embedding(q - 1, nar_d)
        self.nar_decoder = TransformerStack(
            nar_layers, nar_d, nar_heads, c.dropout, c.norm_first, adaptive=True,
            cross=self.cross_attention,
        )  # fmt: skip
        # Output heads, gathered per row (see nar_head). Untied: one stacked table.
        # Tied (--share-embedding), lifeiteng's layout: the head of stage j is the
        # embedding table of codebook j+1 and the last stage has its own head;
        # --nar-head-tie same: the head of stage j is codebook j's table (what it predicts).
        self.nar_head_tie = c.nar_head_tie if c.share_embedding else "none"
        self.nar_predict_weight = self.nar_predict_last = None
        if not c.share_embedding:
            self.nar_predict_weight = nn.Parameter(
                torch.randn(q - 1, vocab, nar_d) * nar_d**-0.5
            )
        elif c.nar_head_tie == "lifeiteng":
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
    def ar_embed_text(self, text: torch.Tensor, text_valid: torch.Tensor,
                      languages: torch.Tensor | None = None) -> torch.Tensor:
        x = self.ar_text_embedding(text)
        if self.ar_language_embedding is not None and languages is not None:
            x = x + self.ar_language_embedding(languages)
        if self.ar_text_prenet is not None:
            x = self.ar_text_prenet(x, text_valid)
        pos = torch.arange(text.shape[1], device=text.device)
        return self.ar_text_position(x, pos)

    def ar_classes(self, ids: torch.Tensor) -> torch.Tensor:
        """Codebook-0 ids (codes, EOS/pad 1024, BOS 1025) -> the AR's rows/classes."""
        shift = NUM_AUDIO_TOKENS - self.ar_codebook_size
        return ids if shift == 0 else torch.where(ids >= NUM_AUDIO_TOKENS, ids - shift, ids)

    def ar_embed_audio(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens (B, L), or (B, L, G) groups of codebook-0 ids, -> (B, L, D)."""
        g = self.ar_group_size
        if tokens.dim() == 2 and g == 1:
            y = self.ar_audio_embedding(self.ar_classes(tokens))
        else:
            if tokens.shape[-1] != g:
                raise ValueError(f"expected groups of {g} codes, got {tuple(tokens.shape)}")
            slot_offsets = torch.arange(g, device=tokens.device) * self._ar_rows
            y = self.ar_audio_embedding(self.ar_classes(tokens) + slot_offsets).sum(dim=-2)
        if self.ar_audio_prenet is not None:
            y = self.ar_audio_prenet(y)
        return self.ar_audio_position(y, positions)

    def ar_logits(self, h: torch.Tensor, by_id: bool = True) -> torch.Tensor:
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
        return classes_to_ids(logits, k) if by_id else logits

    def nar_embed_text(self, text: torch.Tensor,
                       languages: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(text.shape[1], device=text.device)
        x = self.nar_text_embedding(text)
        if self.nar_language_embedding is not None and languages is not None:
            x = x + self.nar_language_embedding(languages)
        return self.nar_text_position(x, pos)

    def nar_embed_audio(self, codes: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
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

    def nar_head(self, h: torch.Tensor, stage: torch.Tensor) -> torch.Tensor:
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

    def nar_hidden(
        self, text, text_valid, packed, p, audio_valid, stage, prompt_full: bool, langs=None
    ) -> torch.Tensor:
        """NAR decoder output over the audio columns for per-row stages ``stage``."""
        q = self.num_quantizers
        k = torch.arange(q, device=packed.device)
        use = k[None, None, :] < stage[:, None, None]  # codebooks below the stage
        if prompt_full:  # prompt frames carry every codebook
            cols = torch.arange(packed.shape[1], device=packed.device)
            use = use | (cols[None, :] < p[:, None])[..., None]
        use = use & audio_valid[..., None]
        x = self.nar_embed_text(text, langs)
        y = self.nar_embed_audio(packed, use)
        cond = self.nar_stage_embedding(stage - 1)
        return self.nar_core(x, text_valid, y, audio_valid, cond)

    # ----------------------------------------------- architecture-specific cores
    def ar_core(
        self, x, text_valid, y, audio_valid, caches=None, probe=None, probe_last=0
    ):  # pragma: no cover
        """AR decoder output over the audio columns. ``probe`` (an AttentionProbe; its rows
        and columns are set here) receives the audio-to-text attention scores
        (B, probe.heads, T, S) of the last ``probe_last`` layers."""
        raise NotImplementedError

    def ar_core_step(
        self, y, text_valid, audio_valid, caches: list[LayerCache]
    ):  # pragma: no cover
        """One new audio column ``y`` (B, 1, D) through the AR with its key/value caches."""
        raise NotImplementedError

    def nar_core(self, x, text_valid, y, audio_valid, cond):  # pragma: no cover
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
        nar_context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed cross entropy (AR + NAR) and detached sum metrics for this batch.

        ``text_languages``: language ids (B,) or (B, S), required when --num-languages > 0.
        ``nar_context``: entered around the NAR forward only; the trainer holds its NAR
        backward reserve there (valle.train.resilience.memory.BackwardReserve).
        """
        if train_stage not in (0, 1, 2):
            raise ValueError(f"train_stage must be 0, 1 or 2, got {train_stage}")
        check_training_inputs(text_tokens, audio_features, self.num_quantizers)
        zero = torch.zeros((), device=audio_features.device)
        loss = zero
        metrics = {k: zero for k in ("ar_loss", "nar_loss", "ar_top10_correct", "ar_frames",
                                     "nar_top10_correct", "nar_frames")}  # fmt: skip
        text_valid = lengths_to_valid(text_tokens_lens, text_tokens.shape[1])
        langs = language_ids(text_tokens, text_languages, self.num_languages)
        if train_stage in (0, 1):
            ar, correct, frames, guided = ar_loss(
                self, text_tokens, text_valid, audio_features[..., 0], audio_features_lens, langs
            )
            # The ar_loss metric stays the cross entropy; the guided term only steers training.
            loss = loss + ar + (guided if guided is not None else 0.0)
            metrics.update(ar_loss=ar.detach(), ar_top10_correct=correct, ar_frames=frames)
        if train_stage in (0, 2) and self.num_quantizers > 1:
            with nar_context():
                nar, correct, frames = nar_loss(
                    self, text_tokens, text_valid, audio_features, audio_features_lens,
                    sample_seeds, prompt_features, prompt_features_lens, langs,
                )  # fmt: skip
            loss = loss + nar
            metrics.update(nar_loss=nar.detach(), nar_top10_correct=correct, nar_frames=frames)
        return loss, metrics

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
        code_vectors: list[torch.Tensor] | None = None,
        return_lens: bool = False,
        options: generation.DecodeOptions | None = None,
        **decoding: Any,
    ):
        """Synthesize codes (B, T, Q) for several texts at once, each after its prompt.

        ``text_tokens`` is BOS + the prompt's transcript + the text to say + EOS; the AR
        continues the prompt's codebook 0 until it stops (per row) or reaches
        ``max_len_ratio`` x the row's text length frames; the NAR then fills codebooks
        1..Q-1 greedily. Rows shorter than T are padded with 1024; ``return_lens=True``
        also returns lengths.

        * ``options``: how to decode (``generation.DecodeOptions``; default: its defaults);
          ``decoding``: some of its fields by keyword (top_k, top_p, temperature,
          max_len_ratio, min_len_ratio, use_kv_cache, seed, force_len, stop_rule,
          num_candidates, on_empty), which replace those of ``options``.
        * ``text_languages`` (B,) or (B, S): language ids (--num-languages > 0); per token
          for cross-lingual synthesis (the prompt's transcript in its own language).
        * ``prompt_text_lens`` (B,): tokens after BOS that belong to the prompt's
          transcript. Prefix modes 2 and 4 need it: their NAR was trained on the target
          text alone, so it is given BOS + the text to say + EOS (as in lifeiteng).
        * ``code_vectors``: one (K_j, D) tensor per codebook, the codec's vector of each code
          (``code_vectors()`` of the codecs in valle/codec: encodec.py, mel_rvq.py). Given,
          the NAR picks in codebooks 1..Q-1 the code nearest the expected vector under its
          distribution (``nearest_to_expectation``) instead of the most likely code.
        """
        codes, lens = generation.synthesize(
            self, text_tokens, text_tokens_lens, prompt_codes, prompt_lens,
            prompt_text_lens=prompt_text_lens, text_languages=text_languages,
            options=_decode_options(options, decoding), code_vectors=code_vectors,
        )  # fmt: skip
        return (codes, lens) if return_lens else codes

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
        codes, lens = generation.continual(
            self, text_tokens, text_tokens_lens, audio_features, audio_features_lens,
            prompt_lens=prompt_lens, text_languages=text_languages, code_vectors=code_vectors,
        )  # fmt: skip
        return (codes, lens) if return_lens else codes


def _decode_options(options: generation.DecodeOptions | None,
                    keywords: dict[str, Any]) -> generation.DecodeOptions:
    """``options`` (default: the defaults) with the fields given as keywords replaced."""
    if options is None:
        return generation.DecodeOptions(**keywords)
    return replace(options, **keywords) if keywords else options


class VALLE(_VALLEBase):
    """Decoder-only: one sequence [text; audio]; text sees text, audio sees text + past audio."""

    cross_attention = False

    def ar_core(self, x, text_valid, y, audio_valid, caches=None, probe=None, probe_last=0):
        key_valid = torch.cat([text_valid, audio_valid], dim=1)
        s = x.shape[1]
        mask = prefix_causal_mask(key_valid, s)
        if probe is not None:  # audio queries, text keys
            probe = replace(probe, queries=slice(s, None), keys=slice(None, s))
        h = self.ar_decoder(
            torch.cat([x, y], dim=1), mask, caches=caches, probe=probe, probe_last=probe_last
        )
        return h[:, s:]

    def ar_core_step(self, y, text_valid, audio_valid, caches):
        # One new query at the last column: it may see every valid key so far.
        mask = key_padding_mask(torch.cat([text_valid, audio_valid], dim=1))
        return self.ar_decoder(y, mask, caches=caches)

    def nar_core(self, x, text_valid, y, audio_valid, cond):
        mask = key_padding_mask(torch.cat([text_valid, audio_valid], dim=1))
        h = self.nar_decoder(torch.cat([x, y], dim=1), mask, cond=cond)
        return h[:, x.shape[1] :]


class VALLF(_VALLEBase):
    """Audio decoder with the (embedded) text as cross-attention memory."""

    cross_attention = True

    def ar_core(self, x, text_valid, y, audio_valid, caches=None, probe=None, probe_last=0):
        mask = prefix_causal_mask(audio_valid, 0)
        # The cross-attention's queries are the audio frames and its keys the text.
        return self.ar_decoder(
            y, mask, memory=x, memory_mask=key_padding_mask(text_valid), caches=caches,
            probe=probe, probe_last=probe_last,
        )  # fmt: skip

    def ar_core_step(self, y, text_valid, audio_valid, caches):
        return self.ar_decoder(
            y, key_padding_mask(audio_valid), memory=None,
            memory_mask=key_padding_mask(text_valid), caches=caches,
        )  # fmt: skip

    def nar_core(self, x, text_valid, y, audio_valid, cond):
        return self.nar_decoder(
            y,
            key_padding_mask(audio_valid),
            cond=cond,
            memory=x,
            memory_mask=key_padding_mask(text_valid),
        )

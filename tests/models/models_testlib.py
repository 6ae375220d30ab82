"""Tiny models and batches shared by the model tests."""

from __future__ import annotations

import torch

from valle.models import NUM_AUDIO_TOKENS, get_model

Q = 8


def tiny_model(name: str = "valle", prefix_mode: int = 1, **overrides):
    hp = dict(
        model_name=name, decoder_dim=32, nhead=4, num_decoder_layers=2, scale_factor=1.0,
        norm_first=True, add_prenet=False, prefix_mode=prefix_mode, share_embedding=True,
        prepend_bos=False, num_quantizers=Q, num_text_tokens=40, dropout=0.0,
    )  # fmt: skip
    hp.update(overrides)
    torch.manual_seed(0)
    return get_model(hp)


def make_batch(
    text_lens=(7, 5, 3, 6), audio_lens=(20, 11, 6, 15), prompt_lens=(9, 4, 1, 6), seed=0
):
    """Padded batch per docs/architecture.md (text pad 1, audio pad 1024)."""
    g = torch.Generator().manual_seed(seed)
    bsz = len(text_lens)
    text = torch.full((bsz, max(text_lens)), 1, dtype=torch.long)
    audio = torch.full((bsz, max(audio_lens), Q), NUM_AUDIO_TOKENS, dtype=torch.long)
    prompt = torch.full((bsz, max(prompt_lens), Q), NUM_AUDIO_TOKENS, dtype=torch.long)
    for b in range(bsz):
        text[b, : text_lens[b]] = torch.randint(4, 40, (text_lens[b],), generator=g)
        audio[b, : audio_lens[b]] = torch.randint(
            0, NUM_AUDIO_TOKENS, (audio_lens[b], Q), generator=g
        )
        prompt[b, : prompt_lens[b]] = torch.randint(
            0, NUM_AUDIO_TOKENS, (prompt_lens[b], Q), generator=g
        )
    return dict(
        text_tokens=text, text_tokens_lens=torch.tensor(text_lens),
        audio_features=audio, audio_features_lens=torch.tensor(audio_lens),
        prompt_features=prompt, prompt_features_lens=torch.tensor(prompt_lens),
    )  # fmt: skip


def trim(batch: dict, rows: list[int]) -> dict:
    """Select rows and cut the padding down to the longest selected row (as the trainer does)."""
    out = {k: v[rows] for k, v in batch.items()}
    for key, lens in (("text_tokens", "text_tokens_lens"), ("audio_features", "audio_features_lens"),
                      ("prompt_features", "prompt_features_lens")):  # fmt: skip
        out[key] = out[key][:, : int(out[lens].max())]
    return out


def run(model, batch: dict, train_stage: int = 0, seeds=None):
    return model(
        batch["text_tokens"], batch["text_tokens_lens"], batch["audio_features"], batch["audio_features_lens"],
        train_stage=train_stage, sample_seeds=seeds,
        prompt_features=batch["prompt_features"], prompt_features_lens=batch["prompt_features_lens"],
    )  # fmt: skip

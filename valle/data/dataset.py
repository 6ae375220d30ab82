"""Map-style dataset: a CutSet batch (from the sampler) -> the batch dict of docs/architecture.md."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from valle.codec.constants import FRAME_RATE
from valle.data.collation import collate_audio_features, cut_text_symbols
from valle.data.text import TextTokenCollater

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class _PromptSource:
    cut_id: str
    duration: float
    features: object  # lhotse Features: enough to load codes without keeping whole cuts


class PromptIndex:
    """Per speaker, the cuts of a CutSet sorted by id; the prompt of a cut is the next cut of
    the same speaker (wrapping around) that is <= max_duration, else the next one cut to
    max_duration. Deterministic: it depends on the ids only, not on sampling order."""

    def __init__(self, cuts, max_duration: float = 3.0) -> None:
        self.max_duration = max_duration
        by_speaker: dict[str, list[_PromptSource]] = {}
        for cut in cuts:
            spk = cut.supervisions[0].speaker if cut.supervisions else None
            if spk is None or cut.features is None:
                continue
            by_speaker.setdefault(spk, []).append(_PromptSource(cut.id, cut.duration, cut.features))
        self.by_speaker = {s: sorted(v, key=lambda p: p.cut_id) for s, v in by_speaker.items()}
        self.position = {p.cut_id: (s, i) for s, v in self.by_speaker.items() for i, p in enumerate(v)}
        self.self_prompted = 0  # cuts whose speaker has no other utterance (counted, not silent)

    def choose(self, cut) -> _PromptSource | None:
        spk = cut.supervisions[0].speaker if cut.supervisions else None
        if spk not in self.by_speaker:
            return None
        items = self.by_speaker[spk]
        start = self.position[cut.id][1] if cut.id in self.position else -1
        others = [items[(start + k) % len(items)] for k in range(1, len(items) + 1)]
        others = [p for p in others if p.cut_id != cut.id]
        if not others:
            self.self_prompted += 1
            return None
        for p in others:
            if p.duration <= self.max_duration:
                return p
        return others[0]

    def load(self, source: _PromptSource):
        f = source.features
        duration = min(source.duration, self.max_duration)
        codes = f.load(start=f.start, duration=duration)
        return codes[: int(round(self.max_duration * FRAME_RATE))]


def load_codes(cuts: list) -> tuple[list, list, list[dict]]:
    """(readable cuts, their codes, the unreadable ones as {cut_id, file, error}).

    A cut whose codes cannot be read (a truncated HDF5 file, a file gone, a corrupt Shar
    member) must not end a multi-day run: it leaves the batch, and the trainer reports it
    by id and counts it as skipped in the epoch summary."""
    readable, features, unreadable = [], [], []
    for cut in cuts:
        try:
            features.append(cut.load_features())
            readable.append(cut)
        except Exception as e:  # noqa: BLE001 - whatever the storage raised, said per cut
            storage = getattr(cut, "features", None)
            unreadable.append({"cut_id": cut.id,
                               "file": str(getattr(storage, "storage_path", "") or ""),
                               "error": f"{type(e).__name__}: {e}"[:300]})
    return readable, features, unreadable


class SpeechSynthesisDataset(torch.utils.data.Dataset):
    """Takes a CutSet (one batch drawn by a lhotse sampler) and returns the batch dict.

    With ``prompt_cuts`` (the CutSet the batches are drawn from), each row also gets
    ``prompt_features``: codes of a neighbouring utterance of the same speaker, <= 3 s
    (prefix mode 4). A speaker with a single utterance is prompted with the first 3 s of
    the utterance itself, and counted in ``prompt_index.self_prompted``.

    With ``languages`` (VALL-E X, --num-languages > 0: the espeak voices in id order), each row
    also gets ``text_languages`` (B,): the id of the voice its text was phonemized with, which
    bin/tokenizer.py stored as the supervision's ``custom["espeak_voice"]``.
    """

    def __init__(self, text_collater: TextTokenCollater, prompt_cuts=None,
                 max_prompt_duration: float = 3.0, languages: Sequence[str] | None = None) -> None:
        super().__init__()
        self.text_collater = text_collater
        self.prompt_index = PromptIndex(prompt_cuts, max_prompt_duration) if prompt_cuts is not None else None
        self.language_ids = {lang: i for i, lang in enumerate(languages)} if languages else None

    def __getitem__(self, cuts) -> dict:
        cuts = cuts.sort_by_duration(ascending=False) if hasattr(cuts, "sort_by_duration") else cuts
        cuts, features, unreadable = load_codes(list(cuts))
        if not cuts:
            return {"cut_ids": [], "unreadable": unreadable}
        ids = [c.id for c in cuts]
        audio, audio_lens = collate_audio_features(features)
        texts = [cut_text_symbols(c) for c in cuts]
        prompt_sources = [self.prompt_index.choose(c) for c in cuts] if self.prompt_index else None
        tokens, token_lens = self.text_collater(texts, ids=ids)
        batch = {
            "cut_ids": ids,
            "text": [c.supervisions[0].text for c in cuts],
            "text_tokens": tokens,
            "text_tokens_lens": token_lens,
            "audio_features": audio,
            "audio_features_lens": audio_lens,
            "durations": torch.tensor([c.duration for c in cuts], dtype=torch.float32),
        }
        if self.language_ids is not None:
            batch["text_languages"] = torch.tensor([self._language_id(c) for c in cuts], dtype=torch.long)
        if self.prompt_index is not None:
            prompts = [self._prompt_codes(src, feats) for src, feats in zip(prompt_sources, features)]
            batch["prompt_features"], batch["prompt_features_lens"] = collate_audio_features(prompts)
        if unreadable:
            batch["unreadable"] = unreadable  # the trainer counts, reports and skips them
        return batch

    def _prompt_codes(self, source: _PromptSource | None, own_codes):
        if source is not None:
            return self.prompt_index.load(source)
        return own_codes[: int(round(self.prompt_index.max_duration * FRAME_RATE))]

    def _language_id(self, cut) -> int:
        custom = (cut.supervisions[0].custom or {}) if cut.supervisions else {}
        voice = custom.get("espeak_voice")
        if voice is None:
            raise RuntimeError(f"cut {cut.id}: no espeak_voice in its supervision (re-run bin/tokenizer.py); "
                               "--num-languages needs the language each text was phonemized in")
        if voice not in self.language_ids:
            raise RuntimeError(f"cut {cut.id}: language {voice!r} is not one of --languages "
                               f"{list(self.language_ids)}")
        return self.language_ids[voice]


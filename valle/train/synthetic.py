"""Synthetic token batches: train without a corpus (GPU checks, tests, benchmarks).

Deterministic fake cuts (text token ids, EnCodec-like codes) and a sampler
that draws *global* batches and gives rank r its slice, so runs with world
size 1 and 2 see the same global batch per step. Imports torch only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from valle.codec.constants import NUM_AUDIO_TOKENS
from valle.train.batching import AUDIO_PAD, TEXT_PAD, Batch


@dataclass(frozen=True)
class SyntheticSpec:
    num_cuts: int = 64
    text_len: tuple[int, int] = (8, 24)
    audio_len: tuple[int, int] = (20, 60)
    num_text_tokens: int = 64  # ids 4.. are "phonemes"; 0..3 are <eps>/<pad>/<bos>/<eos>
    num_quantizers: int = 8
    num_audio_tokens: int = NUM_AUDIO_TOKENS
    num_languages: int = 0  # VALL-E X: each cut also gets a language id in [0, num_languages)
    seed: int = 0


class SyntheticCorpus:
    def __init__(self, spec: SyntheticSpec):
        self.spec = spec
        g = torch.Generator().manual_seed(spec.seed)
        self.cuts = []
        for i in range(spec.num_cuts):
            s = int(torch.randint(spec.text_len[0], spec.text_len[1] + 1, (), generator=g))
            t = int(torch.randint(spec.audio_len[0], spec.audio_len[1] + 1, (), generator=g))
            text = torch.randint(4, spec.num_text_tokens, (s,), generator=g)
            codes = torch.randint(0, spec.num_audio_tokens, (t, spec.num_quantizers), generator=g)
            cut = {"id": f"syn-{i:05d}", "text": text, "codes": codes}
            if spec.num_languages:
                cut["language"] = i % spec.num_languages
            self.cuts.append(cut)

    def __len__(self) -> int:
        return len(self.cuts)


def collate(cuts: list[dict]) -> Batch:
    """Pad into the batch dict of docs/architecture.md."""
    text_lens = torch.tensor([len(c["text"]) for c in cuts], dtype=torch.long)
    audio_lens = torch.tensor([len(c["codes"]) for c in cuts], dtype=torch.long)
    q = cuts[0]["codes"].shape[1]
    text = torch.full((len(cuts), int(text_lens.max())), TEXT_PAD, dtype=torch.long)
    audio = torch.full((len(cuts), int(audio_lens.max()), q), AUDIO_PAD, dtype=torch.long)
    for i, c in enumerate(cuts):
        text[i, : len(c["text"])] = c["text"]
        audio[i, : len(c["codes"])] = c["codes"]
    batch = {
        "cut_ids": [c["id"] for c in cuts],
        "text": [" ".join(str(int(x)) for x in c["text"][:8]) for c in cuts],
        "text_tokens": text,
        "text_tokens_lens": text_lens,
        "audio_features": audio,
        "audio_features_lens": audio_lens,
        "durations": audio_lens.float() / 75.0,
    }
    if "language" in cuts[0]:
        batch["text_languages"] = torch.tensor([c["language"] for c in cuts], dtype=torch.long)
    return batch


class SyntheticSampler:
    """Shuffled global batches of `global_batch_size` cuts per epoch.

    partition="rows": rank r gets rows r, r+W, ... of every global batch, so
    world sizes 1 and W see the same global batch per step (equivalence tests).
    partition="batches": rank r gets whole batches r, r+W, ... like lhotse's
    samplers, so ranks may hold different numbers of batches (uneven epochs).
    State = (epoch, batches consumed by this rank).
    """

    def __init__(self, corpus: SyntheticCorpus, global_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True,
                 partition: str = "rows"):
        if partition == "rows" and global_batch_size < world_size:
            raise ValueError("global batch size must be at least the world size")
        self.corpus = corpus
        self.global_batch_size = global_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.partition = seed, shuffle, partition
        self.epoch = 0
        self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def _order(self) -> list[int]:
        n = len(self.corpus)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed * 1000003 + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def rank_batches(self) -> list[list[int]]:
        """This rank's batches (corpus indices) for the current epoch."""
        order = self._order()
        b = self.global_batch_size
        batches = [order[i:i + b] for i in range(0, len(order), b)]
        if self.partition == "batches":
            return batches[self.rank::self.world_size]
        if batches and len(batches[-1]) < self.world_size:
            batches.pop()  # every rank needs at least one row
        return [rows[self.rank::self.world_size] for rows in batches]

    def __len__(self) -> int:
        return len(self.rank_batches())

    def __iter__(self) -> Iterator[Batch]:
        batches = self.rank_batches()
        while self.consumed < len(batches):
            rows = batches[self.consumed]
            self.consumed += 1
            yield collate([self.corpus.cuts[i] for i in rows])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = state["epoch"], state["consumed"]

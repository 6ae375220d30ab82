"""What the loop needs from data, and its two sources: synthetic tokens and lhotse cuts.

The loop sees `TrainData` only. The lhotse source is imported when used, so
`valle.train` stays importable with torch alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from valle.train.batching import Batch
from valle.train.config import TrainConfig
from valle.train.dist import DistContext
from valle.train.sampler_state import pick_rank_state, sampler_payload
from valle.train.synthetic import SyntheticCorpus, SyntheticSampler, SyntheticSpec, collate


class TrainData(Protocol):
    def train_batches(self, epoch: int) -> Iterator[Batch]: ...
    def valid_batches(self) -> Iterator[Batch]: ...
    def pessimistic_batches(self) -> dict[str, Batch]: ...
    def state_dict(self, ctx: DistContext, next_epoch: bool = False) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], ctx: DistContext) -> None: ...
    def steps_hint(self, num_epochs: int) -> int | None: ...
    def take_unreadable(self) -> list[dict[str, str]]: ...


class SyntheticData:
    """Deterministic synthetic cuts (no corpus needed): tests, GPU checks, benchmarks."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext):
        languages = cfg.model.num_languages
        spec = SyntheticSpec(num_cuts=cfg.synthetic_data, seed=cfg.seed, num_languages=languages)
        self.corpus = SyntheticCorpus(spec)
        self.valid = SyntheticCorpus(SyntheticSpec(num_cuts=max(ctx.world_size, 8), seed=cfg.seed + 1,
                                                   num_languages=languages))
        self.sampler = SyntheticSampler(self.corpus, cfg.synthetic_batch_size, ctx.rank,
                                        ctx.world_size, seed=cfg.seed,
                                        partition=cfg.synthetic_partition)
        self.ctx = ctx
        self.per_rank_batch = max(1, cfg.synthetic_batch_size // ctx.world_size)

    def train_batches(self, epoch: int) -> Iterator[Batch]:
        self.sampler.set_epoch(epoch)
        return iter(self.sampler)

    def valid_batches(self) -> Iterator[Batch]:
        cuts = self.valid.cuts[self.ctx.rank::self.ctx.world_size]
        for i in range(0, len(cuts), self.per_rank_batch):
            yield collate(cuts[i:i + self.per_rank_batch])

    def pessimistic_batches(self) -> dict[str, Batch]:
        cuts = self.corpus.cuts
        by_audio = sorted(cuts, key=lambda c: -len(c["codes"]))[: self.per_rank_batch]
        by_text = sorted(cuts, key=lambda c: -len(c["text"]))[: self.per_rank_batch]
        return {"longest audio": collate(by_audio), "longest text": collate(by_text)}

    def state_dict(self, ctx: DistContext, next_epoch: bool = False) -> dict[str, Any]:
        return sampler_payload(self.sampler.state_dict(), ctx, next_epoch, "consumed")

    def load_state_dict(self, state: dict[str, Any], ctx: DistContext) -> None:
        self.sampler.load_state_dict(pick_rank_state(state, ctx))

    def steps_hint(self, num_epochs: int) -> int | None:
        return len(self.sampler) * num_epochs

    def take_unreadable(self) -> list[dict[str, str]]:
        return []  # generated in memory: nothing to fail reading


def build_train_data(cfg: TrainConfig, ctx: DistContext, ar_codebook_size: int = 1024) -> TrainData:
    """``ar_codebook_size``: the model's (--ar-codebook-size); refused when the data's codebook 0
    has more codes."""
    if cfg.synthetic_data > 0:
        if ar_codebook_size < 1024:
            raise ValueError(
                "--synthetic-data draws codebook 0 from all 1024 codes: it needs --ar-codebook-size "
                f"1024, got {ar_codebook_size}"
            )
        return SyntheticData(cfg, ctx)
    from valle.train.lhotse_data import LhotseTrainData  # lhotse is needed only here

    return LhotseTrainData(cfg, ctx, ar_codebook_size)

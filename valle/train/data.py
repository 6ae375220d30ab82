"""What the loop needs from data, and its two sources: synthetic tokens and lhotse cuts.

The loop sees `TrainData` only. The lhotse source is imported when used, so
`valle.train` stays importable with torch alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch.distributed as dist

from valle.train.batching import Batch
from valle.train.config import TrainConfig
from valle.train.dist import DistContext
from valle.train.synthetic import SyntheticCorpus, SyntheticSampler, SyntheticSpec, collate


class TrainData(Protocol):
    def train_batches(self, epoch: int) -> Iterator[Batch]: ...
    def valid_batches(self) -> Iterator[Batch]: ...
    def pessimistic_batches(self) -> dict[str, Batch]: ...
    def state_dict(self, ctx: DistContext, next_epoch: bool = False) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], ctx: DistContext) -> None: ...
    def steps_hint(self, num_epochs: int) -> int | None: ...


def gather_rank_states(local: dict[str, Any], ctx: DistContext) -> list[dict[str, Any]]:
    """Every rank's sampler position (a collective: call on every rank)."""
    if not ctx.distributed:
        return [local]
    if ctx.channel is not None:
        return ctx.channel.gather_objects(local)
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, local, group=ctx.group)
    return out


def sampler_payload(local: dict[str, Any], ctx: DistContext, next_epoch: bool,
                    counter: str) -> dict[str, Any]:
    """The checkpoint's sampler entry: every rank's position (`counter` = batches consumed).
    `next_epoch`: the position at the start of the next epoch (for epoch-N.pt)."""
    if next_epoch:
        local = {**local, "epoch": local["epoch"] + 1, counter: 0}
    return {"per_rank": gather_rank_states(local, ctx), "batch_in_epoch": local[counter]}


def pick_rank_state(state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
    per_rank = state["per_rank"]
    if len(per_rank) != ctx.world_size and state.get("batch_in_epoch", 0) == 0:
        # At an epoch boundary nothing of the old partition matters: any world size may resume.
        fresh = {**per_rank[0], "consumed": 0, "batches_consumed": 0}
        fresh.update({k: v for k, v in (("rank", ctx.rank), ("world_size", ctx.world_size))
                      if k in per_rank[0]})
        return {k: v for k, v in fresh.items() if k in per_rank[0]}
    if len(per_rank) != ctx.world_size:
        raise ValueError(
            f"the checkpoint's sampler state is for {len(per_rank)} rank(s), this run has "
            f"{ctx.world_size}: resume with the same world size, or from an epoch-N.pt checkpoint "
            "(--start-epoch), which starts the epoch afresh")
    return per_rank[ctx.rank]


class SyntheticData:
    """Deterministic synthetic cuts (no corpus needed): tests, GPU checks, benchmarks."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext):
        languages = int(cfg.args.get("num_languages", 0) or 0)
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

"""The checkpoint's sampler entry, for every data source: each rank's position, gathered
when saving and picked (or restarted at an epoch boundary) when resuming."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from valle.train.dist import DistContext


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

"""The control channel: its collectives are right, and they allocate nothing."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_world, values
from valle.train.dist import DistContext
from valle.train.resilience.channel import ControlChannel
from valle.train.resilience.faults import FaultInjector

pytestmark = pytest.mark.timeout(120)


def _channel_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ctx = DistContext(rank, world_size, rank, torch.device("cpu"), dist.group.WORLD)
    # Small object capacity: a long object needs several rounds.
    channel = ControlChannel(ctx, vote_slots=16, int_slots=4, object_bytes=64)
    tensor = torch.full((5,), float(rank))
    census = FaultInjector([], rank)
    census.count_allocations()
    census.phases.begin_attempt(0, 0)
    census.start()
    try:
        # a device-side slot filled in place, as the step does
        channel.device_slots(3, 1).fill_(0.5 * (rank + 1))
        summed = channel.reduce([1.0, float(rank), 2.0], used=4)
        table = channel.gather_ints([rank, 10 * rank, 1 << 60])
        objects = channel.gather_objects({"rank": rank, "text": "x" * (100 + 50 * rank)})
        from_one = channel.broadcast_object({"state": rank}, src=1)
        channel.broadcast_tensors([tensor], src=world_size - 1)
    finally:
        census.stop()
    return {"summed": summed, "table": table, "objects": objects, "from_one": from_one,
            "tensor": tensor.tolist(), "allocations": census.census.get(0, [])}


def test_collectives_are_right_and_allocate_nothing():
    results = values(run_world(_channel_worker, 3, timeout=90))
    for r in results:
        assert r["summed"] == [3.0, 3.0, 6.0, 0.5 + 1.0 + 1.5]
        assert r["table"] == [[0, 0, 1 << 60], [1, 10, 1 << 60], [2, 20, 1 << 60]]
        assert [o["rank"] for o in r["objects"]] == [0, 1, 2]
        assert [len(o["text"]) for o in r["objects"]] == [100, 150, 200]  # several rounds
        assert r["from_one"] == {"state": 1}
        assert r["tensor"] == [2.0] * 5
        # The recovery path must not need memory the failure just exhausted.
        assert r["allocations"] == [], r["allocations"][:5]


def test_one_rank_needs_no_process_group():
    channel = ControlChannel(DistContext())
    assert channel.reduce([1.0, 2.0]) == [1.0, 2.0]
    assert channel.gather_ints([7]) == [[7]]
    assert channel.gather_objects(["a"]) == [["a"]]
    assert channel.broadcast_object("b", 0) == "b"

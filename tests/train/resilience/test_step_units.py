"""Unit tests of the resilient step's parts: batch surgery, fault specs, quarantine,
bucketed gradient sync (views, order, overlap), per-cut seeds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.harness import run_world, values
from valle.train.batching import concat_batches, drop_cuts, split_batch
from valle.train.resilience.faults import FaultInjector, InjectedOutOfMemoryError, parse_fault
from valle.train.resilience.forward_backward import sample_seed
from valle.train.resilience.gradsync import BucketedGradSync
from valle.train.resilience.memory import is_oom_error
from valle.train.resilience.quarantine import Quarantine
from valle.train.synthetic import SyntheticCorpus, SyntheticSpec, collate


@pytest.fixture
def batch():
    corpus = SyntheticCorpus(SyntheticSpec(num_cuts=5, seed=3))
    return collate(corpus.cuts)


def test_split_trims_padding_and_keeps_every_row(batch):
    parts = split_batch(batch, 2)
    assert [p["cut_ids"] for p in parts] == [batch["cut_ids"][:2], batch["cut_ids"][2:]]
    for part in parts:
        assert part["audio_features"].shape[1] == int(part["audio_features_lens"].max())
        assert part["text_tokens"].shape[1] == int(part["text_tokens_lens"].max())
    assert sum(len(p["cut_ids"]) for p in split_batch(batch, 99)) == 5  # capped at one row each


def test_concat_is_the_inverse_of_split(batch):
    joined = concat_batches(split_batch(batch, 3))
    assert joined["cut_ids"] == batch["cut_ids"]
    torch.testing.assert_close(joined["audio_features"], batch["audio_features"])
    torch.testing.assert_close(joined["text_tokens_lens"], batch["text_tokens_lens"])


def test_drop_cuts(batch):
    kept, dropped = drop_cuts(batch, {batch["cut_ids"][1], "not-there"})
    assert dropped == [batch["cut_ids"][1]] and len(kept["cut_ids"]) == 4
    nothing, all_dropped = drop_cuts(batch, set(batch["cut_ids"]))
    assert nothing is None and len(all_dropped) == 5


@pytest.mark.parametrize(("text", "phase", "step", "cut", "ranks"), [
    ("forward@3", "forward", 3, None, None),
    ("backward@0:1,3", "backward", 0, None, frozenset({1, 3})),
    ("to_device@cut=a:b:c", "to_device", None, "a:b:c", None),
    ("optimizer@2x3:1", "optimizer", 2, None, frozenset({1})),
])
def test_parse_fault(text, phase, step, cut, ranks):
    spec = parse_fault(text)
    assert (spec.phase, spec.step, spec.cut_id, spec.ranks) == (phase, step, cut, ranks)


@pytest.mark.parametrize("text", ["forward", "sideways@1", "forward@x", "optimizer@cut=a", "forward@-1"])
def test_parse_fault_rejects_bad_specs_naming_the_flag(text):
    with pytest.raises(ValueError, match="--inject-fault"):
        parse_fault(text)


def test_step_fault_fires_once_on_the_first_attempt_of_its_step_only():
    faults = FaultInjector([parse_fault("forward@2:1")], rank=1)
    faults.phases.begin_attempt(2, 0)
    with pytest.raises(InjectedOutOfMemoryError) as info:
        faults.maybe_fail("forward")
    assert is_oom_error(info.value)
    faults.maybe_fail("forward")  # the recovery path passes the same point
    faults.phases.begin_attempt(2, 1)
    faults.maybe_fail("forward")
    other_rank = FaultInjector([parse_fault("forward@2:1")], rank=0)
    other_rank.phases.begin_attempt(2, 0)
    other_rank.maybe_fail("forward")


def test_cut_fault_fires_whenever_the_cut_is_present():
    faults = FaultInjector([parse_fault("backward@cut=c7")], rank=0)
    for attempt in range(3):
        faults.phases.begin_attempt(5, attempt)
        with pytest.raises(InjectedOutOfMemoryError):
            faults.maybe_fail("backward", ["c1", "c7"])
        faults.maybe_fail("backward", ["c1", "c2"])


def test_quarantine_persists_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "quarantine.jsonl"
    q = Quarantine(path)
    q.add("cut-1", reason="out of memory in forward even alone", step=3, rank=0, duration=12.5)
    q.add("cut-1", reason="again", step=4, rank=0)  # no duplicate line
    with open(path, "a") as f:
        f.write('{"cut_id": "torn')
    again = Quarantine(path)
    assert again.cut_ids == {"cut-1"}
    assert again.entries["cut-1"]["duration"] == 12.5
    assert len(path.read_text().splitlines()) == 2


def test_sample_seed_depends_on_seed_step_and_cut_only():
    assert sample_seed(1, 2, "a") == sample_seed(1, 2, "a")
    assert len({sample_seed(1, 2, "a"), sample_seed(1, 3, "a"), sample_seed(2, 2, "a"),
                sample_seed(1, 2, "b")}) == 4
    assert 0 <= sample_seed(7, 7, "x") < 2**63


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def test_grads_are_views_of_the_buckets_and_survive_zeroing():
    model = _mlp()
    sync = BucketedGradSync(list(model.parameters()), world_size=1, bucket_cap_mb=0.0005)
    assert len(sync.buckets) > 1
    model(torch.randn(3, 8)).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    flat = torch.cat([b.buffer for b in reversed(sync.buckets)])
    assert flat.abs().sum() > 0
    sync.zero_grad()
    assert all(p.grad is not None and p.grad._base is not None for p in model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    assert not all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    model[0].weight.grad = None  # breaking the views is detected, not silently tolerated
    with pytest.raises(RuntimeError, match="view"):
        sync.zero_grad()


def _overlap_worker(rank: int, world_size: int) -> dict:
    from valle.train.dist import init_distributed

    ctx = init_distributed("cpu", 30)
    model = _mlp()
    events: list[tuple[str, int]] = []
    in_backward = {"now": False}

    def on_launch(index: int) -> None:
        events.append(("during" if in_backward["now"] else "after", index))

    sync = BucketedGradSync(list(model.parameters()), world_size=world_size, group=ctx.group,
                            mode="overlap", bucket_cap_mb=0.0005, on_launch=on_launch)
    sync.zero_grad()
    torch.manual_seed(rank)
    inputs = torch.randn(4, 8)
    reference = _mlp()  # same weights, plain autograd: this rank's local gradient
    reference(inputs).sum().backward()
    local = [p.grad.clone() for p in reference.parameters()]
    loss = model(inputs).sum()
    with sync.backward_context(last_micro_batch=True):
        in_backward["now"] = True
        loss.backward()
        in_backward["now"] = False
    sync.launch_remaining()
    sync.wait()
    return {"events": events, "grads": [p.grad.clone() for p in model.parameters()], "local": local,
            "buckets": len(sync.buckets)}


@pytest.mark.timeout(120)
def test_overlap_launches_buckets_in_order_during_backward_and_sums():
    ranks = values(run_world(_overlap_worker, 2, timeout=90))
    for r in ranks:
        order = [i for _, i in r["events"]]
        assert order == list(range(r["buckets"]))  # every bucket once, in bucket order
        assert r["events"][0][0] == "during", "the first bucket must launch inside backward"
    # all-reduced gradient = sum of the two ranks' local gradients, identical on both
    for g0, g1, l0, l1 in zip(ranks[0]["grads"], ranks[1]["grads"], ranks[0]["local"], ranks[1]["local"]):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)
        torch.testing.assert_close(g0, l0 + l1)


def test_allocator_config_respects_the_user(monkeypatch):
    from valle.train.resilience.memory import configure_allocator

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # recorded, so whatever the test sets is undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert configure_allocator() == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert configure_allocator() == "expandable_segments:True"
    import os

    assert "expandable_segments:True" in (os.environ.get("PYTORCH_ALLOC_CONF", "")
                                          + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))

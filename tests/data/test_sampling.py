"""The sampler never exceeds the text-token or duration budget."""

import gc
import random

import pytest
from lhotse import CutSet, SupervisionSegment
from lhotse.dataset import DynamicBucketingSampler
from lhotse.testing.dummies import dummy_cut

from valle.data.sampling import BudgetedSampler, TextTokenConstraint


def make_cuts(n=300, seed=0):
    rng = random.Random(seed)
    cuts = []
    for i in range(n):
        duration = round(rng.uniform(0.5, 6.0), 2)
        # Text length loosely tied to duration, with outliers (long text in short audio).
        tokens = int(duration * 12) if rng.random() > 0.1 else int(duration * 45)
        cut = dummy_cut(i, duration=duration)
        cut.supervisions = [SupervisionSegment(
            id=f"sup{i}", recording_id=cut.recording_id, start=0, duration=duration,
            text="x", custom={"tokens": {"text": ["a"] * tokens}, "num_text_tokens": tokens})]
        cuts.append(cut)
    return CutSet.from_cuts(cuts)


def _check(constraint, quadratic=None):
    cuts = make_cuts()
    sampler = DynamicBucketingSampler(cuts, constraint=constraint, num_buckets=4, shuffle=True, seed=3)
    budgeted = BudgetedSampler(sampler, constraint)
    seen = []
    for batch in budgeted:
        batch = list(batch)
        lens = [c.supervisions[0].custom["num_text_tokens"] + 2 for c in batch]
        assert sum(lens) <= constraint.max_text_tokens
        assert len(batch) * max(lens) <= constraint.max_text_tokens
        eff = [c.duration + (c.duration ** 2 / quadratic if quadratic else 0) for c in batch]
        assert len(batch) * max(eff) <= constraint.max_duration + 1e-6
        seen += [c.id for c in batch]
    assert sorted(seen) == sorted(c.id for c in cuts)  # splitting loses nothing
    return budgeted


def test_batches_respect_text_token_budget():
    constraint = TextTokenConstraint(max_duration=30.0, max_text_tokens=300)
    budgeted = _check(constraint)
    # The outliers (long text in short audio) push some of lhotse's batches over the budget:
    # each such batch, and only those, is split (so the split path above was exercised).
    raw = DynamicBucketingSampler(make_cuts(), constraint=constraint.copy(), num_buckets=4, shuffle=True, seed=3)
    over_budget = sum(not constraint.fits(list(batch)) for batch in raw)
    assert over_budget > 0
    assert budgeted.num_splits == over_budget


def test_batches_respect_budget_with_quadratic_duration():
    _check(TextTokenConstraint(max_duration=40.0, max_text_tokens=400, quadratic_duration=10.0), quadratic=10.0)


def test_constraint_state_roundtrip_and_split():
    c = TextTokenConstraint(max_duration=10.0, max_text_tokens=50)
    cuts = list(make_cuts(6))
    for cut in cuts[:2]:
        c.add(cut)
    clone = TextTokenConstraint()
    clone.load_state_dict(c.state_dict())
    assert clone.state_dict() == c.state_dict()
    parts = c.split(cuts)
    assert sum(len(p) for p in parts) == 6 and all(c.fits(p) or len(p) == 1 for p in parts)


class _CollectorWatcher:
    """A stand-in for lhotse's sampler that notes, at each batch it makes, whether Python's
    automatic garbage collection was on; ``fail_first`` raises where the buffer would fill."""

    def __init__(self, batches, fail_first=False):
        self.batches, self.fail_first, self.collector_on = batches, fail_first, []

    def __iter__(self):
        for batch in self.batches:
            self.collector_on.append(gc.isenabled())
            if self.fail_first:
                raise OSError("unreadable manifest")
            yield batch


def test_the_buffer_fill_runs_with_the_collector_paused_and_training_with_it_on():
    cuts = list(make_cuts(n=6))
    inner = _CollectorWatcher([cuts[:2], cuts[2:4], cuts[4:]])
    sampler = BudgetedSampler(inner, TextTokenConstraint(max_duration=30.0, max_text_tokens=300))
    drawn = [[c.id for c in batch] for batch in sampler]
    assert drawn == [[c.id for c in cuts[i:i + 2]] for i in (0, 2, 4)]
    assert inner.collector_on == [False, True, True]  # paused only while the first batch is made
    assert gc.isenabled()


def test_the_collector_comes_back_when_the_fill_fails_and_stays_off_if_it_was_off():
    sampler = BudgetedSampler(_CollectorWatcher([list(make_cuts(n=2))], fail_first=True),
                              TextTokenConstraint(max_duration=30.0, max_text_tokens=300))
    with pytest.raises(OSError, match="unreadable manifest"):
        next(iter(sampler))
    assert gc.isenabled()
    gc.disable()
    try:
        list(BudgetedSampler(_CollectorWatcher([list(make_cuts(n=2))]),
                             TextTokenConstraint(max_duration=30.0, max_text_tokens=300)))
        assert not gc.isenabled()  # a caller that turned it off keeps it off
    finally:
        gc.enable()

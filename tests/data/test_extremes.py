"""valle.data.extremes: the bounded, order-independent record of a part's worst cuts, and the
tokenizer writing it next to the cuts file."""

from __future__ import annotations

import itertools
import json
import random

from lhotse import CutSet, MonoCut, SupervisionSegment

from valle.data.extremes import BIN_SECONDS, CRITERIA, Extremes, extremes_path


def text_cut(cut_id: str, duration: float, tokens: int) -> MonoCut:
    """A tokenized cut's metadata (no audio: the record never reads it)."""
    sup = SupervisionSegment(id=cut_id, recording_id=cut_id, start=0, duration=duration,
                             custom={"tokens": {"text": ["a"] * tokens}, "num_text_tokens": tokens})
    return MonoCut(id=cut_id, start=0, duration=duration, channel=0, supervisions=[sup])


def random_cuts(n: int, seed: int = 0) -> list[MonoCut]:
    rng = random.Random(seed)
    return [text_cut(f"c{i:05d}", round(rng.uniform(0.5, 20.0), 2), rng.randint(3, 300)) for i in range(n)]


def test_merge_gives_the_same_record_in_any_order():
    cuts = random_cuts(600)
    chunks = [cuts[i:i + 100] for i in range(0, len(cuts), 100)]
    small = {"k": 2, "sample_size": 50}
    whole = Extremes.of(cuts, **small).to_json()
    for order in itertools.islice(itertools.permutations(range(len(chunks))), 0, 720, 97):
        merged = Extremes(**small)
        for i in order:
            merged.merge(Extremes.of(chunks[i], **small))
        assert merged.to_json() == whole
    # tree-shaped merges, through json (as worker metas travel), agree too
    left = Extremes.from_json(Extremes.of(cuts[:250], **small).to_json())
    right = Extremes.from_json(Extremes.of(cuts[250:], **small).to_json())
    assert right.merge(left).to_json() == whole


def test_record_holds_the_worst_cuts_per_bin_and_stays_bounded():
    cuts = random_cuts(3000, seed=1)
    record = Extremes.of(cuts, k=3, sample_size=100)
    assert record.count == 3000 and abs(record.seconds - sum(c.duration for c in cuts)) < 1e-6
    longest = max(cuts, key=lambda c: (c.duration, num(c)))
    assert record.entries("longest")[0].cut_id == longest.id
    assert record.entries("longest_text")[0].text_tokens == max(num(c) for c in cuts)
    assert record.entries("shortest")[0].duration == min(c.duration for c in cuts)
    densest = max(cuts, key=lambda c: (num(c) + 2) / c.duration)
    assert record.entries("densest")[0].cut_id == densest.id
    # below any duration bound, the longest cut is in the record, or its bin's kept cuts are
    # all longer than the bound (one of them, cut down to the bound, is at least as long)
    for bound in (5.3, 12.0, 17.77):
        truth = max(c.duration for c in cuts if c.duration <= bound)
        recorded = max(e.duration for e in record.entries("longest") if e.duration <= bound)
        kept_in_bin = record.bins[int(truth / BIN_SECONDS)].best["longest"]
        assert recorded == truth or all(e.duration > bound for e in kept_in_bin)
    # bounded: bins x criteria x k cuts, a fixed-size sample
    assert len(record.all_entries()) <= len(record.bins) * len(CRITERIA) * 3
    assert len(record.bins) <= 20 / BIN_SECONDS + 1
    assert len(record.sample_pairs()) == 100
    # the sample is a sample of the whole part, not its head
    assert max(d for d, _t in record.sample_pairs()) > 15 and min(d for d, _t in record.sample_pairs()) < 5
    again = Extremes.from_json(json.loads(json.dumps(record.to_json())))
    assert again.to_json() == record.to_json()
    assert again.entries("longest")[0].cut["id"] == longest.id  # the full cut dict travels


def num(cut) -> int:
    return cut.supervisions[0].custom["num_text_tokens"]


def test_a_tokenized_part_gets_its_extremes_file(tiny_data):
    for part in ("train", "dev"):
        path = extremes_path(tiny_data, "tiny", part)
        assert path.name == f"tiny_extremes_{part}.json"
        record = Extremes.read(path)
        cuts = list(CutSet.from_file(tiny_data / f"tiny_cuts_{part}.jsonl.gz"))
        assert record.count == len(cuts)
        assert record.entries("longest")[0].duration == max(c.duration for c in cuts)
        assert record.entries("longest_text")[0].text_tokens == max(num(c) for c in cuts)


def test_the_tokenizer_joins_chunk_records_into_the_part_record(tmp_path, tokenizer_cli):
    """Chunks of 2 cuts: each chunk's meta carries its record, the join merges them."""
    from test_tokenizer_scale import _argv, _manifests

    man = _manifests(tmp_path, items=[("en", "Hello there."), ("en", "A longer sentence for the test."),
                                      ("en", "Short."), ("en", "One more line.")], prefix="ml")
    out = tmp_path / "out"
    assert tokenizer_cli.main(_argv(man, out, "--chunk-size", "2")) == 0
    record = Extremes.read(extremes_path(out, "ml", "test"))
    cuts = list(CutSet.from_file(out / "ml_cuts_test.jsonl.gz"))
    assert record.count == len(cuts) == 4
    assert record.entries("longest_text")[0].text_tokens == max(num(c) for c in cuts)
    assert {e.cut_id for e in record.all_entries()} == {c.id for c in cuts}

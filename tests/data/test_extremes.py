"""valle.data.extremes: the bounded, order-independent record of a part's extreme cuts, and
the tokenizer writing it next to the cuts file."""

from __future__ import annotations

import itertools
import json
import random

from lhotse import CutSet, MonoCut, SupervisionSegment

from valle.data.extremes import BIN_SECONDS, FRONTIERS, Extremes, duration_bin, extremes_path


def text_cut(cut_id: str, duration: float, tokens: int) -> MonoCut:
    """A tokenized cut's metadata (no audio: the record never reads it)."""
    sup = SupervisionSegment(id=cut_id, recording_id=cut_id, start=0, duration=duration,
                             custom={"tokens": {"text": ["a"] * tokens}, "num_text_tokens": tokens})
    return MonoCut(id=cut_id, start=0, duration=duration, channel=0, supervisions=[sup])


def random_cuts(n: int, seed: int = 0) -> list[MonoCut]:
    rng = random.Random(seed)
    return [text_cut(f"c{i:05d}", round(rng.uniform(0.5, 20.0), 2), rng.randint(3, 300)) for i in range(n)]


def num(cut) -> int:
    return cut.supervisions[0].custom["num_text_tokens"]


def test_merge_gives_the_same_record_in_any_order():
    cuts = random_cuts(600)
    cuts.append(text_cut("dup", cuts[0].duration, num(cuts[0])))  # an exact tie in both numbers
    chunks = [cuts[i:i + 100] for i in range(0, len(cuts), 100)]
    whole = Extremes.of(cuts, sample_size=50).to_json()
    for order in itertools.islice(itertools.permutations(range(len(chunks))), 0, 5040, 97):
        merged = Extremes(sample_size=50)
        for i in order:
            merged.merge(Extremes.of(chunks[i], sample_size=50))
        assert merged.to_json() == whole
    # tree-shaped merges, through json (as worker metas travel), agree too
    left = Extremes.from_json(Extremes.of(cuts[:250], sample_size=50).to_json())
    right = Extremes.from_json(Extremes.of(cuts[250:], sample_size=50).to_json())
    assert right.merge(left).to_json() == whole


def test_each_bin_keeps_the_frontiers_that_bound_every_cut():
    cuts = random_cuts(3000, seed=1)
    record = Extremes.of(cuts, sample_size=100)
    assert record.count == 3000 and abs(record.seconds - sum(c.duration for c in cuts)) < 1e-6
    assert record.entries("longest")[0].duration == max(c.duration for c in cuts)
    assert record.entries("longest_text")[0].text_tokens == max(num(c) for c in cuts)
    assert record.entries("shortest")[0].duration == min(c.duration for c in cuts)
    # every cut is matched or beaten in both of a frontier's numbers by a cut of its bin
    for cut in cuts:
        b = record.bins[duration_bin(cut.duration)]
        for name, goal in FRONTIERS.items():
            mine = goal(type("E", (), {"duration": cut.duration, "text_tokens": num(cut)})())
            assert any(goal(e)[0] >= mine[0] and goal(e)[1] >= mine[1] for e in b.best[name]), (cut.id, name)
    # bounded: a handful per bin, a fixed-size sample
    per_bin = max(len({e.cut_id for es in b.best.values() for e in es}) for b in record.bins.values())
    assert per_bin <= 40 and len(record.bins) <= 20 / BIN_SECONDS + 1
    assert len(record.sample_pairs()) == 100
    # the sample is a sample of the whole part, not its head
    assert max(d for d, _t in record.sample_pairs()) > 15 and min(d for d, _t in record.sample_pairs()) < 5
    again = Extremes.from_json(json.loads(json.dumps(record.to_json())))
    assert again.to_json() == record.to_json()
    longest = again.entries("longest")[0]
    assert longest.cut["id"] == longest.cut_id  # the full cut dict travels


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
    # written after the cuts file: the trainer takes an older record for a stale one
    assert extremes_path(out, "ml", "test").stat().st_mtime >= (out / "ml_cuts_test.jsonl.gz").stat().st_mtime


def test_recipe_steps_write_the_records_of_the_parts_they_make(tiny_data, tmp_path):
    from valle.data import recipe

    out = tmp_path / "out"
    out.mkdir()
    both = out / "x_cuts_both.jsonl.gz"
    recipe.combine(both, [tiny_data / "tiny_cuts_train.jsonl.gz", tiny_data / "tiny_cuts_dev.jsonl.gz",
                          tiny_data / "tiny_cuts_dev.jsonl.gz"])  # dev twice: dropped, not counted
    recipe.split(both, out, "y", num_dev=3, num_test=2)
    for prefix, part in (("x", "both"), ("y", "train"), ("y", "dev"), ("y", "test")):
        cuts = CutSet.from_file(out / f"{prefix}_cuts_{part}.jsonl.gz")
        written = Extremes.read(extremes_path(out, prefix, part)).to_json()
        assert written == Extremes.of(cuts).to_json(), (prefix, part)


def test_the_record_of_an_older_corpus_is_written_by_one_command(tiny_data, tmp_path, capsys):
    from valle.data import recipe

    old = tmp_path / "old"
    old.mkdir()
    (old / "tiny_cuts_train.jsonl.gz").symlink_to(tiny_data / "tiny_cuts_train.jsonl.gz")
    assert recipe.main(["extremes", str(old / "tiny_cuts_train.jsonl.gz")]) == 0
    written = Extremes.read(extremes_path(old, "tiny", "train")).to_json()
    assert written == Extremes.read(extremes_path(tiny_data, "tiny", "train")).to_json()
    # `recipe shar` puts the record beside the shard dir, where --shar-dir looks for it
    assert recipe.main(["shar", str(old / "tiny_cuts_train.jsonl.gz"), str(tmp_path / "shar" / "train"),
                        "--shard-size", "8"]) == 0
    assert Extremes.read(tmp_path / "shar" / "tiny_extremes_train.json").to_json() == written

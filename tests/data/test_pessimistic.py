"""The pessimistic batches from the extremes record: as bad as the old pass finds, and found
without reading the manifest, even when the worst cut hides deep in it."""

from __future__ import annotations

import argparse
import gzip
import json
import os

import pytest
from lhotse import CutSet
from lhotse.lazy import LazyJsonlIterator

from valle.data.datamodule import TtsDataModule, add_data_flags
from valle.data.extremes import Extremes, extremes_path
from valle.data.pessimistic import CRITERIA, worst_of

FLAGS = ["--max-duration", "6", "--max-text-tokens", "120", "--num-buckets", "2", "--num-workers", "0"]


def make_dm(manifest_dir, *extra):
    parser = argparse.ArgumentParser()
    add_data_flags(parser)
    args = parser.parse_args(["--manifest-dir", str(manifest_dir), "--dataset", "tiny", *FLAGS, *extra])
    return TtsDataModule.from_flags(args)


def pass_scores(dm) -> dict[str, float]:
    """What the old scan found: the worst of this rank's batches, by a pass."""
    batches, _dataset = dm.scan_batches(0, 1)
    return {name: value for name, (value, _cuts) in worst_of(batches).items()}


@pytest.mark.parametrize("extra", [
    [],
    ["--quadratic-duration", "3"],
    ["--max-text-tokens", "60", "--max-duration", "12"],
    ["--filter-max-duration", "1.9"],  # a bound inside a duration bin of the record
])
def test_record_batches_are_at_least_as_bad_as_the_pass_finds(tiny_data, extra):
    dm = make_dm(tiny_data, *extra)
    worst = dm.worst_batches()
    assert set(worst) == set(CRITERIA)
    truth = pass_scores(make_dm(tiny_data, *extra))
    constraint = dm.constraint()
    for name, (value, cuts) in worst.items():
        assert value >= truth[name] - 1e-9, (name, value, truth[name])
        assert CRITERIA[name](cuts) == pytest.approx(value)
        assert constraint.fits(cuts), name  # a batch the sampler may form: within budget
        assert all(c.duration <= dm.cfg.filter_max_duration + 1e-9 for c in cuts)
        assert len({c.id for c in cuts}) == len(cuts)


def test_scan_batches_collate_as_training_batches(tiny_data):
    dm = make_dm(tiny_data)
    dataset = dm.train_dataloader(0, 1).dataset
    for name, (_value, cuts) in dm.worst_batches().items():
        batch = dataset[cuts]
        assert len(batch["cut_ids"]) == len(cuts) and "unreadable" not in batch, name
        assert batch["audio_features"].shape[0] == len(cuts)


def _write_big_manifest(tiny_data, out, num_cuts: int, hide: dict[int, str]) -> dict[str, str]:
    """``num_cuts`` copies of the ordinary tiny cuts (shared codes), with the longest-audio
    and longest-text cuts placed only at the positions in ``hide``. Returns their ids."""
    with gzip.open(tiny_data / "tiny_cuts_train.jsonl.gz", "rt") as f:
        base = [json.loads(line) for line in f]
    longest = max(base, key=lambda d: d["duration"])
    pool = [d for d in base if d["duration"] < longest["duration"]]
    wordy = dict(pool[0])
    sup = dict(wordy["supervisions"][0])
    text = sup["custom"]["tokens"]["text"] * 3  # three times the text: the longest by far
    sup["custom"] = dict(sup["custom"], tokens={"text": text}, num_text_tokens=len(text))
    wordy["supervisions"] = [sup]
    special = {"longest": longest, "wordy": wordy}
    out.mkdir()
    for f in tiny_data.iterdir():
        if not f.name.startswith("tiny_cuts_train") and not f.name.startswith("tiny_extremes_train"):
            (out / f.name).symlink_to(f)
    ids = {}
    with gzip.open(out / "tiny_cuts_train.jsonl.gz", "wt", compresslevel=1) as f:
        for i in range(num_cuts):
            d = dict(special[hide[i]] if i in hide else pool[i % len(pool)])
            d["id"] = f"{d['id']}-{i:06d}"
            d["supervisions"] = [dict(d["supervisions"][0], id=d["id"])]
            if i in hide:
                ids[hide[i]] = d["id"]
            f.write(json.dumps(d) + "\n")
    # what bin/tokenizer.py writes at its join (the tokenizer saw every cut anyway)
    Extremes.of(CutSet.from_jsonl_lazy(out / "tiny_cuts_train.jsonl.gz")).write(
        extremes_path(out, "tiny", "train"))
    return ids


@pytest.mark.timeout(300)
def test_worst_cuts_deep_in_a_large_manifest_are_found_without_reading_it(tiny_data, tmp_path, monkeypatch):
    big = tmp_path / "big"
    hidden = _write_big_manifest(tiny_data, big, 50_000, {45_000: "longest", 45_500: "wordy"})
    manifest = str(big / "tiny_cuts_train.jsonl.gz")
    reads = {"lines": 0}
    real_iter = LazyJsonlIterator.__iter__

    def counting_iter(self):
        for item in real_iter(self):
            if os.fspath(self.path) == manifest:
                reads["lines"] += 1
            yield item

    monkeypatch.setattr(LazyJsonlIterator, "__iter__", counting_iter)
    dm = make_dm(big, "--max-text-tokens", "400")
    loader = dm.train_dataloader(0, 1)  # sampler, bucket bins, filters: as the trainer starts
    worst = dm.worst_batches()
    assert reads["lines"] == 0  # not one line of the manifest was read
    assert worst["single_longest_cut"][1][0].id == hidden["longest"]
    assert worst["single_longest_text"][1][0].id == hidden["wordy"]
    assert dm.filter_report.checked == 50_000
    batch = loader.dataset[worst["single_longest_text"][1]]
    assert int(batch["text_tokens_lens"].max()) == worst["single_longest_text"][0] + 2  # bos/eos

"""Unreadable data in the middle of an epoch: a cut whose codes cannot be read is
reported by id with its file and error, skipped, and counted (drawn = trained +
quarantined + skipped); too many stop every rank with a clear message; a missing Shar
shard is reported and the other shards train."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from pathlib import Path

import pytest
from test_datamodule import ids_of, make_dm

from tests.support.harness import run_world
from tests.support.scenarios import TINY_MODEL, train_worker


@pytest.fixture(scope="module")
def damaged(tiny_data, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A copy of the tiny corpus where two training cuts cannot be read: one's codes file
    is gone, the other's entry in its HDF5 file does not exist."""
    copy = tmp_path_factory.mktemp("damaged") / "tokenized"
    shutil.copytree(tiny_data, copy)
    manifest = copy / "tiny_cuts_train.jsonl.gz"
    cuts = [json.loads(line) for line in gzip.open(manifest, "rt")]
    gone, corrupt = cuts[1], cuts[4]
    gone["features"]["storage_path"] = str(copy / "codes-that-were-deleted.h5")
    corrupt["features"]["storage_key"] = "no-such-entry"
    with gzip.open(manifest, "wt") as f:
        f.writelines(json.dumps(c) + "\n" for c in cuts)
    return copy, {gone["id"]: "codes-that-were-deleted.h5",
                  corrupt["id"]: Path(corrupt["features"]["storage_path"]).name}


def test_unreadable_cuts_leave_their_batch_and_are_named_with_file_and_error(damaged):
    data, bad = damaged
    batches = list(make_dm(data).train_dataloader(0, 1))
    unreadable = [entry for b in batches for entry in b.get("unreadable", [])]
    assert sorted(e["cut_id"] for e in unreadable) == sorted(bad)
    for entry in unreadable:
        assert Path(entry["file"]).name == bad[entry["cut_id"]]
        assert entry["error"]  # the storage's own message
    trained = ids_of(batches)
    assert not set(bad) & set(trained)
    assert len(trained) + len(bad) == len(set(trained)) + len(bad)  # nothing twice


def trainer_argv(data: Path, exp: Path, *extra: str) -> list[str]:
    return [*TINY_MODEL, "--manifest-dir", str(data), "--dataset", "tiny", "--exp-dir", str(exp),
            "--num-epochs", "2", "--max-duration", "6", "--num-workers", "0", "--train-stage", "1",
            "--valid-interval", "1000", "--save-every-n", "1000", *extra]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_two_ranks_skip_and_count_unreadable_cuts_every_epoch(damaged, tmp_path):
    data, bad = damaged
    exp = tmp_path / "exp"
    results = run_world(train_worker, 2, trainer_argv(data, exp), timeout=240)
    assert all(r[0] == "ok" and r[1]["ok"] for r in results), results
    for epoch in (1, 2):
        records = [json.loads((exp / f"epoch-{epoch}-summary-rank{r}.json").read_text())
                   for r in (0, 1)]
        record = records[0]
        assert record["balanced"] and record["cuts_skipped"] == len(bad)
        assert record["cuts_drawn"] == record["cuts_trained"] + record["cuts_skipped"]
        assert {c for r in records for c in r["skipped_ids"]} == set(bad)
    listed = [json.loads(line) for r in (0, 1) if (exp / f"unreadable-rank{r}.jsonl").exists()
              for line in (exp / f"unreadable-rank{r}.jsonl").read_text().splitlines()]
    assert sorted(e["cut_id"] for e in listed) == sorted([*bad, *bad])  # once per epoch
    log = "".join(p.read_text() for p in (exp / "log").glob("log-train-*"))
    for cut_id, file in bad.items():
        assert f"cut {cut_id} skipped: its codes cannot be read from" in log and file in log


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_too_many_unreadable_cuts_stop_every_rank_with_a_clear_message(damaged, tmp_path):
    data, _ = damaged
    results = run_world(train_worker, 2,
                        trainer_argv(data, tmp_path / "exp", "--max-unreadable-cuts", "1"),
                        timeout=240)
    # both ranks stop at the same step (the votes sum the counts), neither waits for the other
    for result in results:
        assert result[0] == "error", result
        assert "UnreadableDataError" in result[2] and "--max-unreadable-cuts 1" in result[1]


def test_a_missing_shar_shard_is_reported_and_the_rest_trains(tiny_data, tmp_path, caplog):
    from valle.data.pipeline import export_shar
    from valle.data.shar import find_shards

    shar = tmp_path / "shar"
    export_shar(tiny_data / "tiny_cuts_train.jsonl.gz", shar, 4)
    lost = sorted(shar.glob("features.*.tar"))[1]
    lost_ids = {json.loads(line)["id"]
                for line in gzip.open(str(lost).replace("features", "cuts").replace(".tar", ".jsonl.gz"), "rt")}
    lost.unlink()
    with caplog.at_level(logging.WARNING):
        shards = find_shards(str(shar))
    assert "shard 000001 has cuts.000001.jsonl.gz but not its features file" in caplog.text
    assert all("000001" not in s["features"] for s in shards)
    trained = ids_of(make_dm(tiny_data, "--shar-dir", str(shar)).train_dataloader(0, 1))
    everything = {json.loads(line)["id"] for line in gzip.open(tiny_data / "tiny_cuts_train.jsonl.gz", "rt")}
    assert set(trained) == everything - lost_ids and lost_ids

"""Datamodule on the tiny corpus: batches, prompts, filters, and mid-epoch resume."""

import argparse

import pytest
import torch
from lhotse import CutSet

from valle.data.datamodule import TtsDataModule, add_data_flags
from valle.data.validation import NoCutsLeftError


def make_dm(tiny_data, *extra, **attrs):
    parser = argparse.ArgumentParser()
    add_data_flags(parser)
    args = parser.parse_args(["--manifest-dir", str(tiny_data), "--dataset", "tiny", "--max-duration", "6",
                              "--max-text-tokens", "120", "--num-buckets", "2", "--num-workers", "0", *extra])
    args.seed = 7
    for k, v in attrs.items():
        setattr(args, k, v)
    return TtsDataModule.from_flags(args)


def ids_of(batches):
    return [i for b in batches for i in b["cut_ids"]]


def test_batch_contract_and_prompts(tiny_data):
    dm = make_dm(tiny_data, prefix_mode=4)
    loader = dm.train_dataloader(0, 1)
    speaker = {c.id: c.supervisions[0].speaker for c in CutSet.from_file(tiny_data / "tiny_cuts_train.jsonl.gz")}
    n = 0
    for batch in loader:
        n += 1
        b = len(batch["cut_ids"])
        assert batch["text_tokens"].shape[0] == b and batch["text_tokens"].dtype == torch.long
        assert batch["audio_features"].shape[0] == b and batch["audio_features"].shape[2] == 8
        lens = batch["audio_features_lens"]
        assert int(lens.max()) == batch["audio_features"].shape[1]
        for i in range(b):
            assert (batch["audio_features"][i, lens[i]:] == 1024).all()
            assert (batch["audio_features"][i, : lens[i]] < 1024).all()
            assert abs(int(lens[i]) - float(batch["durations"][i]) * 75) <= 1
        assert int(batch["text_tokens_lens"].max()) * b <= 120
        assert (batch["prompt_features_lens"] <= 225).all() and batch["prompt_features"].shape[0] == b
        assert all(cid in speaker for cid in batch["cut_ids"])
    assert n > 1
    again = next(iter(make_dm(tiny_data, prefix_mode=4).train_dataloader(0, 1)))
    first = next(iter(loader))
    assert first["cut_ids"] == again["cut_ids"]
    assert torch.equal(first["prompt_features"], again["prompt_features"])  # deterministic choice


def test_prefix_mode_4_refuses_shar(tiny_data, tmp_path):
    dm = make_dm(tiny_data, "--shar-dir", str(tmp_path), prefix_mode=4)
    with pytest.raises(ValueError, match="--prefix-mode 4 needs a cut manifest"):
        dm.train_dataloader(0, 1)


def _resume_check(tiny_data, rank, world_size, consumed, *extra):
    full = make_dm(tiny_data, *extra).train_dataloader(rank, world_size)
    full.set_epoch(1)
    reference = ids_of(full)

    dm = make_dm(tiny_data, *extra)
    loader = dm.train_dataloader(rank, world_size)
    loader.set_epoch(1)
    head = []
    for batch in loader:
        head.append(batch)
        if len(head) == consumed:
            break
    state = dm.sampler_state()
    assert state["batches_consumed"] == consumed and state["epoch"] == 1

    resumed = make_dm(tiny_data, *extra).train_dataloader(rank, world_size, sampler_state=state)
    tail = ids_of(resumed)
    assert ids_of(head) + tail == reference  # nothing repeated, nothing skipped, same order
    return reference


def test_restore_mid_epoch_with_rank_partitioning(tiny_data):
    per_rank = [_resume_check(tiny_data, rank, 2, 1) for rank in range(2)]
    everything = per_rank[0] + per_rank[1]
    assert len(everything) == len(set(everything))  # ranks are disjoint
    train = {c.id for c in CutSet.from_file(tiny_data / "tiny_cuts_train.jsonl.gz")}
    assert set(everything) == train


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_restore_with_prefetching_workers(tiny_data):
    # Workers prefetch batches ahead of the trainer; the state must count consumed batches only.
    _resume_check(tiny_data, 0, 1, 2, "--num-workers", "2")


def test_restore_rejects_another_world_size(tiny_data):
    dm = make_dm(tiny_data)
    loader = dm.train_dataloader(0, 2)
    next(iter(loader))
    with pytest.raises(ValueError, match="world size 2"):
        make_dm(tiny_data).train_dataloader(0, 1, sampler_state=dm.sampler_state())


@pytest.fixture(scope="module")
def tiny_shar(tiny_data, tmp_path_factory):
    from valle.data.pipeline import export_shar

    shar = tmp_path_factory.mktemp("shar")
    export_shar(tiny_data / "tiny_cuts_train.jsonl.gz", shar, 8)
    return shar


def _state_after_one_batch(dm):
    next(iter(dm.train_dataloader(0, 1)))
    return dm.sampler_state()


def test_restore_mid_epoch_from_shar_shards(tiny_data, tiny_shar):
    reference = _resume_check(tiny_data, 0, 1, 1, "--shar-dir", str(tiny_shar))
    assert len(reference) == len(set(reference)) > 1


def test_a_sampler_state_resumes_only_the_data_source_that_saved_it(tiny_data, tiny_shar):
    """--manifest-dir and --shar-dir deal cuts differently: a mid-epoch position of one would
    silently resume the other at an unrelated place. Both ways are refused, naming the flags."""
    manifest_state = _state_after_one_batch(make_dm(tiny_data))
    shar_state = _state_after_one_batch(make_dm(tiny_data, "--shar-dir", str(tiny_shar)))
    assert (manifest_state["source"], shar_state["source"]) == ("manifest", "shar")
    assert manifest_state["batches_consumed"] == shar_state["batches_consumed"] == 1

    with pytest.raises(ValueError, match="saved mid-epoch training from --manifest-dir; this run trains "
                                         "from --shar-dir"):
        make_dm(tiny_data, "--shar-dir", str(tiny_shar)).train_dataloader(0, 1, sampler_state=manifest_state)
    with pytest.raises(ValueError, match="saved mid-epoch training from --shar-dir; this run trains "
                                         "from --manifest-dir"):
        make_dm(tiny_data).train_dataloader(0, 1, sampler_state=shar_state)
    # States written before the "source" field: a Shar one said "shar": True, a manifest one nothing.
    legacy_shar = {k: v for k, v in shar_state.items() if k != "source"} | {"shar": True}
    with pytest.raises(ValueError, match="from --shar-dir; this run trains from --manifest-dir"):
        make_dm(tiny_data).train_dataloader(0, 1, sampler_state=legacy_shar)
    legacy_manifest = {k: v for k, v in manifest_state.items() if k != "source"}
    with pytest.raises(ValueError, match="from --manifest-dir; this run trains from --shar-dir"):
        make_dm(tiny_data, "--shar-dir", str(tiny_shar)).train_dataloader(0, 1, sampler_state=legacy_manifest)

    # At an epoch boundary (epoch-N.pt) no position is kept: either source starts that epoch.
    boundary = {**manifest_state, "epoch": 3, "batches_consumed": 0}
    resumed = make_dm(tiny_data, "--shar-dir", str(tiny_shar)).train_dataloader(0, 1, sampler_state=boundary)
    assert (resumed.epoch, resumed.batches_consumed) == (3, 0)


def test_shar_state_checks_format_world_size_and_seed(tiny_data, tiny_shar):
    """The Shar loader once skipped the format check the manifest loader made: one check now."""
    shar_state = _state_after_one_batch(make_dm(tiny_data, "--shar-dir", str(tiny_shar)))
    for bad, match in (({"format": "valle-sampler-0"}, "format 'valle-sampler-0'"),
                       ({"world_size": 2}, "world size 2"), ({"seed": 8}, "--seed 8")):
        with pytest.raises(ValueError, match=match):
            make_dm(tiny_data, "--shar-dir", str(tiny_shar)).train_dataloader(
                0, 1, sampler_state={**shar_state, **bad})


def test_filters_are_reported_and_empty_result_names_the_filter(tiny_data, tmp_path, caplog):
    dm = make_dm(tiny_data, "--filter-max-duration", "2.0")
    loader = dm.train_dataloader(0, 1)
    assert not dm.filter_report.entries  # no pass at start: listed as the sampler meets them
    for _epoch in range(2):
        list(loader)
        assert dm.filter_report.counts.get("too_long", 0) > 0
        assert all(e.reason == "too_long" for e in dm.filter_report.entries)
        streamed = sorted(e.cut_id for e in dm.filter_report.entries)  # each cut once
        assert len(set(streamed)) == len(streamed)
    # a corpus without extremes records: the old pass at start, with a warning, same report
    old = tmp_path / "old"
    old.mkdir()
    for f in tiny_data.iterdir():
        if "_extremes_" not in f.name:
            (old / f.name).symlink_to(f)
    with caplog.at_level("WARNING", logger="valle.data.datamodule"):
        passed = make_dm(old, "--filter-max-duration", "2.0")
        passed.train_dataloader(0, 1)
    assert sorted(e.cut_id for e in passed.filter_report.entries) == streamed
    assert any("python -m valle.data.recipe extremes" in r.getMessage() for r in caplog.records)
    n_train = len(CutSet.from_file(tiny_data / "tiny_cuts_train.jsonl.gz"))
    with pytest.raises(NoCutsLeftError, match=f"--filter-max-duration 0.5 removed all {n_train} cuts"):
        make_dm(tiny_data, "--filter-max-duration", "0.5").train_dataloader(0, 1)


def test_text_budget_is_on_by_default_and_derived_from_the_corpus(tiny_data, tmp_path, caplog):
    import json
    import logging
    import math

    from valle.data.datamodule import DEFAULT_TEXT_TOKENS_PER_SECOND, TEXT_BUDGET_MARGIN

    parser = argparse.ArgumentParser()
    add_data_flags(parser)
    base = ["--dataset", "tiny", "--max-duration", "6", "--num-buckets", "2", "--num-workers", "0"]
    rate = json.loads((tiny_data / "tiny_text_stats.json").read_text())["total"]["text_tokens_per_second_p99"]
    with caplog.at_level(logging.INFO, logger="valle.data.datamodule"):
        args = parser.parse_args(["--manifest-dir", str(tiny_data), *base])
        args.seed = 0
        dm = TtsDataModule.from_flags(args)
    budget = math.ceil(TEXT_BUDGET_MARGIN * rate * 6)
    assert 10 < rate < 40 and dm.cfg.max_text_tokens == budget
    assert f"--max-text-tokens {budget} = " in caplog.text and "tiny_text_stats.json" in caplog.text
    for batch in dm.train_dataloader(0, 1):
        assert batch["text_tokens"].numel() <= budget  # padded tokens, bos/eos included
    # no statistics next to the manifests: the documented constant
    args = parser.parse_args(["--manifest-dir", str(tmp_path), *base])
    assert TtsDataModule.from_flags(args).cfg.max_text_tokens == math.ceil(TEXT_BUDGET_MARGIN * DEFAULT_TEXT_TOKENS_PER_SECOND * 6)
    assert TtsDataModule.from_flags(parser.parse_args(["--max-text-tokens", "off", *base])).cfg.max_text_tokens is None
    assert TtsDataModule.from_flags(parser.parse_args(["--max-text-tokens", "77", *base])).cfg.max_text_tokens == 77


@pytest.mark.parametrize("device, pinned", [("cpu", False), ("cuda", True)])
def test_trainer_pins_batches_on_cuda_only(tiny_data, tmp_path, device, pinned):
    """On CUDA the trainer's loaders hand out page-locked batches (its non_blocking uploads
    are only asynchronous from there); on CPU pinning would only cost a copy."""
    from valle.train.cli import parse_config
    from valle.train.dist import DistContext
    from valle.train.lhotse_data import LhotseTrainData

    cfg = parse_config(["--manifest-dir", str(tiny_data), "--dataset", "tiny", "--max-duration", "6",
                        "--num-workers", "0", "--exp-dir", str(tmp_path)])
    data = LhotseTrainData(cfg, DistContext(device=torch.device(device)))
    assert data.train.pin_memory is pinned and data.valid.pin_memory is pinned
    # the DataLoaders they build (constructed only: there is no GPU to pin for here)
    assert data.train._batches(0).pin_memory is pinned
    assert data.valid._batches(0).pin_memory is pinned


def test_shar_start_up_reads_the_extremes_record_not_the_shards(tiny_data, tiny_shar, tmp_path):
    shar = tmp_path / "shar" / "train"
    shar.mkdir(parents=True)
    for f in tiny_shar.iterdir():
        (shar / f.name).symlink_to(f)
    # beside the shard dir, where bin/tokenizer.py --shar-dir and `recipe shar` put it
    (tmp_path / "shar" / "tiny_extremes_train.json").symlink_to(tiny_data / "tiny_extremes_train.json")
    from_shar = make_dm(tiny_data, "--shar-dir", str(shar))
    from_manifest = make_dm(tiny_data)
    data = from_shar.train_dataloader(0, 1).data
    # bins from the record's sample (no shard is opened: a missing path is never read)
    assert data._duration_bins(["/nonexistent/cuts.000000.jsonl.gz"]) == \
        from_manifest.bucketing("train", from_manifest.constraint())["duration_bins"]
    ids = {name: [c.id for c in cuts] for name, (_v, cuts) in from_shar.worst_batches().items()}
    assert ids == {name: [c.id for c in cuts] for name, (_v, cuts) in from_manifest.worst_batches().items()}
    # without a record: bins from the shards themselves, as before
    assert make_dm(tiny_data, "--shar-dir", str(tiny_shar)).train_extremes() is None

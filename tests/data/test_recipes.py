"""The LibriTTS and LJSpeech recipes, stage by stage as a user runs them, on small corpora in
the real on-disk layouts (fake audio; the download stage skipped by pointing at the corpus)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from data_testlib import finish_recipe, make_libritts, make_ljspeech, run_recipe, start_recipe

from valle.data.validation import ValidationReport

PARTS = {"dev-clean": ["84"], "test-clean": ["121"], "train-clean-100": ["19", "26"], "train-clean-360": ["14"]}
TOKENIZER_FLAGS = "--allow-random-encodec --download-encodec false --chunk-size 3 --batch-duration 3"


def _read(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _write(path: Path, items: list[dict]) -> None:
    with gzip.open(path, "wt") as f:
        for d in items:
            f.write(json.dumps(d) + "\n")


def _inject_manifest_problems(man: Path) -> dict:
    """What real manifests contain: a recording with several supervisions, a supervision
    whose recording is missing, repeated ids, a recording nobody transcribed, and a cut id
    that appears in two parts."""
    recs_path, sups_path = man / "libritts_recordings_train-clean-100.jsonl.gz", man / "libritts_supervisions_train-clean-100.jsonl.gz"
    recs, sups = _read(recs_path), _read(sups_path)
    first = sups[0]
    half = round(first["duration"] / 2, 3)
    multi = [dict(first, id=first["id"] + "_a", duration=half, text="The cat.", custom=None),
             dict(first, id=first["id"] + "_b", start=half, duration=round(first["duration"] - half, 3),
                  text="Sat down.", custom=None)]
    ghost = dict(sups[1], id="ghost_utt", recording_id="ghost_rec")
    lonely = dict(recs[1], id="lonely_rec")
    _write(recs_path, recs + [recs[2], lonely])
    _write(sups_path, multi + sups[1:] + [sups[2], ghost])
    # the same utterance id in another train part: combine must drop the second copy
    recs360, sups360 = man / "libritts_recordings_train-clean-360.jsonl.gz", man / "libritts_supervisions_train-clean-360.jsonl.gz"
    _write(recs360, _read(recs360) + [recs[3]])
    _write(sups360, _read(sups360) + [sups[3]])
    return {"multi": [m["id"] for m in multi], "dup_rec": recs[2]["id"], "dup_sup": sups[2]["id"],
            "cross_part": sups[3]["id"]}


LJ_ROWS = [("Printing, in 1839, was new.", "Printing, in eighteen thirty-nine, was new."),
           ("He left.", "He left."), ("It was Mr. Lee.", "It was Mister Lee."),
           ("The end came.", "The end came."), ("Then rain.", "Then rain.")]


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """Both recipes, as a user runs them; LJSpeech in the background while LibriTTS runs."""
    lj_root = tmp_path_factory.mktemp("ljspeech")
    lj_corpus = make_ljspeech(lj_root, LJ_ROWS)
    lj = start_recipe("egs/ljspeech/prepare.sh", "--data-dir", str(lj_root / "data"), "--corpus-dir",
                      str(lj_corpus), "--num-jobs", "0", "--num-dev", "1", "--num-test", "1",
                      "--stop-stage", "5", "--extra-tokenizer-flags", TOKENIZER_FLAGS)
    root = tmp_path_factory.mktemp("libritts")
    corpus = make_libritts(root, PARTS)
    data = root / "data"
    common = ["--data-dir", str(data), "--corpus-dir", str(corpus), "--dataset-parts", " ".join(PARTS),
              "--num-jobs", "1", "--extra-tokenizer-flags", TOKENIZER_FLAGS]
    rc, out, err = run_recipe("egs/libritts/prepare.sh", *common, "--stage", "0", "--stop-stage", "1")
    assert rc == 0, err[-3000:]
    assert "no download" in out
    injected = _inject_manifest_problems(data / "manifests")
    rc, out, err = run_recipe("egs/libritts/prepare.sh", *common, "--stage", "2", "--stop-stage", "5",
                              "--shar-shard-size", "2")
    assert rc == 0, out[-3000:] + err[-3000:]
    lj_rc, lj_out, lj_err = finish_recipe(lj)
    assert lj_rc == 0, lj_out[-3000:] + lj_err[-3000:]
    return {"libritts": (data, out + err, injected), "ljspeech": (lj_root / "data", LJ_ROWS, lj_out + lj_err)}


@pytest.fixture(scope="module")
def libritts(recipes):
    return recipes["libritts"]


@pytest.fixture(scope="module")
def ljspeech(recipes):
    return recipes["ljspeech"]


def test_libritts_recipe_runs_every_stage(libritts):
    from lhotse import CutSet
    from lhotse.qa import validate

    data, log, injected = libritts
    tok = data / "tokenized"
    train = CutSet.from_file(tok / "libritts_cuts_train.jsonl.gz")
    ids = [c.id for c in train]
    # train-clean-100: 4 utterances, one recording split in two -> 5; train-clean-360: 2 + 1 repeated
    assert len(ids) == len(set(ids)) == 7
    assert set(injected["multi"]) <= set(ids)
    assert f"combine: dropped {injected['cross_part']}: duplicate_id" in log  # the cross-part copy
    validate(train, read_data=True)
    for name in ("dev", "test"):
        assert len(CutSet.from_file(tok / f"libritts_cuts_{name}.jsonl.gz")) == 2
    assert "libritts_cuts_train.jsonl.gz: 7 cuts" in log  # stage 4
    shar = sorted(p.name for p in (data / "shar" / "train").iterdir())
    assert shar == [f"{k}.{i:06d}.{ext}" for k, ext in (("cuts", "jsonl.gz"), ("features", "tar")) for i in range(4)]
    # codes go to one HDF5 file per chunk, not one file per cut
    assert sorted(p.name for p in (tok / "libritts_encodec_train-clean-100").iterdir()) == ["chunk-000000.h5", "chunk-000001.h5"]


def test_combine_takes_a_single_part(libritts, tmp_path, capsys):
    # lhotse's `combine` raised TypeError on one input (the default parts have one train part)
    from valle.data import recipe

    data, _, _ = libritts
    src = data / "tokenized" / "libritts_cuts_train-clean-100.jsonl.gz"
    assert recipe.main(["combine", str(tmp_path / "train.jsonl.gz"), str(src)]) == 0
    assert _read(tmp_path / "train.jsonl.gz") == _read(src)
    # a name the trainer never reads gets no record, and says so
    assert "no extremes record: " in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl.gz"]  # no scratch id table left


def _record_of_manifest(path: Path) -> dict:
    from lhotse import CutSet

    from valle.data.extremes import Extremes

    return Extremes.of(CutSet.from_file(path)).to_json()


def test_every_part_the_trainer_reads_has_its_extremes_record(libritts, ljspeech):
    # the trainer's start-up reads {prefix}_extremes_{part}.json instead of the manifest:
    # combine (libritts train), the copied dev/test and split (ljspeech) all leave one
    from valle.data.extremes import Extremes

    for data, prefix in ((libritts[0], "libritts"), (ljspeech[0], "ljspeech")):
        tok = data / "tokenized"
        for part in ("train", "dev", "test"):
            record = Extremes.read(tok / f"{prefix}_extremes_{part}.json")
            assert record.to_json() == _record_of_manifest(tok / f"{prefix}_cuts_{part}.jsonl.gz"), (prefix, part)


def test_combine_drops_repeats_across_and_within_parts_and_records_what_it_kept(libritts, tmp_path):
    from valle.data import recipe
    from valle.data.extremes import Extremes

    data, _, _ = libritts
    tok = data / "tokenized"
    parts = [tok / "libritts_cuts_train-clean-100.jsonl.gz", tok / "libritts_cuts_train-clean-360.jsonl.gz"]
    doubled = tmp_path / "doubled.jsonl.gz"  # every cut twice in one part
    _write(doubled, [c for c in _read(parts[1]) for _ in range(2)])
    out = tmp_path / "x_cuts_train.jsonl.gz"
    report = recipe.combine(out, [parts[0], doubled, parts[0]])
    kept = _read(out)
    assert [c["id"] for c in kept] == list(dict.fromkeys(c["id"] for p in parts for c in _read(p)))
    assert len(report.entries) == report.checked - len(kept) and report.counts == {"duplicate_id": len(report.entries)}
    assert Extremes.read(tmp_path / "x_extremes_train.json").to_json() == _record_of_manifest(out)
    assert not list(tmp_path.glob(".ids.*"))  # the on-disk id table is removed


def test_the_seen_id_table_answers_exactly(tmp_path):
    from valle.data.recipe import _SeenIds

    seen = _SeenIds(tmp_path / "x_cuts_train.jsonl.gz")
    try:
        assert [seen.add(i) for i in ["a", "b", "a", "small/1/b", "b", "small/1/b"]] == [
            True, True, False, True, False, False]
        assert seen.count == 3 and seen.path.is_file()
    finally:
        seen.close()
    assert not seen.path.exists()


def test_libritts_manifest_problems_each_get_a_line(libritts):
    data, log, injected = libritts
    report = ValidationReport.read(data / "tokenized" / "libritts_bad_cuts_train-clean-100.tsv")
    got = sorted((e.cut_id, e.reason) for e in report.entries)
    assert got == sorted([(injected["dup_rec"], "duplicate_id"), (injected["dup_sup"], "duplicate_id"),
                          ("ghost_utt", "no_recording"), ("lonely_rec", "no_supervision")])
    assert "Traceback" not in log


def test_text_stats_are_stored_next_to_the_manifests(libritts):
    data, log, _ = libritts
    stats = json.loads((data / "tokenized" / "libritts_text_stats.json").read_text())
    assert set(stats["parts"]) == set(PARTS)
    total = stats["total"]
    assert total["cuts"] == 2 + 2 + 5 + 3
    assert 5 < total["phones_per_second"] < 20
    assert total["text_tokens_per_second"] > total["phones_per_second"]
    assert total["text_tokens_per_second_p99"] >= total["text_tokens_per_second"]
    assert "en-us" in total["languages"] and "per language (espeak voice)" in log


def test_ljspeech_recipe_resamples_cuts_and_reads_normalized_text(ljspeech):
    from lhotse import CutSet
    from lhotse.qa import validate

    from valle.data.text import TextTokenizer

    data, rows, log = ljspeech
    tok = data / "tokenized"
    parts = {p: CutSet.from_file(tok / f"ljspeech_cuts_{p}.jsonl.gz") for p in ("train", "dev", "test")}
    assert {p: len(c) for p, c in parts.items()} == {"train": 3, "dev": 1, "test": 1}
    cut = parts["dev"][0]
    # 22.05 kHz recordings: the cut is at the codec's rate, so lhotse's checks and loads agree
    assert cut.sampling_rate == 24000 and cut.features.sampling_rate == 24000
    validate(parts["train"] + parts["dev"], read_data=True)
    assert cut.load_audio().shape[-1] == cut.num_samples
    # "1839" is spoken "eighteen thirty-nine": the normalized text is phonemized
    tokenizer = TextTokenizer()
    assert cut.supervisions[0].custom["tokens"]["text"] == tokenizer.phonemize_one(rows[0][1]).symbols
    assert cut.supervisions[0].custom["tokens"]["text"] != tokenizer.phonemize_one(rows[0][0]).symbols
    assert "ljspeech_cuts_train.jsonl.gz: 3 cuts" in log
    shar = CutSet.from_shar(in_dir=data / "shar" / "train")  # stage 5
    assert sorted(c.id for c in shar) == sorted(c.id for c in parts["train"])


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_two_ranks_train_from_shar_shards_and_see_every_cut_once_per_epoch(libritts, tmp_path):
    from lhotse import CutSet

    from tests.support.harness import run_world
    from tests.support.scenarios import TINY_MODEL, train_worker

    data, _, _ = libritts
    exp = tmp_path / "exp"
    argv = [*TINY_MODEL, "--shar-dir", str(data / "shar" / "train"), "--manifest-dir", str(data / "tokenized"),
            "--dataset", "libritts", "--exp-dir", str(exp), "--num-epochs", "2", "--max-duration", "2.5",
            "--num-workers", "2", "--log-trained-cuts", "true", "--train-stage", "1",
            "--valid-interval", "1000", "--save-every-n", "1000"]
    results = run_world(train_worker, 2, argv, timeout=240)
    assert all(r[0] == "ok" and r[1]["ok"] for r in results), "\n".join(str(x) for r in results for x in r)
    expected = sorted(c.id for c in CutSet.from_file(data / "tokenized" / "libritts_cuts_train.jsonl.gz"))
    rows = []
    for rank in range(2):
        for line in (exp / f"trained-cuts-rank{rank}.tsv").read_text().splitlines():
            step, ids = line.split("\t")
            rows += [(int(step), cut_id) for cut_id in ids.split(",") if cut_id]
    epoch1_steps = json.loads((exp / "epoch-1-summary-rank0.json").read_text())["steps"]
    for epoch in (1, 2):
        seen = sorted(c for step, c in rows if (step < epoch1_steps) == (epoch == 1))  # steps count from 0
        assert seen == expected, f"epoch {epoch}"
    # both ranks trained (shards are dealt per rank and per worker)
    assert all((exp / f"trained-cuts-rank{r}.tsv").read_text().strip() for r in range(2))


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_two_nodes_deal_shar_shards_over_four_ranks_and_restart_together(libritts, tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1) of 2 workers each
    train from the Shar shards; rank 3 (node 1) is SIGKILLed in its first launch, both
    agents restart their workers through --max-restarts and resume from the newest
    checkpoint. Every cut is trained once per epoch across the 4 ranks, no step twice,
    and the end equals one 4-rank torchrun's uninterrupted run."""
    import re
    import subprocess
    import sys

    import torch
    from lhotse import CutSet

    from tests.support.harness import clean_launch_env, free_port
    from tests.support.scenarios import TINY_MODEL

    data, _, _ = libritts
    root = Path(__file__).resolve().parents[2]
    epochs = 3

    def trainer(exp: Path, *extra: str) -> list[str]:
        return [str(root / "bin" / "trainer.py"), *TINY_MODEL, "--shar-dir",
                str(data / "shar" / "train"), "--manifest-dir", str(data / "tokenized"),
                "--dataset", "libritts", "--exp-dir", str(exp), "--num-epochs", str(epochs),
                "--max-duration", "2.5", "--num-workers", "0", "--log-trained-cuts", "true",
                "--train-stage", "1", "--valid-interval", "1000", "--save-every-n", "1",
                "--log-interval", "1", *extra]

    launcher = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.2"]
    single = tmp_path / "one-node"
    ref = subprocess.run([*launcher, "--standalone", "--nproc_per_node", "4", *trainer(single)],
                         cwd=root, env=clean_launch_env(), capture_output=True, text=True,
                         timeout=180)
    assert ref.returncode == 0, ref.stderr[-4000:]

    exp, port = tmp_path / "two-nodes", free_port()
    nodes = [subprocess.Popen(
        [*launcher, "--nnodes", "2", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "--max-restarts", "1",
         *trainer(exp, "--inject-fault", "kill@2:3")],
        cwd=root, env=clean_launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for _ in range(2)]
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=240)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    text = "".join(logs)
    assert [n.returncode for n in nodes] == [0, 0], text[-6000:]
    assert "(3/4) injected kill" in text, "the fault never fired: this test would prove nothing"
    # Every rank of both nodes restarted from the checkpoint written before the kill
    # (save-every-n 1: the one after step 2, here the end of epoch 2).
    resumed = sorted(re.findall(r"\((\d)/4\) resuming from \S+ \(step 2,", text))
    assert resumed == ["0", "1", "2", "3"], text[-6000:]

    expected = sorted(c.id for c in CutSet.from_file(data / "tokenized" / "libritts_cuts_train.jsonl.gz"))
    steps_per_epoch = json.loads((exp / "epoch-1-summary-rank0.json").read_text())["steps"]
    for rank in range(4):
        rows = [line.split("\t") for line in (exp / f"trained-cuts-rank{rank}.tsv").read_text().splitlines()]
        steps = [int(step) for step, _ in rows]
        # save-every-n 1 and the kill inside step 2: nothing after the checkpoint was
        # logged, so one increasing sequence means no step was trained twice
        assert steps == list(range(epochs * steps_per_epoch)), (rank, steps)
        assert rows == [line.split("\t") for line in
                        (single / f"trained-cuts-rank{rank}.tsv").read_text().splitlines()]
    for epoch in range(epochs):
        seen = sorted(c for rank in range(4)
                      for step, ids in (line.split("\t") for line in
                                        (exp / f"trained-cuts-rank{rank}.tsv").read_text().splitlines())
                      if int(step) // steps_per_epoch == epoch for c in ids.split(",") if c)
        assert seen == expected, f"epoch {epoch + 1}"
    a = torch.load(single / f"epoch-{epochs}.pt", map_location="cpu", weights_only=False)
    b = torch.load(exp / f"epoch-{epochs}.pt", map_location="cpu", weights_only=False)
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=1e-6, atol=1e-7)
    assert a["sampler"] == b["sampler"]


def test_extremes_steps_name_a_badly_named_manifest_or_a_missing_record(tmp_path, capsys):
    from valle.data import recipe

    odd = tmp_path / "train.jsonl.gz"
    _write(odd, [])
    assert recipe.main(["extremes", str(odd)]) == 2
    assert "not named {prefix}_cuts_{part}.jsonl.gz" in capsys.readouterr().err
    assert recipe.main(["merge-extremes", str(tmp_path / "x_extremes_train.json"),
                        str(tmp_path / "x_extremes_small.json")]) == 2
    assert "x_extremes_small.json: no such extremes record" in capsys.readouterr().err


def test_a_cut_the_extremes_record_cannot_take_is_named(tmp_path, capsys):
    from valle.data import recipe

    part = tmp_path / "x_cuts_small.jsonl.gz"
    _write(part, [{"id": "small/1/a"}])
    assert recipe.main(["combine", str(tmp_path / "x_cuts_train.jsonl.gz"), str(part)]) == 2
    err = capsys.readouterr().err
    assert "x_cuts_small.jsonl.gz: cut 'small/1/a' has no 'duration' for the extremes record" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x_cuts_small.jsonl.gz"]  # nothing half-written

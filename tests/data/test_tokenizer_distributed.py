"""bin/tokenizer.py with many workers on one part: torchrun, separate --num-shards processes
(a SLURM array), a killed worker relaunched, Shar written by the workers. The output must
read exactly like one process's; a tiny manifest with fake audio and a random EnCodec."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from data_testlib import TEXTS, end_processes, killed_workers, survivors, tone
from lhotse import Recording, RecordingSet, SupervisionSegment, SupervisionSet

from valle.data.sharding import Shard, ShardError, resolve_shard

ROOT = Path(__file__).resolve().parents[2]
PART = "train"


def _corpus(tmp_path: Path, n_short: int = 7, segments: int = 4) -> Path:
    """``n_short`` single-utterance files and one long recording cut into ``segments`` (a
    LibriLight/Libriheavy-like book read in one file), 16 kHz (resampled to 24)."""
    wavs, man = tmp_path / "wavs", tmp_path / "manifests"
    wavs.mkdir()
    man.mkdir()
    recs, sups = [], []
    for i in range(n_short):
        sf.write(wavs / f"u{i}.wav", tone(0.6 + 0.1 * (i % 4), 16000, i), 16000, subtype="PCM_16")
        rec = Recording.from_file(wavs / f"u{i}.wav", recording_id=f"u{i}")
        recs.append(rec)
        sups.append(SupervisionSegment(id=f"u{i}", recording_id=rec.id, start=0, duration=rec.duration,
                                       channel=0, text=TEXTS[i % len(TEXTS)], language="English", speaker="s"))
    sf.write(wavs / "book.flac", tone(1.0 * segments, 16000, 99), 16000)
    book = Recording.from_file(wavs / "book.flac", recording_id="book")
    recs.append(book)
    for k in range(segments):
        sups.append(SupervisionSegment(id=f"book-{k}", recording_id="book", start=k * 1.0, duration=0.9,
                                       channel=0, text=TEXTS[(k + 3) % len(TEXTS)], language="English",
                                       speaker="reader"))
    RecordingSet.from_recordings(recs).to_file(man / f"tok_recordings_{PART}.jsonl.gz")
    SupervisionSet.from_segments(sups).to_file(man / f"tok_supervisions_{PART}.jsonl.gz")
    return man


def _argv(man: Path, out: Path, *extra: str) -> list[str]:
    return ["--src-dir", str(man), "--output-dir", str(out), "--prefix", "tok", "--dataset-parts", PART,
            "--allow-random-encodec", "--download-encodec", "false", "--num-jobs", "0", "--device", "cpu",
            "--threads", "1", "--chunk-size", "2", "--batch-duration", "2", *extra]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _read(out: Path) -> dict:
    """Everything a trainer reads from a tokenized dir, codes included."""
    from lhotse import CutSet

    cuts = list(CutSet.from_file(out / f"tok_cuts_{PART}.jsonl.gz"))
    return {
        "ids": [c.id for c in cuts],
        "text": {c.id: c.supervisions[0].custom["tokens"]["text"] for c in cuts},
        "codes": {c.id: c.load_features() for c in cuts},
        "symbols": (out / "unique_text_tokens.k2symbols").read_text(),
        "text_stats": (out / "tok_text_stats.json").read_text(),
        "stats": (out / f"tok_stats_{PART}.json").read_text(),
        "bad": (out / f"tok_bad_cuts_{PART}.tsv").read_text(),
        "extremes": _extremes(out / f"tok_extremes_{PART}.json", out),
    }


def _extremes(path: Path, out: Path) -> str:
    """The extremes record, its cuts' storage paths made relative to the output dir."""
    return path.read_text().replace(str(out), "<out>")


def _assert_same(a: dict, b: dict) -> None:
    assert a["ids"] == b["ids"] and len(set(a["ids"])) == len(a["ids"])
    for key in ("text", "symbols", "text_stats", "stats", "bad", "extremes"):
        assert a[key] == b[key], key
    for cid in a["ids"]:  # same chunks, same batches: the codes are equal, not only close
        assert np.array_equal(a["codes"][cid], b["codes"][cid]), cid


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokenizer_cli):
    """One process, the way bin/tokenizer.py ran before workers existed."""
    # (The conftest's fixture, not `import conftest`: under the full suite that name is
    # whichever test directory's conftest was imported first.)
    tmp = tmp_path_factory.mktemp("ref")
    man = _corpus(tmp)
    assert tokenizer_cli.main(_argv(man, tmp / "out", "--shar-dir", str(tmp / "shar"))) == 0
    return man, tmp / "out", tmp / "shar"


# ----------------------------------------------------------------------------- who am I
def test_worker_identity_from_flags_torchrun_and_slurm_arrays():
    assert resolve_shard(env={}) == Shard()
    assert resolve_shard(3, 1, env={}).index == 1 and resolve_shard(3, 1, env={}).count == 3
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert (resolve_shard(env=torchrun).index, resolve_shard(env=torchrun).count,
            resolve_shard(env=torchrun).local_rank) == (3, 4, 1)
    slurm = {"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "10",
             "SLURM_ARRAY_TASK_STEP": "1"}
    assert (resolve_shard(env=slurm).index, resolve_shard(env=slurm).count) == (2, 4)
    # an array of torchrun jobs: worker = task * world + rank, over task_count * world workers
    nested = resolve_shard(env={**slurm, **torchrun})
    assert (nested.index, nested.count) == (2 * 4 + 3, 16)
    # the flags win over the array (one array task per part, say)
    assert (resolve_shard(2, 0, env=slurm).index, resolve_shard(2, 0, env=slurm).count) == (0, 2)
    # every chunk has exactly one owner
    workers = [resolve_shard(3, k, env={}) for k in range(3)]
    assert all(sum(w.owns(c) for w in workers) == 1 for c in range(20))
    for bad, env in [((3, None), {}), ((2, 2), {}), ((None, None), {"SLURM_ARRAY_TASK_ID": "5",
                     "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1"})]:
        with pytest.raises(ShardError):
            resolve_shard(*bad, env=env)


def test_each_worker_encodes_on_its_local_gpu(tokenizer_cli):
    import torch

    pick = tokenizer_cli.worker_device
    assert pick(torch.device("cuda"), "auto", 3) == torch.device("cuda", 3)
    assert pick(torch.device("cuda"), "cuda", 1) == torch.device("cuda", 1)
    assert pick(torch.device("cuda", 2), "cuda:2", 1) == torch.device("cuda", 2)  # asked for by name
    assert pick(torch.device("cpu"), "auto", 1) == torch.device("cpu")


def test_the_plan_streams_ids_without_keeping_them(reference):
    from valle.data import validation as V
    from valle.data.manifests import load_cuts
    from valle.data.pipeline import streaming_plan

    man, _out, _shar = reference
    cuts = load_cuts(man / f"tok_recordings_{PART}.jsonl.gz", man / f"tok_supervisions_{PART}.jsonl.gz",
                     V.ValidationReport())
    assert not hasattr(cuts, "ids")
    ids = [c.id for c in cuts]
    digest = hashlib.sha1("\n".join(ids).encode()).hexdigest()  # what plan.json always held
    assert streaming_plan(cuts, 2) == streaming_plan(list(cuts), 2) == {
        "chunk_size": 2, "num_cuts": len(ids), "cut_ids_sha1": digest}


def _book_manifest(man: Path, n: int) -> Path:
    """``n`` supervisions over one long recording (memory must not grow with them)."""
    import gzip
    import json

    rec = next(r for r in RecordingSet.from_file(man / f"tok_recordings_{PART}.jsonl.gz") if r.id == "book")
    d = man / f"n{n}"
    d.mkdir()
    RecordingSet.from_recordings([rec]).to_file(d / "rec.jsonl.gz")
    with gzip.open(d / "sup.jsonl.gz", "wt") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"s{i:07d}", "recording_id": "book", "start": (i % 3) * 1.0,
                                "duration": 0.9, "channel": 0, "text": "A bird sang."}) + "\n")
    return d


def test_a_parts_cuts_stream_in_memory_that_does_not_grow_with_the_corpus(reference):
    from valle.data import validation as V
    from valle.data.manifests import load_cuts

    man, _out, _shar = reference
    peaks = {}
    for n in (2_000, 20_000):
        d = _book_manifest(man, n)
        tracemalloc.start()
        cuts = load_cuts(d / "rec.jsonl.gz", d / "sup.jsonl.gz", V.ValidationReport())
        count = sum(1 for _ in cuts)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert count == len(cuts) == n
    # 10x the cuts: the only growth is ~9 bytes per cut while repeated ids are looked for
    assert peaks[20_000] - peaks[2_000] < 18_000 * 12 + 100_000, peaks


# ----------------------------------------------------------------------------- many workers
@pytest.mark.timeout(300)
def test_torchrun_two_workers_read_exactly_like_one_process(reference, tmp_path):
    man, ref_out, ref_shar = reference
    out, shar = tmp_path / "out", tmp_path / "shar"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "bin" / "tokenizer.py"), *_argv(man, out, "--shar-dir", str(shar))],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torchrun rank 1 of 2" in proc.stderr
    _assert_same(_read(out), _read(ref_out))
    assert not list(out.glob(".tok_chunks_*"))
    # Shar written by the workers themselves: numbered in chunk order, no staging left
    from lhotse import CutSet

    got = list(CutSet.from_shar(in_dir=shar / PART))
    want = list(CutSet.from_shar(in_dir=ref_shar / PART))
    assert [c.id for c in got] == [c.id for c in want] == _read(ref_out)["ids"]
    for a, b in zip(got, want):
        assert np.array_equal(a.load_features(), b.load_features())
    assert sorted(x.name for x in shar.iterdir()) == sorted([PART, f"tok_extremes_{PART}.json"])  # no staging left
    # the trainer's start-up reads the extremes record from a Shar dir too, merged from every chunk
    extremes = f"tok_extremes_{PART}.json"
    assert _extremes(shar / extremes, out) == _extremes(ref_shar / extremes, ref_out) == \
        _extremes(ref_out / extremes, ref_out)


@pytest.mark.timeout(300)
def test_shards_run_as_separate_processes_the_last_one_joins(reference, tmp_path, tokenizer_cli, capsys):
    man, ref_out, _shar = reference
    out = tmp_path / "out"
    for k in (2, 0):  # any order: an array's tasks start and end when the scheduler says
        assert tokenizer_cli.main(_argv(man, out, "--num-shards", "3", "--shard-index", str(k))) == 0
        assert "the last worker to finish joins the part" in capsys.readouterr().out
        assert not (out / f"tok_cuts_{PART}.jsonl.gz").exists()
    assert tokenizer_cli.main(_argv(man, out, "--num-shards", "3", "--shard-index", "1")) == 0
    assert f"[{PART}] 11 cuts" in capsys.readouterr().out
    _assert_same(_read(out), _read(ref_out))
    # a task started again after the join has nothing to do
    assert tokenizer_cli.main(_argv(man, out, "--num-shards", "3", "--shard-index", "0")) == 0
    assert "1 part(s), 0 tokenized" in capsys.readouterr().out
    assert not (out / ".tok_chunks_train").exists()


@pytest.mark.timeout(300)
def test_a_killed_worker_relaunched_redoes_one_chunk_and_loses_nothing(reference, tmp_path, tokenizer_cli,
                                                                       monkeypatch):
    from valle.data.pipeline import PartTokenizer

    man, ref_out, _shar = reference
    out = tmp_path / "out"
    real = PartTokenizer.run_chunk
    calls: list[int] = []

    def killed_in_chunk_4(self, index, *args):
        calls.append(index)
        if index == 4:
            raise KeyboardInterrupt("simulated kill")
        return real(self, index, *args)

    monkeypatch.setattr(PartTokenizer, "run_chunk", killed_in_chunk_4)
    with pytest.raises(KeyboardInterrupt):
        tokenizer_cli.main(_argv(man, out, "--num-shards", "2", "--shard-index", "0"))
    assert calls == [0, 2, 4]
    assert tokenizer_cli.main(_argv(man, out, "--num-shards", "2", "--shard-index", "1")) == 0
    calls.clear()
    monkeypatch.setattr(PartTokenizer, "run_chunk", lambda self, index, *a: calls.append(index) or real(self, index, *a))
    assert tokenizer_cli.main(_argv(man, out, "--num-shards", "2", "--shard-index", "0")) == 0
    assert calls == [4]  # chunks 0 and 2 were kept; the other worker's were never touched
    _assert_same(_read(out), _read(ref_out))


def test_segments_of_a_long_recording_read_only_their_frames(reference, tmp_path, tokenizer_cli, monkeypatch):
    """The book's 4 segments are read by seeking (libsndfile: wav, flac, ogg, mp3), not by
    decoding the whole file once per segment."""
    man, _out, _shar = reference
    read_frames: dict[str, int] = {}
    real_read = sf.SoundFile.read

    def counting_read(self, frames=-1, *args, **kwargs):
        data = real_read(self, frames, *args, **kwargs)
        read_frames[Path(self.name).name] = read_frames.get(Path(self.name).name, 0) + len(data)
        return data

    monkeypatch.setattr(sf.SoundFile, "read", counting_read)
    assert tokenizer_cli.main(_argv(man, tmp_path / "out")) == 0
    segments_frames = 4 * int(0.9 * 16000)
    assert segments_frames <= read_frames["book.flac"] <= segments_frames + 4 * 160, read_frames


def test_a_segment_of_a_long_mp3_is_read_by_seeking(tmp_path, monkeypatch):
    """Emilia ships mp3: lhotse reads a segment through libsndfile (1.1+), which seeks by
    frame headers instead of decoding everything before the segment."""
    if "MP3" not in sf.available_formats():
        pytest.skip("this libsndfile has no mp3")
    sf.write(tmp_path / "long.mp3", tone(60.0, 16000, 7), 16000, format="MP3")
    rec = Recording.from_file(tmp_path / "long.mp3")
    read_frames = []
    real_read = sf.SoundFile.read
    monkeypatch.setattr(sf.SoundFile, "read", lambda self, frames=-1, *a, **k: read_frames.append(
        len(out := real_read(self, frames, *a, **k))) or out)
    audio = rec.to_cut().truncate(offset=50.0, duration=1.0).load_audio()
    assert audio.shape == (1, 16000) and sum(read_frames) == 16000


# ----------------------------------------------------------------------------- SIGKILL mid-chunk
# tests/data/killed_tokenizer.py is bin/tokenizer.py that SIGKILLs itself in chunk KILL_CHUNK
# with its chunk file open, one audio worker busy (sleeping) at that moment: torch's own
# watchdog would let such a worker outlive its parent by minutes, holding what it inherited.
KILLER = ROOT / "tests" / "data" / "killed_tokenizer.py"


def _small_argv(man: Path, out: Path, *extra: str) -> list[str]:
    # 4 cuts, 2 chunks of 2; one cut per batch: two audio workers each take one
    return _argv(man, out, "--num-jobs", "2", "--batch-duration", "1", *extra)


@pytest.fixture(scope="module")
def small_reference(tmp_path_factory, tokenizer_cli):
    tmp = tmp_path_factory.mktemp("small")
    man = _corpus(tmp, n_short=3, segments=1)
    assert tokenizer_cli.main(_small_argv(man, tmp / "out", "--num-jobs", "0")) == 0
    return man, tmp / "out"


@pytest.mark.timeout(240)
def test_a_worker_sigkilled_mid_chunk_relaunched_at_once_reads_like_one_process(small_reference, tmp_path,
                                                                                tokenizer_cli):
    man, ref_out = small_reference
    out, pids_file = tmp_path / "out", tmp_path / "pids"
    storage = out / f"tok_encodec_{PART}"
    env = dict(_env(), KILL_CHUNK="1", KILL_PIDS=str(pids_file))
    # output to a file: a surviving worker of the killed process would hold a pipe open
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.run([sys.executable, str(KILLER), *_small_argv(man, out)], cwd=tmp_path, env=env,
                              stdout=log, stderr=subprocess.STDOUT, timeout=120)
    workers = killed_workers(pids_file)
    try:
        assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
        assert workers, "the kill happened before an audio worker was busy"
        left = sorted(p.name for p in storage.iterdir())
        done = sorted(p.name for p in (out / f".tok_chunks_{PART}").glob("0*.json"))
        # relaunched at once, the same command (in this process: no start-up delay at all)
        assert tokenizer_cli.main(_small_argv(man, out)) == 0
        # the half-written chunk was neither visible under its name nor done
        assert "chunk-000001.h5" not in left and "chunk-000000.h5" in left and done == ["000000.json"]
        _assert_same(_read(out), _read(ref_out))
        assert sorted(p.name for p in storage.iterdir()) == ["chunk-000000.h5", "chunk-000001.h5"]
        # no process of the killed worker is left (it died with its parent)
        assert survivors(workers) == []
    finally:
        end_processes(workers)


@pytest.mark.timeout(300)
def test_an_elastic_restart_after_a_rank_is_sigkilled_mid_chunk_needs_one_restart(small_reference, tmp_path):
    """torchrun --max-restarts 1: rank 1 is killed in its chunk; the one restart must finish."""
    man, ref_out = small_reference
    out, pids_file = tmp_path / "out", tmp_path / "pids"
    env = dict(_env(), KILL_CHUNK="1", KILL_RANK="1", KILL_PIDS=str(pids_file))
    with open(tmp_path / "torchrun.log", "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "--max-restarts", "1", "--monitor-interval", "0.1", str(KILLER), *_small_argv(man, out)],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=240)
    workers = killed_workers(pids_file)
    try:
        text = (tmp_path / "torchrun.log").read_text()
        assert proc.returncode == 0, text[-4000:]
        assert workers and "failed (exitcode: -9) local_rank: 1" in text  # the first attempt died mid-chunk
        _assert_same(_read(out), _read(ref_out))
        assert not list((out / f"tok_encodec_{PART}").glob(".tmp.*"))
        assert survivors(workers) == []
    finally:
        end_processes(workers)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("visible", ["chunk-000001.h5", "000001.jsonl.gz"])
def test_a_chunk_interrupted_after_a_file_appeared_is_redone_not_taken_for_done(small_reference, tmp_path,
                                                                               tokenizer_cli, monkeypatch,
                                                                               visible):
    """Whatever file of a chunk has appeared, only its meta (written last) makes it done."""
    from valle.data import pipeline

    man, ref_out = small_reference
    out = tmp_path / "out"
    real = pipeline.publish

    def interrupted_after(tmp, path):
        real(tmp, path)
        if path.name == visible:
            raise KeyboardInterrupt(f"simulated kill after {visible} appeared")

    monkeypatch.setattr(pipeline, "publish", interrupted_after)
    with pytest.raises(KeyboardInterrupt):
        tokenizer_cli.main(_small_argv(man, out, "--num-jobs", "0"))
    assert not (out / f".tok_chunks_{PART}" / "000001.json").exists()
    monkeypatch.setattr(pipeline, "publish", real)
    assert tokenizer_cli.main(_small_argv(man, out, "--num-jobs", "0")) == 0
    _assert_same(_read(out), _read(ref_out))

"""bin/tokenizer.py beyond the happy path: languages, chunked resume, parallel symbol merges,
bad files, missing weights; all in-process on a small manifest with fake audio."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import soundfile as sf
import torch
from data_testlib import tone
from lhotse import Recording, RecordingSet, SupervisionSegment, SupervisionSet

from valle.codec import encodec as E
from valle.data.symbols import SymbolTable

LANGS = [("English", "The cat sat."), ("French", "Le chat dort."), ("fr", "Il pleut."),
         ("deu", "Guten Tag."), ("German", "Danke schön."), ("Mandarin", "我是中国人。"),
         ("es-ES", "Hola amigo."), ("Klingonese", "Qapla.")]


def _manifests(tmp_path, items=LANGS, prefix="ml", part="test"):
    wavs, man = tmp_path / "wavs", tmp_path / "manifests"
    wavs.mkdir()
    man.mkdir()
    recs, sups = [], []
    for i, (lang, text) in enumerate(items):
        path = wavs / f"u{i}.wav"
        sf.write(path, tone(1.2, 16000, i), 16000, subtype="PCM_16")  # 16 kHz: resampled to 24
        rec = Recording.from_file(path, recording_id=f"u{i}")
        recs.append(rec)
        sups.append(SupervisionSegment(id=f"u{i}", recording_id=rec.id, start=0, duration=rec.duration,
                                       channel=0, text=text, language=lang, speaker="s"))
    RecordingSet.from_recordings(recs).to_file(man / f"{prefix}_recordings_{part}.jsonl.gz")
    SupervisionSet.from_segments(sups).to_file(man / f"{prefix}_supervisions_{part}.jsonl.gz")
    return man


def _argv(man, out, *extra):
    return ["--src-dir", str(man), "--output-dir", str(out), "--prefix", "ml", "--dataset-parts", "test",
            "--allow-random-encodec", "--download-encodec", "false", "--num-jobs", "0", "--device", "auto",
            *extra]


def test_every_language_spelling_gets_its_voice_and_a_report(tmp_path, tokenizer_cli, capsys):
    from lhotse import CutSet

    man = _manifests(tmp_path)
    assert tokenizer_cli.main(_argv(man, tmp_path / "out", "--shar-dir", str(tmp_path / "shar"))) == 0
    out = capsys.readouterr().out
    cuts = {c.id: c for c in CutSet.from_file(tmp_path / "out" / "ml_cuts_test.jsonl.gz")}
    voices = {cid: c.supervisions[0].custom["espeak_voice"] for cid, c in cuts.items()}
    assert voices == {"u0": "en-us", "u1": "fr-fr", "u2": "fr-fr", "u3": "de", "u4": "de", "u5": "cmn", "u6": "es"}
    mandarin = cuts["u5"].supervisions[0].custom["tokens"]["text"]
    assert mandarin[-1] == "." and mandarin.count(".") == 1 and any(s.endswith(".5") for s in mandarin)
    # the unknown language is a report line naming it, not a crash or a silent drop
    bad = (tmp_path / "out" / "ml_bad_cuts_test.tsv").read_text()
    assert "u7\tphonemize_failed\tno espeak voice for language 'Klingonese'" in bad
    for voice, n in [("en-us", 1), ("fr-fr", 2), ("de", 2), ("cmn", 1), ("es", 1)]:
        assert f"[test]   {voice:<10} {n:>8} cuts" in out
    assert "Klingonese" in out  # its bad count is reported under its own name
    for c in cuts.values():
        assert c.sampling_rate == 24000 and c.load_features().shape == (c.features.num_frames, 8)
    # --shar-dir: the finished part as Lhotse Shar shards, codes exact
    shar = {c.id: c for c in CutSet.from_shar(in_dir=tmp_path / "shar" / "test")}
    assert set(shar) == set(cuts)
    assert (shar["u5"].load_features() == cuts["u5"].load_features()).all()


def test_a_crash_loses_at_most_one_chunk(tmp_path, tokenizer_cli, monkeypatch):
    from lhotse import CutSet

    from valle.data.pipeline import PartTokenizer

    man = _manifests(tmp_path, LANGS[:5])
    out = tmp_path / "out"
    real = PartTokenizer.run_chunk
    calls = []

    def crash_on_third(self, index, *args):
        calls.append(index)
        if index == 2:
            raise KeyboardInterrupt("simulated crash")
        return real(self, index, *args)

    monkeypatch.setattr(PartTokenizer, "run_chunk", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        tokenizer_cli.main(_argv(man, out, "--chunk-size", "2"))
    assert not (out / "ml_cuts_test.jsonl.gz").exists()
    calls.clear()
    monkeypatch.setattr(PartTokenizer, "run_chunk", lambda self, index, *a: calls.append(index) or real(self, index, *a))
    assert tokenizer_cli.main(_argv(man, out, "--chunk-size", "2")) == 0
    assert calls == [2]  # chunks 0 and 1 were kept
    assert [c.id for c in CutSet.from_file(out / "ml_cuts_test.jsonl.gz")] == ["u0", "u1", "u2", "u3", "u4"]
    assert not (out / ".ml_chunks_test").exists()
    # a different --chunk-size after a crash: the old chunks are not mixed in
    (out / "ml_cuts_test.jsonl.gz").unlink()
    monkeypatch.setattr(PartTokenizer, "run_chunk", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        tokenizer_cli.main(_argv(man, out, "--chunk-size", "2"))
    calls.clear()
    monkeypatch.setattr(PartTokenizer, "run_chunk", lambda self, index, *a: calls.append(index) or real(self, index, *a))
    assert tokenizer_cli.main(_argv(man, out, "--chunk-size", "3")) == 0
    assert calls == [0, 1]
    assert [c.id for c in CutSet.from_file(out / "ml_cuts_test.jsonl.gz")] == ["u0", "u1", "u2", "u3", "u4"]


def _merge_worker(args):
    from valle.data.pipeline import merge_symbols

    path, k = args
    for i in range(15):
        merge_symbols(path, {f"p{k}s{i}", "shared"})


def test_parallel_jobs_lose_no_symbols(tmp_path):
    path = tmp_path / "unique_text_tokens.k2symbols"
    with mp.get_context("fork").Pool(4) as pool:
        pool.map(_merge_worker, [(path, k) for k in range(4)])
    table = SymbolTable.from_file(path)
    assert {f"p{k}s{i}" for k in range(4) for i in range(15)} | {"shared"} <= set(table.symbols)
    assert len(table) == 4 + 60 + 1


def test_truncated_manifest_is_one_line_naming_the_file(tmp_path, tokenizer_cli, capsys):
    man = _manifests(tmp_path, LANGS[:3])
    sup = man / "ml_supervisions_test.jsonl.gz"
    sup.write_bytes(sup.read_bytes()[: sup.stat().st_size // 2])
    assert tokenizer_cli.main(_argv(man, tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(sup) in err[0] and "truncated or corrupt" in err[0]


def _offline(url, dst, hash_prefix=None, progress=True):
    raise OSError("URLError: offline")


def test_missing_weights_fail_before_any_work(tmp_path, tokenizer_cli, capsys, monkeypatch):
    man = _manifests(tmp_path, LANGS[:2])
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", _offline)
    argv = _argv(man, tmp_path / "out")
    argv = [a for a in argv[: argv.index("--allow-random-encodec")]] + argv[argv.index("--num-jobs"):]
    assert tokenizer_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert E.WEIGHTS.source.name in err[0] and str(tmp_path / "hub" / "checkpoints") in err[0]
    assert "--encodec-checkpoint" in err[0] and "offline" in err[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_progress_logs_rate_and_eta_without_a_terminal(caplog):
    import logging

    from valle.data.progress import Progress

    log = logging.getLogger("test-progress")
    with caplog.at_level(logging.INFO, logger="test-progress"):
        p = Progress(total=10, desc="tokenize x", logger=log, interval=0.0)
        p.update(4, audio_seconds=20.0)
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("tokenize x: 4/10 cuts, ") and "items/s" in lines[0]
    assert "h audio/s" in lines[0] and "x real time" in lines[0] and "ETA " in lines[0]
    assert lines[-1].endswith("(done)")


@pytest.mark.parametrize("world_size,workers", [(1, 1), (2, 2), (3, 2), (4, 1)])
def test_shar_shards_are_dealt_once_to_each_rank_and_worker(world_size, workers):
    from valle.data.shar import SharTrainSet

    shards = [{"cuts": f"cuts.{i}", "features": f"features.{i}"} for i in range(7)]
    for epoch in (0, 1):
        dealt = []
        for rank in range(world_size):
            data = SharTrainSet(shards, None, None, rank, world_size, seed=3, shuffle=True,
                                num_buckets=2, buffer_size=10, cut_filter=None)
            data.epoch = epoch
            for w in range(workers):
                dealt += [s["cuts"] for s in data.shards_for(w, workers)]
        assert sorted(dealt) == sorted(s["cuts"] for s in shards)

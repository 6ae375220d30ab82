"""The VALL-E X recipe (egs/vallex): LibriTTS + AISHELL-3, stage by stage as a user runs it, on
small corpora in the real on-disk layouts (fake audio; the download stage skipped by pointing
at the corpora); then egs/vallex/run.sh's training command, with a stand-in for python."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest
from data_testlib import MANDARIN, ROOT, make_aishell3, make_libritts, run_recipe

LIBRITTS_PARTS = {"dev-clean": ["84"], "test-clean": ["121"], "train-clean-100": ["19"]}
AISHELL3_PARTS = {"train": ["SSB0005", "SSB0009"], "test": ["SSB0011", "SSB0012"]}
TOKENIZER_FLAGS = "--allow-random-encodec --download-encodec false --chunk-size 4 --batch-duration 4"


def _cuts(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _voice(cut: dict) -> str:
    return cut["supervisions"][0]["custom"]["espeak_voice"]


@pytest.fixture(scope="module")
def vallex(tmp_path_factory):
    root = tmp_path_factory.mktemp("vallex")
    libritts = make_libritts(root, LIBRITTS_PARTS)
    aishell3 = make_aishell3(root, AISHELL3_PARTS)
    data = root / "data"
    common = ["--data-dir", str(data), "--libritts-dir", str(libritts), "--libritts-parts",
              " ".join(LIBRITTS_PARTS), "--aishell3-dir", str(aishell3), "--aishell3-num-dev", "2",
              "--num-jobs", "0", "--extra-tokenizer-flags", TOKENIZER_FLAGS]
    rc, out, err = run_recipe("egs/vallex/prepare.sh", *common, "--stage", "0", "--stop-stage", "1")
    assert rc == 0, out[-3000:] + err[-3000:]
    log = out + err
    rc, out, err = run_recipe("egs/vallex/prepare.sh", *common, "--stage", "2", "--stop-stage", "5",
                              "--shar-shard-size", "4", timeout=400)
    assert rc == 0, out[-3000:] + err[-3000:]
    return data, log + out + err


def test_every_stage_runs_and_the_download_is_skipped(vallex):
    data, log = vallex
    assert "LibriTTS found at" in log and "AISHELL-3 found at" in log
    assert "Traceback" not in log
    man = data / "manifests"
    for part in ("train", "test"):  # lhotse's aishell3 recipe wrote its manifests
        assert (man / f"aishell3_supervisions_{part}.jsonl.gz").is_file()
    assert (data / "shar" / "train").is_dir()  # stage 5


def test_cuts_carry_both_languages_in_every_part(vallex):
    data, log = vallex
    tok = data / "tokenized"
    parts = {p: _cuts(tok / f"vallex_cuts_{p}.jsonl.gz") for p in ("train", "dev", "test")}
    # train: 2 LibriTTS + 4 AISHELL-3; dev: 2 + the first 2 of AISHELL-3's test; test: 2 + the other 2
    assert {p: len(c) for p, c in parts.items()} == {"train": 6, "dev": 4, "test": 4}
    for p, cuts in parts.items():
        voices = {c["id"]: _voice(c) for c in cuts}
        assert set(voices.values()) == {"en-us", "cmn"}, p
        # the language follows the corpus: AISHELL-3's ids are its speakers' (SSB...)
        assert all((v == "cmn") == cut_id.startswith("SSB") for cut_id, v in voices.items()), p
    assert not {c["id"] for c in parts["dev"]} & {c["id"] for c in parts["test"]}
    # AISHELL-3's 44.1 kHz cuts were moved to the codec's 24 kHz (their audio loads at it)
    from lhotse import CutSet

    zh = next(c for c in CutSet.from_file(tok / "vallex_cuts_train.jsonl.gz") if c.id.startswith("SSB"))
    assert zh.sampling_rate == 24000 and zh.features.sampling_rate == 24000
    assert zh.load_audio().shape[-1] == zh.num_samples
    assert "cuts per language: cmn 4, en-us 2" in log  # stage 4, train


def test_mandarin_is_phonemized_as_mandarin(vallex):
    from valle.data.text import TextTokenizer

    data, _ = vallex
    zh = [c for c in _cuts(data / "tokenized" / "vallex_cuts_train.jsonl.gz") if _voice(c) == "cmn"]
    texts = {text for text, _ in MANDARIN}
    tokenizer = TextTokenizer()
    for cut in zh:
        sup = cut["supervisions"][0]
        assert sup["text"] in texts  # the characters, without AISHELL-3's pinyin
        assert sup["custom"]["tokens"]["text"] == tokenizer.phonemize_one(sup["text"], "cmn").symbols
        assert any(s[-1].isdigit() for s in sup["custom"]["tokens"]["text"])  # tones


def test_one_symbol_table_covers_both_languages(vallex):
    from valle.data.symbols import SymbolTable

    data, _ = vallex
    tok = data / "tokenized"
    table = SymbolTable.from_file(tok / "unique_text_tokens.k2symbols")
    used = {"en-us": set(), "cmn": set()}
    for part in ("train", "dev", "test"):
        for cut in _cuts(tok / f"vallex_cuts_{part}.jsonl.gz"):
            used[_voice(cut)].update(cut["supervisions"][0]["custom"]["tokens"]["text"])
    assert all(used.values())
    assert all(s in table for s in used["en-us"] | used["cmn"])
    assert used["cmn"] - used["en-us"]  # Mandarin brought symbols of its own
    stats = json.loads((tok / "vallex_text_stats.json").read_text())
    assert {k: int(v["cuts"]) for k, v in stats["total"]["languages"].items()} == {"en-us": 6, "cmn": 8}
    assert stats["total"]["text_tokens_per_second_p99"] > 0
    assert set(stats["parts"]) == {"libritts/dev-clean", "libritts/test-clean", "libritts/train-clean-100",
                                   "aishell3/train", "aishell3/test"}


def test_run_sh_trains_vallex_with_two_languages(tmp_path):
    # a stand-in for python that prints its command line: what egs/train.sh would launch
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\necho "LAUNCH $*"\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "egs/vallex/run.sh"), "--python", str(fake), "--nproc", "1"],
                          env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # the trainer launches (egs/train.sh --dtype auto also asks python whether CUDA is there)
    launches = [line for line in proc.stdout.splitlines()
                if line.startswith("LAUNCH -m torch.distributed.run")]
    assert len(launches) == 2  # AR, then NAR
    for line in launches:
        assert "--dataset vallex" in line and "--num-languages 2" in line and "--languages en-us,cmn" in line
        # the stand-in answers "yes" to "is there a GPU": batches sized to its memory
        assert "--max-duration auto" in line and "--memory-budget-gb 0" in line
    assert "--train-stage 1" in launches[0] and "--train-stage 2" in launches[1]


def test_tiny_run_sh_bilingual_starts_the_bilingual_demo(tmp_path):
    # egs/tiny/run.sh --bilingual true hands over to egs/tiny/local/bilingual.sh, whose first
    # command synthesises the corpus in both languages; a stand-in python records it and stops
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" > {tmp_path}/first\nexit 3\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "egs/tiny/run.sh"), "--bilingual", "true", "--python", str(fake)],
                          env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    first = (tmp_path / "first").read_text()
    assert first.startswith("-m valle.data.tiny synth") and "sentences_cmn.txt" in first

"""VALL-E X from a bilingual corpus to cross-lingual speech, as egs/tiny/run.sh --bilingual true
runs it (egs/tiny/local/bilingual.sh), small: 10 English + 10 Mandarin eSpeak NG utterances,
one phoneme judge over the shared phonemes, a tiny model trained for a few dozen steps
(--num-languages 2), bin/infer.py with --prompt-language in both directions, bin/evaluate.py
with a PER row per language. The model need not be intelligible; the pipeline must hold."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bilingual")
    proc = subprocess.run(
        ["bash", str(ROOT / "egs/tiny/local/bilingual.sh"), "--python", sys.executable,
         "--data-dir", str(tmp / "data"), "--exp", str(tmp / "exp"), "--limit", "10",
         "--max-steps", str(STEPS), "--judge-epochs", "4", "--num-items", "2", "--speaker-model", "none"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tmp / "data" / "tokenized", tmp / "exp", proc.stdout + proc.stderr


def _voices(path: Path) -> dict[str, str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        cuts = [json.loads(line) for line in f]
    return {c["id"]: c["supervisions"][0]["custom"]["espeak_voice"] for c in cuts}


def test_the_corpus_holds_both_languages_in_one_symbol_table(demo):
    from valle.data.symbols import SymbolTable
    from valle.data.text import TextTokenizer

    data, _, _ = demo
    for part in ("train", "dev", "test"):
        voices = _voices(data / f"tiny_cuts_{part}.jsonl.gz")
        assert set(voices.values()) == {"en-us", "cmn"}, part
        assert all((v == "cmn") == cut_id.startswith("zh_") for cut_id, v in voices.items())
    table = SymbolTable.from_file(data / "unique_text_tokens.k2symbols")
    tokenizer = TextTokenizer()
    assert all(s in table for s in tokenizer.phonemize_one("我们今天去公园散步。", "cmn").symbols)
    judge = torch.load(data / "judge.pt", map_location="cpu", weights_only=False)
    info = judge["info"] if "info" in judge else {}
    assert set(info.get("valid_per_by_language", {})) == {"cmn", "en-us"}


def test_the_checkpoint_knows_its_two_languages(demo):
    _, exp, log = demo
    payload = torch.load(exp / f"checkpoint-{STEPS}.pt", map_location="cpu", weights_only=False)
    assert payload["config"]["languages"] == ["en-us", "cmn"]
    assert payload["model"]["ar_language_embedding.weight"].shape[0] == 2
    assert "languages (id order): en-us, cmn" in log


def test_cross_lingual_synthesis_in_both_directions_with_per_per_language(demo):
    _, exp, log = demo
    infer = exp / "infer"
    wavs = sorted(p.name for p in infer.glob("*.wav"))
    # every item of both directions was synthesised (--min-len-ratio keeps rows from ending at once)
    assert wavs == ["en_text_zh_prompt_0.wav", "en_text_zh_prompt_1.wav",
                    "zh_text_en_prompt_0.wav", "zh_text_en_prompt_1.wav"]
    report = json.loads((exp / "eval.json").read_text())
    rows = report["rows"]
    assert [(r["row"]["language"], r["row"]["prompt_language"]) for r in rows] == \
        [("en-us", "cmn")] * 2 + [("cmn", "en-us")] * 2
    per_language = report["summary"]["per_language"]
    assert set(per_language) == {"en-us", "cmn"}
    for language, d in per_language.items():
        assert d["output"]["rows"] == 2
        mine = [r["output"] for r in rows if r["row"]["language"] == language]
        # the language's PER: its rows' edits over its rows' reference phonemes
        assert d["output"]["per"] == pytest.approx(sum(s["edits"] for s in mine) / sum(s["ref_phonemes"] for s in mine))
    # each text was scored against its own language's phonemes
    from valle.data.text import TextTokenizer
    from valle.eval.per import spoken

    tokenizer = TextTokenizer()
    for r in rows:
        expected = spoken(tokenizer.phonemize_one(r["row"]["text"], r["row"]["language"]).symbols)
        assert r["output"]["ref_phonemes"] == len(expected) > 0
    assert "language       | rows | PER   | GT PER" in log
    assert any(line.startswith("cmn ") for line in log.splitlines())

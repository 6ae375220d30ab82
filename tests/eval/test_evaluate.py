"""bin/evaluate.py end to end on ground-truth audio: per-row and aggregate figures, references,
JSON, TensorBoard, and one-line errors naming the row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bin"))


def _rows(test_examples, n=3):
    """(prompt_text, prompt_wav, text, out_wav, ref_wav): the 'output' is the ground truth itself."""
    by_voice: dict[str, list] = {}
    for _, _, cut in test_examples:
        by_voice.setdefault(cut.supervisions[0].speaker, []).append(cut)
    cuts = next(iter(by_voice.values()))
    rows = []
    for i in range(n):
        prompt, target = cuts[i + 1], cuts[i]
        wav = target.recording.sources[0].source
        rows.append((prompt.supervisions[0].text, prompt.recording.sources[0].source,
                     target.supervisions[0].text, wav, wav))
    return rows


def _write_tsv(path: Path, rows) -> Path:
    lines = ["prompt_text\tprompt_wav\ttext\tout_wav\tref_wav"] + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_evaluate_ground_truth_as_output(heldout_data, test_examples, tmp_path, capsys):
    import soundfile as sf

    from valle.eval.evaluate import main

    rows = _rows(test_examples)
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(2400, dtype=np.float32), 24000)
    rows.append((rows[0][0], rows[0][1], rows[0][2], str(silent), rows[0][4]))
    tsv = _write_tsv(tmp_path / "items.tsv", rows)
    out_json = tmp_path / "eval.json"
    rc = main(["--tsv", str(tsv), "--manifest-dir", str(heldout_data), "--output-json", str(out_json),
               "--exp-dir", str(tmp_path / "exp"), "--step", "7"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "codec resynth" in printed and "ground truth" in printed and str(silent) in printed
    report = json.loads(out_json.read_text())
    res = report["rows"]
    assert len(res) == 4
    for r in res[:3]:  # output == ground truth: identical figures
        assert r["output"]["per"] == r["ground_truth"]["per"] and r["output"]["per"] < 0.7
        assert r["duration_ratio_ref"] == pytest.approx(1.0)
        assert 0.5 < r["duration_ratio"] < 2.0  # the text at the prompt's speaking rate
        assert r["output"]["similarity"] > 0.5 and r["resynthesis"]["per"] is not None
        assert r["hit_length_cap"] is False
    assert res[3]["output"]["per"] >= 0.9 and res[3]["output"]["similarity"] is None  # too short to embed
    s = report["summary"]
    assert set(s) == {"output", "ground_truth", "codec_resynthesis"}
    assert s["output"]["per"] > s["ground_truth"]["per"]  # the silent row counts
    assert s["output"]["similarity_missing"] == 1 and s["output"]["hit_length_cap"] == 0.0
    assert report["meta"]["codec"] == "mel-rvq" and report["meta"]["speaker_model"] == "resemblyzer"
    assert any("WER not measured" in n for n in report["meta"]["notes"])
    events = list((tmp_path / "exp" / "tensorboard" / "eval").glob("events.out.tfevents.*"))
    assert events


def test_evaluate_infer_flags_and_errors(heldout_data, test_examples, tmp_path, capsys):
    import shutil

    from valle.eval.evaluate import main

    (prompt_text, prompt_wav, text, wav, _), = _rows(test_examples, 1)
    out_dir = tmp_path / "infer"
    out_dir.mkdir()
    shutil.copy(wav, out_dir / "0.wav")  # what bin/infer.py writes for one --text
    common = ["--manifest-dir", str(heldout_data), "--no-references", "--speaker-model", "none"]
    assert main(["--text", text, "--text-prompts", prompt_text, "--audio-prompts", prompt_wav,
                 "--output-dir", str(out_dir), *common]) == 0
    report = json.loads((out_dir / "eval.json").read_text())
    assert report["rows"][0]["row"]["out_wav"] == str(out_dir / "0.wav")
    # a missing output wav: one line naming the row and the file
    bad = _write_tsv(tmp_path / "bad.tsv", [(prompt_text, prompt_wav, text, "nope.wav", "")])
    capsys.readouterr()
    assert main(["--tsv", str(bad), *common]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bad.tsv:2" in err and "nope.wav" in err
    assert main(["--manifest-dir", str(tmp_path), "--tsv", str(bad)]) == 2
    assert "judge.pt" in capsys.readouterr().err

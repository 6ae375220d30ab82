"""--max-duration auto on a lhotse corpus (egs/tiny), CPU, the memory meter as the device:
the chosen seconds and the text budget derived from them, an epoch within the budget,
and a resumed run that keeps its checkpoint's choice."""

from __future__ import annotations

import json
import logging

import pytest

pytestmark = pytest.mark.timeout(600)

BUDGET_GB = 0.03


def argv(tiny_data, exp_dir, epochs=1):
    return ["--decoder-dim", "32", "--nhead", "2", "--num-decoder-layers", "1", "--dropout", "0",
            "--device", "cpu", "--tensorboard", "false", "--valid-samples", "0",
            "--manifest-dir", str(tiny_data), "--dataset", "tiny", "--num-workers", "0",
            "--num-buckets", "2", "--filter-max-duration", "3", "--exp-dir", str(exp_dir),
            "--max-duration", "auto", "--memory-budget-gb", str(BUDGET_GB),
            "--num-epochs", str(epochs), "--log-interval", "1"]


def test_auto_chooses_seconds_and_text_tokens_and_a_resume_keeps_them(tiny_data, tmp_path, caplog):
    from valle.data.datamodule import TEXT_BUDGET_MARGIN
    from valle.train.cli import parse_config
    from valle.train.loop import train

    with caplog.at_level(logging.INFO):
        first = train(parse_config(argv(tiny_data, tmp_path))).to_json()
    seconds, text = first["max_duration"], first["max_text_tokens"]
    assert isinstance(seconds, float) and 3 <= seconds
    rate = json.loads((tiny_data / "tiny_text_stats.json").read_text())["total"]["text_tokens_per_second_p99"]
    assert text == pytest.approx(TEXT_BUDGET_MARGIN * rate * seconds, abs=1)  # derived along with it
    assert "--max-duration auto = " in caplog.text and "fitted peak = " in caplog.text
    budget = int(BUDGET_GB * (1 << 30))
    assert first["memory_budget_bytes"] == budget and 0 < first["peak_memory_bytes"] <= budget
    assert first["oom_events"] == 0 and first["epochs"][0]["balanced"]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        second = train(parse_config(argv(tiny_data, tmp_path, epochs=2))).to_json()
    assert "resuming with the checkpoint's choice" in caplog.text
    assert "--max-duration auto = " not in caplog.text
    assert second["max_duration"] == seconds and second["max_text_tokens"] == text

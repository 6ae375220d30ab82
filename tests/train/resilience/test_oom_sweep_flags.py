"""scripts/oom_sweep.py's list flags: every value it accepts is swept as written, and a
value it does not know is refused by name (an earlier version read `--scaler both` as
"off" and swept half of what was asked)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("oom_sweep_flags", ROOT / "scripts" / "oom_sweep.py")
oom_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(oom_sweep)


@pytest.mark.parametrize("text, scalers", [("off", [False]), ("on", [True]),
                                           ("both", [False, True]), ("off,on", [False, True]),
                                           ("on,both", [True, False])])
def test_scaler_values_sweep_what_they_say(text, scalers):
    assert oom_sweep.parse_scalers(text) == scalers


@pytest.mark.parametrize("flag, text", [("--scaler", "yes"), ("--scaler", ""),
                                        ("--scenarios", "plain,lroa"), ("--failing", "one,none")])
def test_unknown_values_are_refused_by_name(flag, text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"{flag} .*not one of"):
        if flag == "--scaler":
            oom_sweep.parse_scalers(text)
        else:
            allowed = oom_sweep.SCENARIOS if flag == "--scenarios" else oom_sweep.FAILING_SETS
            oom_sweep.parse_list(flag, text, allowed)


def test_the_command_line_refuses_before_sweeping():
    proc = subprocess.run([sys.executable, "scripts/oom_sweep.py", "--scaler", "fp16", "--no-doc",
                           "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--scaler 'fp16': fp16 not one of off, on, both" in proc.stderr
    assert "[1/" not in proc.stdout  # nothing swept

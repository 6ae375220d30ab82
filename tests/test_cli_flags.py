"""Every flag of bin/trainer.py and bin/infer.py keeps its name, aliases, default and choices:
the parsers are generated from the config dataclasses now, and users must see no change.

The expected tables were written from the hand-written parsers of commit a5fee66 (and
--language's help then updated by main's ``--language auto``); ``python tests/test_cli_flags.py``
rewrites them from the current code: only do that for a change of flags that is meant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "cli"


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # Path, enums: as the help shows them


def flag_table(parser: argparse.ArgumentParser) -> dict[str, dict]:
    """dest -> its option strings, default, choices, help, metavar, nargs/const."""
    table = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        entry = table.setdefault(action.dest, {"flags": [], "default": _plain(action.default)})
        entry["flags"] += list(action.option_strings)
        entry["choices"] = _plain(list(action.choices)) if action.choices is not None else None
        entry["hidden"] = action.help == argparse.SUPPRESS
        entry["required"] = action.required
        entry["help"], entry["metavar"] = action.help, _plain(action.metavar)
        if action.nargs is not None or action.const is not None:
            entry["nargs"], entry["const"] = _plain(action.nargs), _plain(action.const)
    return table


def trainer_parser() -> argparse.ArgumentParser:
    from valle.train.cli import build_parser

    return build_parser()


def infer_parser() -> argparse.ArgumentParser:
    from valle.infer import build_parser

    return build_parser()


PARSERS = {"trainer": trainer_parser, "infer": infer_parser}


def expected(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}-flags.json").read_text())


def test_trainer_flags_are_unchanged():
    assert flag_table(trainer_parser()) == expected("trainer")


def test_infer_flags_are_unchanged():
    assert flag_table(infer_parser()) == expected("infer")


def test_the_tables_see_the_flags():
    # A broken table (no actions read) would make both tests above pass on two empty dicts.
    trainer = expected("trainer")
    assert trainer["oom_snapshot"]["flags"] == ["--oom-snapshot", "--memory-snapshot"]
    assert trainer["shuffle"]["flags"] == ["--shuffle", "--no-shuffle"]
    assert trainer["decoder_dim"]["default"] == 1024 and len(trainer) >= 100
    assert expected("infer")["stop_rule"]["choices"] == ["argmax-or-sampled", "sampled"]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, make in PARSERS.items():
        path = FIXTURES / f"{name}-flags.json"
        path.write_text(json.dumps(flag_table(make()), indent=1, sort_keys=True) + "\n")
        print("wrote", path)

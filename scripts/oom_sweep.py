#!/usr/bin/env python
"""`make oom-sweep`: fail every kind of allocation of a training step, SQLite-style.

For each configuration (world size, GradScaler or not, failing ranks, which step,
scenario) a dry run counts the step's allocating ops; then each chosen position
N is failed in its own training run and classified (tests/support/sweep.py).
Writes the tables into docs/oom.md between the sweep markers, with this command.

  python scripts/oom_sweep.py                 # the whole sweep (every op kind in every phase)
  python scripts/oom_sweep.py --select all --worlds 1 --scaler off   # every single allocation

Each configuration's result is kept under --cache (keyed by the code it ran on), so a
sweep that was stopped resumes where it stopped: rerun the same command.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.sweep import (  # noqa: E402
    PointResult,
    SweepConfig,
    SweepResult,
    elapsed,
    markdown_table,
    phase_table,
    run_sweep,
)

BEGIN, END = "<!-- oom-sweep:begin -->", "<!-- oom-sweep:end -->"


def configurations(worlds: list[int], scalers: list[bool], steps: list[int],
                   scenarios: list[str], failing_sets: list[str],
                   model_flags: tuple[str, ...] = ()) -> list[SweepConfig]:
    out = []
    for scenario in scenarios:
        for w in worlds:
            if scenario == "repair" and w == 1:
                continue  # a repair needs a healthy rank to copy from
            failing = ["all"] if w == 1 else ["one", "some", "all"]
            if w == 2 and scenario != "repair":
                failing = ["one", "all"]  # "some" is "one" at two ranks
            for scaler in scalers:
                for step in steps if scenario == "plain" else [max(steps[0], 1)]:
                    for f in failing:
                        if f in failing_sets:
                            out.append(SweepConfig(w, scaler, f, step, scenario, model_flags))
    return out


SCALER_CHOICES = {"off": [False], "on": [True], "both": [False, True]}
SCENARIOS = ("plain", "retry", "repair", "lora")
FAILING_SETS = ("one", "some", "all")


def parse_list(flag: str, text: str, allowed) -> list[str]:
    """`text` split at commas, each item one of `allowed`; a wrong one is named (not
    silently swept as something else)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    wrong = [t for t in items if t not in allowed]
    if wrong or not items:
        raise argparse.ArgumentTypeError(
            f"{flag} {text!r}: {', '.join(wrong) or 'nothing given'} not one of {', '.join(allowed)}")
    return items


def parse_scalers(text: str) -> list[bool]:
    """--scaler: off, on, both, or a comma list of off/on; GradScaler on or off per item."""
    out: list[bool] = []
    for item in parse_list("--scaler", text, tuple(SCALER_CHOICES)):
        out += [s for s in SCALER_CHOICES[item] if s not in out]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,3")
    p.add_argument("--scaler", default="off,on", help="off, on, both or off,on (fp16 autocast + GradScaler on CPU)")
    p.add_argument("--steps", default="startup,1,3",
                   help="steps whose allocations are failed (startup: the set-up; 1: a mid step with "
                        "validation, consistency check, checkpoint, then the run's end; 3: the epoch end)")
    p.add_argument("--scenarios", default="plain,retry,repair",
                   help="plain, retry, repair, lora (LoRA adapters on a frozen base)")
    p.add_argument("--failing", default="one,some,all", help="which failing-rank sets")
    p.add_argument("--select", default="kinds", choices=("kinds", "ends", "phases", "all"),
                   help="kinds: the first allocation of every (phase, op) kind of the step; "
                        "ends: its first and last; phases: the first of every phase; all: every one")
    p.add_argument("--model-flags", default="",
                   help='trainer flags added to the swept tiny model, e.g. "--guided-attention-weight 1"')
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "oom.md")
    p.add_argument("--no-doc", action="store_true", help="print the tables only")
    p.add_argument("--cache", type=Path, default=ROOT / "exp" / "oom-sweep-cache",
                   help="per-configuration results, reused by a rerun on the same code")
    p.add_argument("--no-cache", action="store_true", help="rerun every configuration")
    args = p.parse_args()
    try:
        scalers = parse_scalers(args.scaler)
        scenarios = parse_list("--scenarios", args.scenarios, SCENARIOS)
        failing = parse_list("--failing", args.failing, FAILING_SETS)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    configs = configurations([int(w) for w in args.worlds.split(",")], scalers,
                             [-1 if s == "startup" else int(s) for s in args.steps.split(",")],
                             scenarios, failing, tuple(shlex.split(args.model_flags)))
    start = time.monotonic()
    results = []
    resumed = 0
    cache = None if args.no_cache else args.cache / f"{_code_key()}-{args.select}"
    for i, cfg in enumerate(configs, 1):
        t0 = time.monotonic()
        r = _load(cache, cfg)
        if r is None:
            r = run_sweep(cfg, args.select)
            _store(cache, r)
        else:
            resumed += 1
            print(f"[{i}/{len(configs)}] {cfg.name}: from {cache}", flush=True)
        results.append(r)
        bad = [pt for pt in r.points if pt.outcome not in ("survived", "not hit")]
        print(f"[{i}/{len(configs)}] {cfg.name}: {dict(r.counts())} ({elapsed(t0)})", flush=True)
        for pt in bad:
            print(f"    N={pt.index} {pt.phase} {pt.op}: {pt.outcome} {pt.detail}", flush=True)
    command = "python scripts/oom_sweep.py " + shlex.join(sys.argv[1:])
    took = elapsed(start) + (f", {resumed} of {len(configs)} configurations from an earlier run "
                             f"of the same code" if resumed else "")
    text = (f"{BEGIN}\nCommand: `{command.strip()}` ({took} on {_machine()}).\n\n"
            f"{markdown_table(results)}\n\nBy phase (all configurations):\n\n{phase_table(results)}\n{END}")
    print(text)
    if not args.no_doc:
        doc = args.doc.read_text()
        if BEGIN in doc:
            doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: text, doc, flags=re.S)
        else:
            doc += f"\n\n## The allocation sweep\n\n{text}\n"
        args.doc.write_text(doc)
    bad = sum(r.counts().get(o, 0) for r in results for o in ("crash", "hang", "lost"))
    return 1 if bad else 0


# What a sweep runs: the trainer, and the sweep driver with the runs it starts (tests/support).
# Docs and the tests themselves do not change it.
SWEPT_CODE = ("valle", "bin", "scripts", "tests/support")


def _code_key(root: Path = ROOT) -> str:
    """A hash of the committed code the sweep runs, plus one of its uncommitted changes: a
    commit that touches only docs or tests (outside tests/support) keeps the cached results
    (the tree ids of the swept folders are unchanged), any change to the code starts a new
    cache."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True).stdout

    trees = git("rev-parse", *(f"HEAD:{d}" for d in SWEPT_CODE)).strip()
    code = "code-" + hashlib.sha1(trees.encode()).hexdigest()[:12] if trees else "nogit"
    dirty = git("diff", "HEAD", "--", *SWEPT_CODE)
    return code + ("-" + hashlib.sha1(dirty.encode()).hexdigest()[:8] if dirty else "")


def _cache_file(cache: Path, cfg: SweepConfig) -> Path:
    return cache / (cfg.name.replace(" ", "_").replace("+", "-") + ".json")


def _load(cache: Path | None, cfg: SweepConfig) -> SweepResult | None:
    if cache is None or not _cache_file(cache, cfg).exists():
        return None
    data = json.loads(_cache_file(cache, cfg).read_text())
    points = [PointResult(**{**pt, "also": [tuple(a) for a in pt["also"]]}) for pt in data["points"]]
    config = {**data["config"], "model_flags": tuple(data["config"].get("model_flags", ()))}
    return SweepResult(SweepConfig(**config), data["census_size"], points)


def _store(cache: Path | None, result: SweepResult) -> None:
    if cache is None:
        return
    cache.mkdir(parents=True, exist_ok=True)
    path = _cache_file(cache, result.config)
    path.with_suffix(".tmp").write_text(json.dumps(dataclasses.asdict(result)))
    path.with_suffix(".tmp").replace(path)


def _machine() -> str:
    import os

    return f"{os.cpu_count()} CPU cores, gloo"


if __name__ == "__main__":
    sys.exit(main())

"""Reading what a training run logged, for tests that compare runs."""

from __future__ import annotations

from pathlib import Path


def trained_cut_launches(exp_dir: Path, rank: int) -> list[list[tuple[int, list[str]]]]:
    """`<exp-dir>/trained-cuts-rank<R>.tsv` (--log-trained-cuts) split into launches: each
    launch appends, and a launch begins where the step index stops increasing, so a
    step trained twice shows as a second launch."""
    launches: list[list[tuple[int, list[str]]]] = []
    previous = None
    for line in (exp_dir / f"trained-cuts-rank{rank}.tsv").read_text().splitlines():
        step_text, _, ids = line.partition("\t")
        step = int(step_text)
        if previous is None or step <= previous:
            launches.append([])
        launches[-1].append((step, ids.split(",") if ids else []))
        previous = step
    return launches

"""Trainer runs for the multi-rank tests and the allocation sweep (tests/support/sweep.py).

Each function runs inside a rank started by `tests.support.harness.run_world` and
returns plain data (pickled back to the caller).
"""

from __future__ import annotations

from typing import Any

# A model small enough for 4 gloo ranks on 2 cores.
TINY_MODEL = ["--decoder-dim", "32", "--nhead", "2", "--num-decoder-layers", "1", "--dropout", "0",
              "--device", "cpu", "--tensorboard", "false", "--oom-check", "false"]


def train_worker(rank: int, world_size: int, argv: list[str]) -> dict[str, Any]:
    """Run the trainer in this rank; report its summary, final parameters, or its clean failure."""
    from valle.train.build import StartupError
    from valle.train.cli import parse_config
    from valle.train.loop import train
    from valle.train.resilience.quarantine import OomNotDataError
    from valle.train.resilience.step import (
        ConsistencyError,
        DdpBackwardOomError,
        NoHealthyRankError,
    )

    cfg = parse_config(argv)
    try:
        summary = train(cfg)
    except (NoHealthyRankError, DdpBackwardOomError, ConsistencyError, OomNotDataError,
            StartupError) as exc:
        return {"ok": False, "error": type(exc).__name__, "message": str(exc)}
    params = {k: v.detach().cpu().clone() for k, v in (summary.model_state or {}).items()}
    return {"ok": True, "summary": summary.to_json(), "params": params}


def matrix_worker(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> dict[str, Any]:
    """Several trainer runs in one process group (one spawn for a whole matrix row)."""
    return {name: train_worker(rank, world_size, argv) for name, argv in runs}


def exit_worker(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Several trainer runs in one process group, each as bin/trainer.py ends: its exit code."""
    from valle.train.cli import parse_config
    from valle.train.loop import main_from_config

    return {name: main_from_config(parse_config(argv)) for name, argv in runs}


def agree_worker(rank: int, world_size: int, values: list[float]) -> float:
    """`valle.train.autobatch.agree` with rank r proposing values[r] (the budget every rank
    trains with)."""
    from types import SimpleNamespace

    from valle.train.autobatch import agree
    from valle.train.dist import init_distributed
    from valle.train.resilience.channel import ControlChannel

    ctx = init_distributed("cpu")
    channel = ControlChannel(ctx)
    return agree(SimpleNamespace(gather_objects=channel.gather_objects), values[rank])

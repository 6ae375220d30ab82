"""Run a function on N local ranks (gloo on CPU) with a hard deadline.

Used by the multi-rank tests, the allocation sweep and scripts/bench_step.py
(`make bench`). Every run has a timeout: a hang kills the workers and raises
`WorldTimeout` instead of freezing the caller. Each worker joins the process
group through the same env:// path torchrun uses.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


class WorldTimeout(RuntimeError):
    pass


class WorkerFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, args: tuple,
           env: dict[str, str]) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), **env})
    import torch

    torch.set_num_threads(1)
    path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    with open(path, "wb") as f:
        pickle.dump(result, f)


def run_world(fn: Callable, world_size: int, *args, timeout: float = 120.0,
              env: dict[str, str] | None = None) -> list[tuple]:
    """Run `fn(rank, world_size, *args)` on every rank; returns each rank's
    ("ok", value) or ("error", message, traceback). Raises WorldTimeout on a hang."""
    ctx = mp.get_context("spawn")
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, out_dir, args, env),
                             daemon=False) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results = []
        for r in range(world_size):
            path = Path(out_dir) / f"rank{r}.pkl"
            if path.exists():
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(("error", f"rank {r} exited with code {procs[r].exitcode} "
                                 "without a result", ""))
        if alive:
            raise WorldTimeout(f"ranks {alive} still running after {timeout:.0f} s (hang); "
                               f"results so far: {[r[:2] for r in results]}")
        return results


def clean_launch_env() -> dict[str, str]:
    """This process's environment without the torchrun/rendezvous variables it may itself
    run under, for launching a fresh torchrun job from a test or a script."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_"))
                   or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def values(results: list[tuple]) -> list[Any]:
    """The ranks' return values; raises WorkerFailed with every rank's error."""
    errors = [f"rank {i}: {r[1]}\n{r[2]}" for i, r in enumerate(results) if r[0] != "ok"]
    if errors:
        raise WorkerFailed("\n".join(errors))
    return [r[1] for r in results]

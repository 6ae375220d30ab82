"""Which share of a part one tokenizer process takes, when many tokenize it together.

A part's cuts are cut into chunks of ``--chunk-size`` cuts in manifest order (the unit of
resume). Worker ``index`` of ``count`` takes the chunks whose number is ``index`` modulo
``count``: deterministic, disjoint, and covering every chunk, whatever the launcher. Who a
process is comes from, in this order of precedence for the outer level:

* ``--num-shards N --shard-index K`` (any scheduler; one process per shard);
* a SLURM job array (``SLURM_ARRAY_TASK_ID/_COUNT/_MIN/_STEP``), one task per shard;

and, nested inside that, torchrun's ``RANK``/``WORLD_SIZE`` (``--nnodes N --nproc-per-node G``).
So an array of 4 tasks each running torchrun with 2 processes makes 8 workers: worker
``outer * world_size + rank``. ``LOCAL_RANK`` picks the GPU (``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class ShardError(ValueError):
    """Inconsistent worker identity (one line naming the flag or variable)."""


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1
    local_rank: int = 0
    source: str = "one process"

    def owns(self, chunk: int) -> bool:
        return chunk % self.count == self.index

    @property
    def alone(self) -> bool:
        return self.count == 1

    def describe(self) -> str:
        return f"worker {self.index} of {self.count} ({self.source})"


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ShardError(f"environment variable {name}={value!r} is not an integer") from None


def _outer(num_shards: int | None, shard_index: int | None, env: Mapping[str, str]) -> tuple[int, int, str]:
    """(index, count, source) of the flags or the SLURM array; (0, 1, '') when neither."""
    if (num_shards is None) != (shard_index is None):
        raise ShardError("--num-shards and --shard-index go together (give both or neither)")
    if num_shards is not None:
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ShardError(f"--shard-index {shard_index} must lie in [0, --num-shards {num_shards})")
        return shard_index, num_shards, f"--shard-index {shard_index} --num-shards {num_shards}"
    task = _int_env(env, "SLURM_ARRAY_TASK_ID")
    if task is None:
        return 0, 1, ""
    count = _int_env(env, "SLURM_ARRAY_TASK_COUNT") or 1
    first = _int_env(env, "SLURM_ARRAY_TASK_MIN") or 0
    step = _int_env(env, "SLURM_ARRAY_TASK_STEP") or 1
    index = (task - first) // step
    if (task - first) % step or not 0 <= index < count:
        raise ShardError(f"SLURM_ARRAY_TASK_ID={task} is not one of {count} evenly spaced tasks from "
                         f"SLURM_ARRAY_TASK_MIN={first}: use a contiguous array (--array=0-{count - 1}) "
                         "or pass --num-shards/--shard-index")
    return index, count, f"SLURM array task {task} ({index} of {count})"


def resolve_shard(num_shards: int | None = None, shard_index: int | None = None,
                  env: Mapping[str, str] | None = None) -> Shard:
    """This process's share (see the module docstring)."""
    env = os.environ if env is None else env
    outer_index, outer_count, outer_source = _outer(num_shards, shard_index, env)
    world = _int_env(env, "WORLD_SIZE") or 1
    rank = _int_env(env, "RANK") or 0
    local_rank = _int_env(env, "LOCAL_RANK") or 0
    if not 0 <= rank < world:
        raise ShardError(f"RANK={rank} must lie in [0, WORLD_SIZE={world})")
    sources = [s for s in (outer_source, f"torchrun rank {rank} of {world}" if world > 1 else "") if s]
    return Shard(index=outer_index * world + rank, count=outer_count * world, local_rank=local_rank,
                 source=", ".join(sources) or "one process")

"""The allocation sweep: fail every allocating op of a step in turn, as SQLite fails
every malloc, and classify what the trainer does.

A dry run counts the allocating aten ops of every step (`--count-allocations`:
the census, in order, by phase and op). Then for each chosen position N, one
training run fails the Nth allocation of the target step on the failing ranks
(`--inject-fault alloc@STEP:N:RANKS`). Each point is classified:

* survived  - every rank finished; ranks agreed after every step (the trainer's
  own `--check-consistency-every 1`); cuts trained + quarantined + skipped =
  drawn with nothing quarantined; final parameters equal to the fault-free
  run's (dropout 0; fp32: 1e-4 relative; fp16 autocast, where a retry that split
  its batch rounds differently: every tensor within 1% of how far training
  moved it);
* clean exit - every rank stopped with one of the trainer's named errors (what a
  failure at set-up, before any step, must give: `StartupError` on every rank);
* crash     - some rank raised anything else (a collective mismatch, ...);
* hang      - the world did not finish within its deadline;
* lost      - finished, but a cut was lost or quarantined, or the parameters differ;
* not hit   - N is beyond what that rank allocated (the fault never fired).

Points run back to back in one process group; after a crash or a hang the
group is rebuilt for the points left. Used by `scripts/oom_sweep.py`
(`make oom-sweep`, the whole sweep) and by a strided test in `make test`.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.harness import WorldTimeout, run_world

OUTCOMES = ("survived", "clean exit", "crash", "hang", "lost", "not hit")
NAMED_ERRORS = ("NoHealthyRankError", "OomNotDataError", "BatchTooLargeError", "StartupError")
STEPS_PER_EPOCH = 3


@dataclass(frozen=True)
class SweepConfig:
    world_size: int = 2
    scaler: bool = False  # CPU autocast float16 + torch.amp.GradScaler("cpu")
    failing: str = "one"  # one, some, all
    # 1: a mid step with validation, consistency check, checkpoint, then the run's end;
    # 3: the epoch's end (all ranks dry, epoch checkpoint)
    fault_step: int = 1
    # plain, retry (a named forward OOM first), repair (a damaged rank), lora (plain, training
    # LoRA adapters on a frozen base: --lora-rank on --start-from)
    scenario: str = "plain"
    # Trainer flags added to the tiny model's (e.g. --guided-attention-weight 1: the demo's
    # AR loss, whose probe allocates in the forward).
    model_flags: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        where = "startup" if self.fault_step < 0 else f"step{self.fault_step}"
        flags = f" [{' '.join(self.model_flags)}]" if self.model_flags else ""
        return (f"ws{self.world_size} {'fp16+scaler' if self.scaler else 'fp32'} "
                f"{self.failing} {where} {self.scenario}{flags}")

    @property
    def expected_steps(self) -> int:
        # The run stops right after the swept step's window (which then also holds the
        # epoch's end), unless that step is the epoch's last anyway.
        if self.fault_step < 0:
            return 1  # set-up: every rank should stop (StartupError) before any step
        return min(self.fault_step + 1, STEPS_PER_EPOCH)

    def failing_ranks(self) -> list[int]:
        w = self.world_size
        if self.scenario == "repair":  # rank w-1 is the damaged one; rank 0 the source
            return {"one": [w - 1], "some": [0], "all": list(range(w))}[self.failing]
        return {"one": [w - 1], "some": list(range(0, w, 2)), "all": list(range(w))}[self.failing]


@dataclass
class PointResult:
    index: int  # N, 1-based
    phase: str
    op: str
    outcome: str
    detail: str = ""
    also: list[tuple[str, str]] = field(default_factory=list)  # other ranks' (phase, op) at N

    @property
    def phases(self) -> set[str]:
        return {self.phase, *(p for p, _ in self.also)}


@dataclass
class SweepResult:
    config: SweepConfig
    census_size: int
    points: list[PointResult] = field(default_factory=list)

    def counts(self) -> Counter:
        return Counter(p.outcome for p in self.points)


def trainer_argv(exp_dir: Path, cfg: SweepConfig, extra: list[str]) -> list[str]:
    from tests.support.scenarios import TINY_MODEL

    w = cfg.world_size
    argv = TINY_MODEL + [
        "--exp-dir", str(exp_dir), "--synthetic-data", str(4 * w * STEPS_PER_EPOCH),
        "--synthetic-batch-size", str(4 * w), "--num-epochs", "1",
        "--check-consistency-every", "1", "--average-period", "1", "--valid-interval", "2",
        "--save-every-n", "2", "--log-interval", "1", "--base-lr", "0.01", "--warmup-steps", "2",
        "--bucket-cap-mb", "0.05", "--collective-timeout", "30", "--save-oom-batches", "0",
        "--dtype", "float16" if cfg.scaler else "float32",
    ]
    if cfg.expected_steps < STEPS_PER_EPOCH:
        argv += ["--max-steps", str(cfg.expected_steps)]
    if cfg.scenario == "retry":
        argv += ["--inject-fault", f"forward@{cfg.fault_step}:{w - 1}"]
    elif cfg.scenario == "repair":
        # rank w-1's update fails at step fault_step-1 on every local retry (2, so x3): it
        # is repaired from rank 0 in step fault_step, whose allocations are swept
        argv += ["--inject-fault", f"optimizer@{cfg.fault_step - 1}x3:{w - 1}"]
    elif cfg.scenario == "lora":
        argv += ["--start-from", str(LORA_BASE), "--lora-rank", "4", "--optimizer-name", "AdamW"]
    return argv + list(cfg.model_flags) + extra


# The lora scenario's base: the tiny model's initial weights, written by each sweep's dry run.
LORA_BASE = Path(tempfile.gettempdir()) / "valle-oom-sweep-lora-base.pt"


def write_lora_base(cfg: SweepConfig) -> None:
    """The frozen base of the lora scenario (atomic: concurrent sweeps write the same bytes)."""
    import os

    import torch

    from valle.models import get_model
    from valle.train.checkpoint import make_payload
    from valle.train.cli import parse_config

    config = parse_config(trainer_argv(LORA_BASE.parent / "unused", SweepConfig(cfg.world_size), []))
    torch.manual_seed(config.seed)
    model = get_model(config.model)
    tmp = LORA_BASE.with_name(f"{LORA_BASE.name}.{os.getpid()}.tmp")
    torch.save(make_payload(model=model.state_dict(), step=0, epoch=1, train_stage=0,
                            config=config.checkpoint_config()), tmp)
    os.replace(tmp, LORA_BASE)


def _quiet() -> None:
    import logging

    logging.disable(logging.WARNING)


def sweep_worker(rank: int, world_size: int, cfg: SweepConfig, points: list[int],
                 root: str, clean_params_path: str) -> None:
    """Run the points in order in this process group; one JSON line per point."""
    import torch

    from tests.support.scenarios import train_worker

    _quiet()
    clean = torch.load(clean_params_path) if clean_params_path else None
    initial = _initial_params(cfg, Path(root)) if cfg.scaler else None
    ranks = ",".join(map(str, cfg.failing_ranks()))
    out = Path(root) / f"progress-rank{rank}.jsonl"
    for n in points:
        exp = Path(root) / f"point-{n}"
        step = "startup" if cfg.fault_step < 0 else cfg.fault_step
        argv = trainer_argv(exp, cfg, ["--inject-fault", f"alloc@{step}:{n}:{ranks}"])
        record: dict[str, Any] = {"n": n}
        try:
            r = train_worker(rank, world_size, argv)
        except BaseException as exc:  # noqa: BLE001 - classified, then this group is done
            record.update(status="crash", detail=f"{type(exc).__name__}: {str(exc)[:300]}")
            _append(out, record)
            return
        if not r["ok"]:
            record.update(status="named", detail=f"{r['error']}: {r['message'][:200]}")
        else:
            epoch = r["summary"]["epochs"][0]
            record.update(status="ok", steps=r["summary"]["steps"], balanced=epoch["balanced"],
                          quarantined=epoch["cuts_quarantined"], trained=epoch["cuts_trained"],
                          drawn=epoch["cuts_drawn"], equal=_equal(r["params"], clean, initial),
                          fired=_fired(exp, rank))
        _append(out, record)


def _fired(exp: Path, rank: int) -> bool:
    events = exp / "oom" / f"events-rank{rank}.jsonl"
    return events.exists() and "allocation #" in events.read_text()


def _initial_params(cfg: SweepConfig, root: Path) -> dict:
    """The trainer's initial weights (same seed, same architecture; in the lora scenario
    the frozen base with its adapters attached, as the trainer attaches them)."""
    import torch

    from valle.models import get_model
    from valle.train.cli import parse_config

    config = parse_config(trainer_argv(root / "initial", cfg, []))
    torch.manual_seed(config.seed)
    model = get_model(config.model)
    if config.lora.enabled:
        from valle.models.convert import from_payload, load_payload
        from valle.train.finetune import attach_lora

        base, _ = from_payload(load_payload(config.start_from), config.start_from)
        attach_lora(config.lora, config.start_from, model, base)
    return model.state_dict()


def _equal(params: dict, clean: dict | None, initial: dict | None = None,
           rtol: float = 1e-4, atol: float = 1e-5, fp16_share: float = 0.01) -> bool:
    """Final parameters equal to the fault-free run's: to float tolerance in fp32. Under
    fp16 autocast a retry that had to split its batch rounds differently (other shapes,
    other fp16 sums), so there each tensor must differ from the fault-free run by less
    than `fp16_share` of the distance training moved it (measured: about 0.1%)."""
    import torch

    if clean is None:
        return True
    if initial is None:
        return all(torch.allclose(params[k], clean[k], rtol=rtol, atol=atol) for k in clean)
    for k in clean:
        moved = (clean[k].float() - initial[k].float()).norm()
        if (params[k].float() - clean[k].float()).norm() > fp16_share * moved + atol:
            return False
    return True


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def census_worker(rank: int, world_size: int, argv: list[str]) -> dict[str, Any]:
    from tests.support.scenarios import train_worker

    _quiet()
    return train_worker(rank, world_size, argv)


def dry_run(cfg: SweepConfig, root: Path) -> tuple[dict[int, list[list[str]]], dict]:
    """The census of the target step on every rank, and the fault-free parameters."""
    exp = root / "dry"
    if cfg.scenario == "lora":
        write_lora_base(cfg)
    argv = trainer_argv(exp, cfg, ["--count-allocations", str(root / "census.json")])
    results = run_world(census_worker, cfg.world_size, argv, timeout=180)
    outcome = [r for r in results if r[0] != "ok" or not r[1]["ok"]]
    if outcome:
        raise RuntimeError(f"{cfg.name}: the dry run failed: {outcome[0]}")
    census = {}
    for rank in range(cfg.world_size):
        steps = json.loads(Path(f"{root / 'census.json'}.rank{rank}").read_text())
        census[rank] = steps.get(str(cfg.fault_step), [])
    return census, results[0][1]["params"]


def choose_points(census: dict[int, list[list[str]]], ranks: list[int], mode: str,
                  last: bool = False) -> dict[int, list[tuple[str, str]]]:
    """Positions N to fail, each with the (phase, op) it was chosen for on each failing
    rank that chose it (ranks may differ: rank 0 writes the checkpoints). `kinds`: the first (with
    `last`, the last) occurrence of every (phase, op) on the failing ranks - every op
    kind in every phase; `ends`: the first and the last of each; `phases`: the first
    (last) of every phase; `all`: every position."""
    if mode == "all":
        longest = max((census[r] for r in ranks), key=len)
        return {i: [tuple(longest[i - 1])] for i in range(1, len(longest) + 1)}
    seen: dict[tuple, list[tuple[int, tuple[str, str]]]] = {}
    for rank in ranks:
        for i, (phase, op) in enumerate(census[rank], 1):
            key = (phase,) if mode == "phases" else (phase, op)
            seen.setdefault(key, []).append((i, (phase, op)))
    points: dict[int, list[tuple[str, str]]] = {}
    for positions in seen.values():
        chosen = [max(positions) if last else min(positions)]
        if mode == "ends":
            chosen.append(max(positions))
        for n, label in chosen:
            if label not in points.setdefault(n, []):
                points[n].append(label)
    return dict(sorted(points.items()))


def run_sweep(cfg: SweepConfig, mode: str = "kinds", per_point_s: float = 40.0,
              progress=None) -> SweepResult:
    import torch

    with tempfile.TemporaryDirectory(prefix="oom-sweep-") as tmp:
        root = Path(tmp)
        census, clean = dry_run(cfg, root)
        clean_path = root / "clean.pt"
        torch.save(clean, clean_path)
        ranks = cfg.failing_ranks()
        # In the retry scenario the step's last allocations are the retry's.
        labels = choose_points(census, ranks, mode, last=cfg.scenario == "retry")
        points = list(labels)
        result = SweepResult(cfg, max(len(census[r]) for r in ranks))
        todo = list(points)
        while todo:
            chunk_root = root / f"chunk-{todo[0]}"
            chunk_root.mkdir()
            hung = False
            try:
                run_world(sweep_worker, cfg.world_size, cfg, todo, str(chunk_root), str(clean_path),
                          timeout=per_point_s * len(todo) + 60)
            except WorldTimeout:
                hung = True
            done = _read_progress(chunk_root, cfg.world_size)
            for n in list(todo):
                if n not in done:
                    break
                todo.remove(n)
                (phase, op), *also = labels[n]
                outcome, detail = classify(done[n], cfg)
                result.points.append(PointResult(n, phase, op, outcome, detail, also))
                if progress:
                    progress(cfg, result.points[-1])
            crashed = any(r["status"] == "crash" for records in done.values() for r in records)
            if todo and (hung or (todo[0] not in done and not crashed)):
                # The next point took the group down (a hang, or a process that died
                # without writing its line on every rank).
                n = todo.pop(0)
                (phase, op), *also = labels[n]
                result.points.append(PointResult(n, phase, op, "hang" if hung else "crash",
                                                 "no result from every rank", also))
                if progress:
                    progress(cfg, result.points[-1])
        return result


def _read_progress(root: Path, world_size: int) -> dict[int, list[dict]]:
    per_rank = []
    for rank in range(world_size):
        path = root / f"progress-rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        per_rank.append({json.loads(x)["n"]: json.loads(x) for x in lines})
    common = set.intersection(*(set(d) for d in per_rank)) if per_rank else set()
    return {n: [d[n] for d in per_rank] for n in common}


def classify(records: list[dict], cfg: SweepConfig) -> tuple[str, str]:
    statuses = {r["status"] for r in records}
    if "crash" in statuses:
        return "crash", next(r["detail"] for r in records if r["status"] == "crash")
    if statuses == {"named"}:
        details = {r["detail"].split(":")[0] for r in records}
        if details <= set(NAMED_ERRORS) and len(details) == 1:
            return "clean exit", records[0]["detail"][:160]
        return "crash", "; ".join(r["detail"] for r in records)
    if statuses != {"ok"}:
        return "crash", "some ranks stopped, others finished: " + "; ".join(
            r.get("detail", "ok") for r in records)
    if not any(r["fired"] for r in records):
        return "not hit", ""
    r0 = records[0]
    problems = []
    if any(r["steps"] != cfg.expected_steps for r in records):
        problems.append(f"steps {[r['steps'] for r in records]}")
    if not all(r["balanced"] for r in records) or r0["trained"] != r0["drawn"]:
        problems.append(f"cuts: drawn {r0['drawn']}, trained {r0['trained']}")
    quarantined = max(r["quarantined"] for r in records)
    if quarantined:
        problems.append(f"{quarantined} healthy cut(s) quarantined")
    if not all(r["equal"] for r in records):
        problems.append("final parameters differ from the fault-free run")
    return ("lost", "; ".join(problems)) if problems else ("survived", "")


def markdown_table(results: list[SweepResult]) -> str:
    lines = ["| configuration | allocations in the step | points | " + " | ".join(OUTCOMES) + " |",
             "|---" * (3 + len(OUTCOMES)) + "|"]
    total: Counter = Counter()
    for r in results:
        c = r.counts()
        total += c
        lines.append(f"| {r.config.name} | {r.census_size} | {len(r.points)} | "
                     + " | ".join(str(c.get(o, 0)) for o in OUTCOMES) + " |")
    lines.append(f"| **all** | | {sum(len(r.points) for r in results)} | "
                 + " | ".join(f"**{total.get(o, 0)}**" for o in OUTCOMES) + " |")
    return "\n".join(lines)


def phase_table(results: list[SweepResult]) -> str:
    """Points per phase and outcome, over every configuration (a point that hits
    different phases on different ranks counts in each)."""
    per_phase: dict[str, Counter] = {}
    for r in results:
        for p in r.points:
            for phase in p.phases:
                per_phase.setdefault(phase, Counter())[p.outcome] += 1
    lines = ["| phase | " + " | ".join(OUTCOMES) + " |", "|---" * (1 + len(OUTCOMES)) + "|"]
    for phase in sorted(per_phase):
        c = per_phase[phase]
        lines.append(f"| {phase} | " + " | ".join(str(c.get(o, 0)) for o in OUTCOMES) + " |")
    return "\n".join(lines)


def elapsed(start: float) -> str:
    return f"{time.monotonic() - start:.0f} s"

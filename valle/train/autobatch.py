"""`--max-duration auto`: the batch budget that fills the device's memory, chosen before training.

1. Measure: the pessimistic batches (the worst this rank will see, valle.train.data's
   `pessimistic_batches`) are built at a few budgets and each is run exactly as training
   runs it (`ResilientStep.trial`: stage, dtype, GradScaler, backward reserve, --compile),
   its peak read from the memory meter (valle.train.resilience.meter).
2. Fit: peak = live bytes before the step (parameters, optimizer state) + a constant
   (gradients, workspaces) + a x padded frames + b x padded text tokens + c x cuts
   + d x cuts x (text + frames)^2 (attention), by non-negative least squares.
3. Choose: the pessimistic batches grow in proportion to the budget (more rows, the same
   row lengths), so the fit predicts each at any budget; the largest budget whose worst
   batch is predicted to fit in (memory budget - backward reserve) x (1 - headroom).
4. Check: the pessimistic batches at that budget are run once for real; a failure lowers
   the budget by 5% and checks again. Then every rank takes the minimum over ranks.

The budget's unit is the data's: seconds of audio per batch (--max-duration, with
--max-text-tokens auto re-derived from it) for a lhotse corpus, cuts per global batch
(--synthetic-batch-size) for --synthetic-data.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from valle.train.batching import Batch, batch_size
from valle.train.resilience.memory import free_memory, is_oom_error
from valle.train.resilience.meter import describe_bytes

logger = logging.getLogger(__name__)

FEATURES = ("constant", "frames", "text", "cuts", "attention")
# Fragmentation: the CUDA caching allocator rounds and splits blocks, and cuBLAS/cuDNN
# workspaces are not in max_memory_allocated: 10% on CUDA (the figure; make
# gpu-check item 5 measures what it leaves). The CPU meter counts exactly, so there only
# the fit's error and the per-step randomness (NAR stage, prompt lengths) need room.
DEFAULT_HEADROOM = {"cuda": 0.10, "census": 0.03}
CHECK_RETRIES = 8
CHECK_STEP_DOWN = 0.95


@dataclass(frozen=True)
class BatchShape:
    """What a batch's activation memory grows with (padded, as the model computes it)."""

    frames: int
    text: int
    cuts: int
    attention: float  # cuts x (text + frames)^2: the attention scores

    @classmethod
    def of(cls, batch: Batch) -> BatchShape:
        cuts = batch_size(batch)
        frames = int(batch["audio_features"].shape[1])
        text = int(batch["text_tokens"].shape[1])
        return cls(cuts * frames, cuts * text, cuts, float(cuts * (text + frames) ** 2))

    def scaled(self, factor: float) -> BatchShape:
        """The same kind of batch with `factor` times the rows (row lengths unchanged)."""
        return BatchShape(self.frames * factor, self.text * factor, self.cuts * factor,
                          self.attention * factor)

    def vector(self) -> list[float]:
        return [1.0, float(self.frames), float(self.text), float(self.cuts), self.attention]


@dataclass
class Probe:
    budget: float
    criterion: str
    shape: BatchShape
    base_bytes: int  # live before the step
    peak_bytes: int | None  # None: out of memory


@dataclass
class MemoryModel:
    """peak = base + sum(coef[f] x feature f) (see the module docstring)."""

    base_bytes: int
    coef: dict[str, float]
    max_error: float = 0.0  # largest relative error over the fitted probes

    def predict(self, shape: BatchShape) -> float:
        return self.base_bytes + sum(c * x for c, x in zip(self.coef.values(), shape.vector()))

    def describe(self) -> str:
        units = {"constant": "", "frames": " x padded frames", "text": " x padded text tokens",
                 "cuts": " x cuts", "attention": " x cuts x (text + frames)^2"}
        terms = [f"{describe_bytes(self.base_bytes)} (parameters, optimizer state)"]
        for name, c in self.coef.items():
            if c > 0:
                terms.append(describe_bytes(c) if name == "constant" else f"{c:.4g} B{units[name]}")
        return " + ".join(terms) + f"  (largest error on the probes {self.max_error:.1%})"


def fit_memory_model(probes: list[Probe]) -> MemoryModel:
    """Non-negative least squares of (peak - base) on the features, relative errors weighing
    probes equally.

    Exact NNLS by enumeration: the optimum is the plain least-squares fit on its own support,
    so every subset of the five features is solved and the best one whose coefficients are
    all >= 0 wins; among equally good subsets, the smallest (then the first in FEATURES
    order). Probes of one batch grown in proportion make the features collinear: a greedy
    active set, or lstsq on the rank-deficient whole, then picks one of many exact solutions
    by the LAPACK driver's rounding (different on another CPU); the smallest exact support
    has full rank, so its solution is unique."""
    ok = [p for p in probes if p.peak_bytes is not None]
    if not ok:
        raise ValueError("no probe fitted in memory: nothing to fit")
    base = min(p.base_bytes for p in ok)
    x = torch.tensor([p.shape.vector() for p in ok], dtype=torch.float64)
    y = torch.tensor([p.peak_bytes - base for p in ok], dtype=torch.float64)
    weight = 1.0 / y.clamp(min=1.0)  # relative error
    target = y * weight
    fits: list[tuple[float, tuple[int, ...], torch.Tensor]] = []
    for support in _supports(len(FEATURES)):
        coef = _least_squares(x[:, support] * weight[:, None], target)
        if coef is None or (coef < 0).any():
            continue
        full = torch.zeros(len(FEATURES), dtype=torch.float64)
        full[list(support)] = coef
        fits.append((float(((x * weight[:, None]) @ full - target).norm()), support, full))
    # The empty support always fits (residual |target|), so `fits` is never empty. A
    # tolerance on the residual lets an exact fit on fewer features beat a rounding-level
    # "better" one on more.
    least = min(residual for residual, _, _ in fits)
    near = [(len(support), support, full) for residual, support, full in fits
            if residual <= least + 1e-9 * (1.0 + least)]
    best_coef = min(near, key=lambda fit: fit[:2])[2]
    model = MemoryModel(base, dict(zip(FEATURES, best_coef.tolist())))
    model.max_error = max(abs(model.predict(p.shape) - p.peak_bytes) / p.peak_bytes for p in ok)
    return model


def _supports(n: int) -> list[tuple[int, ...]]:
    """Every subset of range(n), the empty one included (the zero model)."""
    return [tuple(i for i in range(n) if mask >> i & 1) for mask in range(2 ** n)]


def _least_squares(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """argmin |a c - b| with columns scaled to unit norm; None when a column is zero or the
    columns are dependent (another support holds the same fit with fewer features)."""
    if a.shape[1] == 0:
        return torch.zeros(0, dtype=a.dtype)
    scale = a.norm(dim=0)
    if (scale == 0).any():
        return None
    scaled = a / scale
    if int(torch.linalg.matrix_rank(scaled, rtol=1e-10)) < a.shape[1]:
        return None
    return torch.linalg.lstsq(scaled, b[:, None], driver="gelsd").solution[:, 0] / scale


def usable_bytes(budget_bytes: int, reserve_bytes: int, headroom: float) -> int:
    """(memory budget - backward reserve) x (1 - headroom)."""
    return int((budget_bytes - reserve_bytes) * (1.0 - headroom))


def largest_budget(model: MemoryModel, shapes: dict[str, BatchShape], at_budget: float,
                   limit: float) -> tuple[float, str]:
    """The largest budget whose every pessimistic batch (measured at `at_budget`, grown
    in proportion) is predicted under `limit`; and the criterion that bounds it."""
    best, bound = math.inf, ""
    for name, shape in shapes.items():
        fixed = model.predict(shape.scaled(0.0))
        growth = model.predict(shape) - fixed  # bytes per `at_budget` of budget
        if growth <= 0:
            continue
        budget = at_budget * (limit - fixed) / growth
        if budget < best:
            best, bound = budget, name
    return best, bound


# -- measuring ----------------------------------------------------------------------


def trial_peak(stepper, meter, batch: Batch) -> tuple[int, int | None]:
    """(live bytes before, peak bytes of) one forward + backward of `batch` as training
    runs it; peak None when it ran out of memory (memory is freed again)."""
    free_memory(stepper.device)
    base = meter.live_bytes()
    meter.reset_peak()
    failed = False
    try:
        stepper.trial(batch)
    except Exception as exc:  # noqa: BLE001 - only OOMs are answers here
        if not is_oom_error(exc):
            raise
        failed = True
    # Outside the except block: the exception no longer pins the step's tensors.
    if failed:
        stepper.reserve.release()
        stepper.sync.zero_grad()
        release_failed_backward(stepper)
        free_memory(stepper.device)
        return base, None
    return base, meter.peak_bytes()


def release_failed_backward(stepper) -> None:
    """A backward that raised leaves its pending gradient buffers with the autograd engine
    until the next backward runs (measured: 14 of 20 MiB of a tiny model's step stayed
    live); a one-element backward on the host releases them before the next probe."""
    with stepper.phases.host_work():
        torch.ones(1, requires_grad=True).sum().backward()


@dataclass
class BudgetSource:
    """Where the budget goes: its flag, where the search starts, how to round it, and the
    pessimistic batches of this rank at a given budget."""

    flag: str
    start: float
    batches_at: Callable[[float], dict[str, Batch]]
    round_down: Callable[[float], float]
    minimum: float
    unit: float = 1.0  # the smallest step the check lowers a budget by


@dataclass
class Choice:
    budget: float
    bound_by: str
    limit_bytes: int
    model: MemoryModel
    probes: list[Probe] = field(default_factory=list)
    checked_peak: int | None = None
    predicted_peak: float = 0.0


def probe_budget(stepper, meter, source: BudgetSource, budget: float) -> list[Probe]:
    """Each pessimistic batch at `budget`, run once; says what it found (the search's progress)."""
    probes = []
    for name, batch in source.batches_at(budget).items():
        base, peak = trial_peak(stepper, meter, batch)
        probes.append(Probe(budget, name, BatchShape.of(batch), base, peak))
    peaks = [p.peak_bytes for p in probes]
    logger.info("%s auto: probed %g, peak %s", source.flag, budget,
                "OOM" if None in peaks else describe_bytes(max(peaks, default=0)))
    return probes


def fits(probes: list[Probe], limit: int) -> bool:
    return all(p.peak_bytes is not None and p.peak_bytes <= limit for p in probes)


def search_budget(stepper, meter, source: BudgetSource, limit: int) -> Choice:
    """Steps 1-4 of the module docstring on this rank (no collective)."""
    probes: list[Probe] = []
    budget = source.start
    # A first budget whose pessimistic batches fit (halved until they do).
    while not fits(found := probe_budget(stepper, meter, source, budget), limit):
        if budget <= source.minimum:
            raise RuntimeError(f"{source.flag} auto: even {budget:g} does not fit in "
                               f"{describe_bytes(limit)}: lower the model size or raise "
                               "--memory-budget-gb")
        budget = max(source.minimum, source.round_down(budget / 2))
    probes += found
    # Doubled until the peak reaches half the limit: small batches have costs of their
    # own (a fixed part dominates), the fit must see the regime it will be used in.
    ceiling = math.inf  # the smallest budget seen not to fit
    enough = math.inf  # a budget whose batches already hold all the data there is
    while max(p.peak_bytes for p in found) < limit / 2:
        before = {p.shape for p in found}
        budget = source.round_down(budget * 2)
        found = probe_budget(stepper, meter, source, budget)
        if not fits(found, limit):
            ceiling = budget
            break
        probes += found
        if {p.shape for p in found} == before:  # the batches stopped growing: a small corpus
            enough = budget
            break
    model, reference, shapes = _fit(probes)
    # One more, near the answer: the fit is best where it is used.
    near = source.round_down(0.85 * largest_budget(model, shapes, reference, limit)[0])
    if math.isfinite(near) and reference < near < min(ceiling, enough):
        found = probe_budget(stepper, meter, source, near)
        if fits(found, limit):
            probes += found
            model, reference, shapes = _fit(probes)
        else:
            ceiling = near
    chosen, bound = largest_budget(model, shapes, reference, limit)
    chosen = max(source.minimum, source.round_down(min(chosen, ceiling - source.unit, enough)))
    if chosen >= enough:
        bound = "the data (its batches stopped growing)"
    choice = Choice(chosen, bound, limit, model, probes)
    return check_choice(stepper, meter, source, choice)


def _fit(probes: list[Probe]) -> tuple[MemoryModel, float, dict[str, BatchShape]]:
    """The model, the largest budget probed, and its pessimistic batches' shapes."""
    reference = max(p.budget for p in probes)
    return (fit_memory_model(probes), reference,
            {p.criterion: p.shape for p in probes if p.budget == reference})


def check_choice(stepper, meter, source: BudgetSource, choice: Choice) -> Choice:
    """Run the pessimistic batches at the chosen budget once; lower it by 5% (at least one
    unit) while one fails or exceeds the limit."""
    for _ in range(CHECK_RETRIES):
        found = probe_budget(stepper, meter, source, choice.budget)
        peaks = [p.peak_bytes for p in found]
        if all(p is not None and p <= choice.limit_bytes for p in peaks):
            choice.checked_peak = max(peaks)
            choice.predicted_peak = max(choice.model.predict(p.shape) for p in found)
            return choice
        lower = min(source.round_down(choice.budget * CHECK_STEP_DOWN), choice.budget - source.unit)
        if lower < source.minimum:
            break
        logger.warning("%s auto: %g does not fit when run (peak %s of %s usable); trying %g",
                       source.flag, choice.budget,
                       "OOM" if None in peaks else describe_bytes(max(peaks)),
                       describe_bytes(choice.limit_bytes), lower)
        choice.budget = lower
    raise RuntimeError(f"{source.flag} auto: no budget down to {choice.budget:g} passed its "
                       "check; give the flag a number")


def agree(stepper, value: float) -> float:
    """The minimum over ranks (every rank must train with the same budget)."""
    return min(float(v) for v in stepper.gather_objects(float(value)))


def describe_choice(choice: Choice, source: BudgetSource, budget_bytes: int, reserve: int,
                    headroom: float, agreed: float, extra: str) -> str:
    lines = [
        f"{source.flag} auto = {agreed:g}{extra}"
        + ("" if agreed == choice.budget else f" (the minimum over ranks; this rank's: "
           f"{choice.budget:g})"),
        f"  memory: budget {describe_bytes(budget_bytes)} - backward reserve "
        f"{describe_bytes(reserve)}, headroom {headroom:.0%} -> {describe_bytes(choice.limit_bytes)} usable",
        f"  fitted peak = {choice.model.describe()}",
        f"  bound by '{choice.bound_by}': predicted {describe_bytes(choice.predicted_peak)}, "
        f"measured {describe_bytes(choice.checked_peak or 0)}",
        f"  probes ({len(choice.probes)}): " + "; ".join(
            f"{p.budget:g} {p.criterion.split(' (')[0]} "
            + ("OOM" if p.peak_bytes is None else describe_bytes(p.peak_bytes))
            for p in choice.probes),
    ]
    return "\n".join(lines)


# -- the trainer's hook --------------------------------------------------------------


def wants_auto(cfg) -> bool:
    return cfg.data.max_duration == "auto"


def headroom_of(cfg, meter) -> float:
    return cfg.memory_headroom if cfg.memory_headroom >= 0 else DEFAULT_HEADROOM[meter.kind]


def check_auto_flags(cfg, device: torch.device) -> None:
    if wants_auto(cfg) and device.type != "cuda" and cfg.memory_budget_gb <= 0:
        raise ValueError("--max-duration auto on CPU needs --memory-budget-gb G: the memory the "
                         "batches may fill (a simulated device of that size)")


@dataclass
class Pending:
    """A budget still to be chosen (a fresh run under auto): the text flag as given, which
    is re-derived from the chosen seconds."""

    max_text_tokens: int | str | None


def provisional_budget(cfg, resumed_config: dict | None) -> Pending | None:
    """Before the data is built; returns what is still to be chosen (None: nothing). A
    resumed run keeps the budget its checkpoint trained with (its sampler position depends
    on it); a fresh run starts from a budget that holds the longest cut (the data is
    rebuilt once the budget is chosen)."""
    if not wants_auto(cfg):
        return None
    saved = (resumed_config or {}).get("max_duration")
    if isinstance(saved, (int, float)):
        cfg.data.max_duration = float(saved)
        if cfg.synthetic_data:
            cfg.synthetic_batch_size = int((resumed_config or {}).get(
                "synthetic_batch_size", cfg.synthetic_batch_size))
        logger.info("--max-duration auto: resuming with the checkpoint's choice (%g; "
                    "--synthetic-batch-size %d)", saved, cfg.synthetic_batch_size)
        return None
    pending = Pending(cfg.data.max_text_tokens)
    cfg.data.max_duration = float(cfg.data.filter_max_duration or 20.0)
    return pending


def synthetic_source(cfg, ctx) -> BudgetSource:
    from valle.train.data import SyntheticData
    from valle.train.synthetic import collate

    corpus = SyntheticData(cfg, ctx).corpus.cuts
    by_audio = sorted(corpus, key=lambda c: -len(c["codes"]))
    longest_text = max(corpus, key=lambda c: len(c["text"]))

    def batches_at(budget: float) -> dict[str, Batch]:
        rows = max(1, math.ceil(int(budget) / ctx.world_size))
        # The padded worst: the longest audio and, in the same batch, the longest text.
        worst = [longest_text] + [c for c in by_audio if c is not longest_text][: rows - 1]
        return {"longest audio": collate(by_audio[:rows]),
                "longest audio + longest text": collate(worst)}

    return BudgetSource("--synthetic-batch-size", float(max(ctx.world_size, 2)), batches_at,
                        lambda b: float(math.floor(b)), float(ctx.world_size))


def lhotse_source(cfg, ctx, text_flag: int | str | None) -> BudgetSource:
    from valle.data.datamodule import TtsDataModule
    from valle.train.lhotse_data import pessimistic_batches_of

    longest = float(cfg.data.filter_max_duration or 20.0)

    def batches_at(budget: float) -> dict[str, Batch]:
        data = replace(cfg.data, max_duration=budget, max_text_tokens=text_flag)
        module = TtsDataModule(data, seed=cfg.seed, num_languages=cfg.model.num_languages,
                               prefix_mode=cfg.model.prefix_mode)
        return pessimistic_batches_of(module, ctx)

    return BudgetSource("--max-duration", 2 * longest, batches_at,
                        lambda b: float(math.floor(b)), longest)


def choose_batch_budget(run, pending: Pending) -> Any:
    """Choose, log, apply: returns the data rebuilt at the chosen budget."""
    from valle.train.data import build_train_data

    cfg, ctx, stepper, meter = run.cfg, run.ctx, run.stepper, run.meter
    source = (synthetic_source(cfg, ctx) if cfg.synthetic_data
              else lhotse_source(cfg, ctx, pending.max_text_tokens))
    headroom = headroom_of(cfg, meter)
    reserve = stepper.reserve.nbytes
    limit = usable_bytes(meter.budget_bytes, reserve, headroom)
    with meter.active(), stepper.phases.phase_scope("scan"):
        choice = search_budget(stepper, meter, source, limit)
    agreed = agree(stepper, choice.budget)
    if cfg.synthetic_data:
        cfg.synthetic_batch_size = int(agreed)
        extra = " cuts per global batch"
    else:
        cfg.data.max_duration = agreed
        cfg.data.max_text_tokens = pending.max_text_tokens  # derived again from the seconds
        extra = " s"
    data = build_train_data(cfg, ctx, ar_codebook_size=run.model.ar_codebook_size)
    if not cfg.synthetic_data:
        extra += f" (--max-text-tokens {cfg.data.max_text_tokens})"
    cfg.corpus_record["autobatch"] = {
        "budget": agreed, "limit_bytes": limit, "headroom": headroom,
        "model": choice.model.coef, "base_bytes": choice.model.base_bytes}
    logger.info("%s", describe_choice(choice, source, meter.budget_bytes, reserve, headroom,
                                      agreed, extra))
    run.memory_model = choice.model
    stepper.reporter.predict_peak = lambda batch: choice.model.predict(BatchShape.of(batch))
    meter.reset_peak()
    return data

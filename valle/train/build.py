"""A training run: what it holds (`Run`), how it is built on every rank (model, optimizer,
step, data) with one vote on the outcome, and how a checkpoint is restored into it."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, replace
from enum import IntEnum
from typing import Any

import torch

from valle.models.config import ModelConfig
from valle.train import autobatch
from valle.train.checkpoint import (
    apply_stage_switch,
    find_latest_checkpoint,
    load_checkpoint,
)
from valle.train.compile import TrainingCompiler, attach_compiler
from valle.train.config import TrainConfig
from valle.train.data import TrainData, build_train_data
from valle.train.dist import DistContext
from valle.train.finetune import (
    LoraRun,
    adapters_only,
    attach_lora,
    check_lora_resume,
    check_text_tokens,
    grow_language_table,
    load_adapters,
    plan_new_language,
)
from valle.train.metrics import TensorBoardLogger
from valle.train.optim import build_optimizer
from valle.train.preemption import Preemption
from valle.train.resilience.channel import VOTE_SLOTS, ControlChannel
from valle.train.resilience.faults import FaultInjector
from valle.train.resilience.gradsync import build_grad_sync
from valle.train.resilience.memory import OomReporter
from valle.train.resilience.quarantine import Quarantine
from valle.train.resilience.step import ResilientStep, StepConfig
from valle.train.schedulers import build_scheduler
from valle.train.storage import Storage
from valle.train.watchdog import StallWatchdog

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything one training run holds."""

    cfg: TrainConfig
    ctx: DistContext
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    averager: Any
    stepper: ResilientStep
    data: TrainData
    quarantine: Quarantine
    tb: TensorBoardLogger
    watchdog: StallWatchdog
    step: int = 0
    epoch: int = 1
    best_train: float = math.inf
    best_valid: float = math.inf
    scale_warned: bool = False
    steps_per_epoch: int = 0  # learnt from the first full epoch, for the ETA
    resumed: bool = False
    unreadable_total: int = 0  # cuts whose codes could not be read, all ranks, this launch
    preemption: Preemption = field(default_factory=lambda: Preemption(0.0))
    compiler: TrainingCompiler | None = None  # --compile
    meter: Any = None  # valle.train.resilience.meter: peak memory and the budget
    memory_model: Any = None  # valle.train.autobatch.MemoryModel when --max-duration auto chose
    samples: Any = None  # valle.train.samples.SampleWriter, made by its first pass (rank 0)
    lora: LoraRun | None = None  # --lora-rank: the adapters trained on a frozen base
    storage: Storage = field(default_factory=Storage)  # every write: valle/train/storage.py


def control_channel(ctx: DistContext) -> ControlChannel:
    """The step's vote buffers, with a slot per rank for the set-up vote."""
    return ControlChannel(ctx, vote_slots=VOTE_SLOTS + ctx.world_size)


def fault_injector(cfg: TrainConfig, ctx: DistContext) -> FaultInjector:
    return FaultInjector(cfg.inject_fault, ctx.rank, real=cfg.inject_fault_real,
                         stall_seconds=cfg.stall_seconds)


class StartupError(RuntimeError):
    """Set-up failed on some rank; every rank stops together instead of waiting."""


class SetupOutcome(IntEnum):
    """What a rank says in the set-up vote (its slot of the vote vector)."""

    OK = 0
    ERROR = 1
    OUT_OF_MEMORY = 2


def build_run_agreed(cfg: TrainConfig, ctx: DistContext, faults: FaultInjector) -> Run:
    """build_run, then one vote: if set-up failed on any rank (out of memory building the
    model or its state, a missing file, ...), every rank stops at once with the reason,
    rather than the healthy ones waiting for a peer until the collective timeout."""
    from valle.train.resilience.memory import is_oom_error

    run, error = None, None
    try:
        run = build_run(cfg, ctx, faults)
    except Exception as exc:  # noqa: BLE001 - voted, then re-raised on this rank
        error = exc
    outcome = SetupOutcome.OK if error is None else (
        SetupOutcome.OUT_OF_MEMORY if is_oom_error(error) else SetupOutcome.ERROR)
    host = [float(SetupOutcome.OK)] * ctx.world_size
    host[ctx.rank] = float(outcome)
    votes = [SetupOutcome(round(v)) for v in ctx.channel.reduce(host)]
    if error is not None:
        if is_oom_error(error):
            raise StartupError(f"rank {ctx.rank}: out of memory while setting up (model, "
                               f"optimizer state, data): {str(error).splitlines()[0]}. Lower "
                               "the model size or free the device.") from error
        raise error
    failed = [r for r, v in enumerate(votes) if v != SetupOutcome.OK]
    if failed:
        what = "out of memory" if SetupOutcome.OUT_OF_MEMORY in votes else "an error"
        raise StartupError(f"set-up failed on rank(s) {failed} ({what}; see their log): "
                           "every rank stops")
    return run


def build_run(cfg: TrainConfig, ctx: DistContext, faults: FaultInjector | None = None) -> Run:
    from valle.models import get_model

    if ctx.channel is None:  # callers other than train() (GPU checks, benchmarks)
        ctx.channel = control_channel(ctx)
    if faults is None:
        faults = fault_injector(cfg, ctx)

    torch.manual_seed(cfg.seed)
    payload = find_resume_payload(cfg)
    architecture, initial_weights = payload, None
    # LoRA resumes load the frozen base again: the checkpoints hold the adapters alone.
    base_table = None
    if cfg.start_from and (payload is None or cfg.lora.enabled):
        from valle.models.convert import from_payload, load_payload, resolve_checkpoint

        # the architecture of the weights we start from, whatever the flags say
        base_path = str(resolve_checkpoint(cfg.start_from))  # hf:OWNER/REPO/FILE: the hub's cache
        base_payload = load_payload(base_path)
        initial_weights, hparams = from_payload(base_payload, cfg.start_from)
        architecture = {"config": hparams, "model": {}}
        base_table = (base_payload.get("config") or {}).get("text_tokens") or hparams.get("text_tokens")
        del base_payload
    # A VALL-E X base's text frontend and language table go with every checkpoint of the run.
    frontend = frontend_record(architecture.get("config") if architecture else None)
    model = get_model(architecture_hparams(cfg, architecture)).to(ctx.device)
    # --add-language grows the base's table (a full model resumed has the grown one already).
    new_language = None
    if cfg.add_language and initial_weights is not None:
        new_language = plan_new_language(cfg.add_language, cfg.add_language_init,
                                         frontend.get("languages"), cfg.start_from)
        frontend["languages"] = list(new_language.languages)
    lora = None
    if cfg.lora.enabled:
        lora = attach_lora(cfg.lora, base_path, model, initial_weights, new_language)
        initial_weights = None
    elif new_language is not None:  # full fine-tuning: the grown table is a plain one
        start_from(run=None, state=initial_weights, model=model, where=cfg.start_from)
        grow_language_table(model, new_language, trainable_rows_only=False)
        initial_weights = None
    if architecture is not None and isinstance(getattr(model, "config", None), ModelConfig):
        # The checkpoint's architecture (a grown language table included), not the flags', is
        # what the data must fit and this run's checkpoints record.
        cfg.model = model.config
    elif model.num_languages != cfg.model.num_languages:  # the data must give the model's languages
        cfg.model = replace(cfg.model, num_languages=model.num_languages)
    if frontend.get("languages") and not cfg.data.languages:
        cfg.data.languages = corpus_voices(frontend["languages"])
    if payload is not None:
        check_lora_resume(lora, payload, f"the checkpoint resumed from in {cfg.exp_dir}")
    # Frozen parameters (a LoRA base) hold no optimizer state and join no gradient bucket.
    named = [(n, p) for n, p in model.stage_parameters(cfg.train_stage) if p.requires_grad]
    optimizer = build_optimizer(cfg.optimizer_name, named, cfg.base_lr, weight_decay=cfg.weight_decay,
                                **asdict(cfg.optimizer_recipe))
    scheduler = build_scheduler(cfg.scheduler_name, optimizer, cfg.warmup_steps,
                                total_steps=cfg.max_steps or None, lr_batches=cfg.lr_batches,
                                lr_epochs=cfg.lr_epochs,
                                model_dim=getattr(model, "hparams", {}).get("decoder_dim"))
    scaler = torch.amp.GradScaler(ctx.device.type, init_scale=cfg.grad_scale_init,
                                  enabled=cfg.dtype == "float16")
    averager = None
    if cfg.average_period > 0:
        from valle.train.averaging import ModelAverager

        averager = ModelAverager(named, cfg.average_period)
    sync = build_grad_sync(cfg.grad_sync, model, [p for _, p in named], world_size=ctx.world_size,
                           device=ctx.device, group=ctx.group, bucket_cap_mb=cfg.bucket_cap_mb)
    storage = Storage(cfg.exp_dir, cfg.max_failed_saves, faults)
    quarantine = Quarantine(cfg.exp_dir / "quarantine.jsonl", storage)
    autobatch.check_auto_flags(cfg, ctx.device)
    if cfg.activation_checkpointing:
        from valle.models.transformer import set_activation_checkpointing

        set_activation_checkpointing(model, True)
    if cfg.oom_snapshot and ctx.device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100000)
    stepper = ResilientStep(
        model, optimizer, sync, ctx,
        StepConfig(train_stage=cfg.train_stage, dtype=cfg.dtype, seed=cfg.seed,
                   grad_clip=cfg.grad_clip if cfg.optimizer_name != "ScaledAdam" else 0.0,
                   backward_reserve_mb=backward_reserve_mb(cfg, ctx),
                   update_retries=cfg.update_retries, max_quarantined=cfg.max_quarantined_cuts,
                   max_fitted_before=cfg.max_fitted_before_quarantines),
        scaler=scaler, averager=averager, faults=faults,
        reporter=OomReporter(cfg.exp_dir, ctx.rank, cfg.save_oom_batches, cfg.oom_snapshot,
                             storage=storage),
        quarantine=quarantine, channel=ctx.channel,
    )
    # --max-duration auto: a provisional budget until the run can measure (below).
    pending = autobatch.provisional_budget(cfg, (payload or {}).get("config"))
    # The model's head (a resumed checkpoint's, whatever the flag) must fit the corpus's codebook 0.
    data = build_train_data(cfg, ctx, ar_codebook_size=model.ar_codebook_size)
    if frontend:
        check_corpus_languages(frontend.get("languages"), cfg.data.languages, cfg.start_from)
        cfg.corpus_record.update(frontend)
    if lora is not None:
        check_text_tokens(base_table, cfg.data.text_tokens and str(cfg.data.text_tokens), cfg.start_from)
    run = Run(cfg, ctx, model, optimizer, scheduler, scaler, averager, stepper, data, quarantine,
              TensorBoardLogger(cfg.exp_dir / "tensorboard" / f"stage{cfg.train_stage}",
                                enabled=cfg.tensorboard and ctx.is_main, storage=storage),
              StallWatchdog(cfg.stall_factor, cfg.stall_min_seconds,
                            cfg.exp_dir / "log" / f"stall-rank{ctx.rank}.txt", ctx.rank))
    run.lora, run.storage = lora, storage
    if payload is not None:
        # A new stage has a new memory profile: only a same-stage resume skips the scan.
        run.resumed = not restore(run, payload)
    elif initial_weights is not None:
        start_from(run, initial_weights)
    if cfg.compile:
        injector = bool(cfg.count_allocations) or any(s.phase == "alloc" for s in cfg.inject_fault)
        run.compiler = attach_compiler(stepper, run.watchdog, cfg.compile_pad, cfg.compile_backend,
                                       allocation_injector=injector)
    # After restore: state created from the weights training starts from.
    stepper.materialize_state()
    attach_meter(run)
    if pending is not None:  # measured with everything a step holds: state, --compile, reserve
        run.data = autobatch.choose_batch_budget(run, pending)
    logger.info("model: %.2f M parameters, %.2f M trained in stage %d; grad sync %s; %d rank(s) on %s",
                sum(p.numel() for p in model.parameters()) / 1e6,
                sum(p.numel() for _, p in named) / 1e6, cfg.train_stage, cfg.grad_sync,
                ctx.world_size, ctx.device)
    return run


def attach_meter(run: Run) -> None:
    """The memory meter (valle.train.resilience.meter), shared by the scan, the batch-budget
    search, OOM reports and the progress line. On CPU it counts from here on only under
    --memory-budget-gb (a simulated device); otherwise only in the windows that ask."""
    from valle.train.resilience.meter import build_meter, training_state_tensors

    meter = build_meter(run.ctx.device, run.cfg.memory_budget_gb)
    buckets = [b.buffer for b in getattr(run.stepper.sync, "buckets", [])]  # gradients' home
    meter.track(training_state_tensors(run.model, run.optimizer, buckets))
    if meter.enforce:
        meter.start()
    run.meter = run.stepper.meter = meter
    run.stepper.reporter.meter = meter


def frontend_record(config: dict | None) -> dict[str, Any]:
    """The text frontend and language table a checkpoint's config names (a VALL-E X model
    converted from Plachtaa/VALL-E-X, or a run started from one); empty for the others."""
    if not config or not config.get("text_frontend"):
        return {}
    return {k: config[k] for k in ("text_frontend", "languages") if config.get(k) is not None}


def corpus_voices(model_languages: list[str]) -> str:
    """The espeak voices bin/tokenizer.py records for a VALL-E X model's languages, in its row
    order: the corpus's language ids then are the model's."""
    from valle.data.vallex_text import VOICES

    return ",".join(VOICES.get(lang, lang) for lang in model_languages)


def check_corpus_languages(model_languages, corpus_languages, start_from) -> None:
    """The corpus's language ids must be the base's: its languages in the base's row order."""
    if not model_languages or corpus_languages is None:
        return
    from valle.data.languages import split_languages
    from valle.data.vallex_text import language_code

    corpus = split_languages(corpus_languages)
    if [language_code(x) for x in corpus] != list(model_languages)[: len(corpus)]:
        raise StartupError(
            f"--start-from {start_from}: its language table is {list(model_languages)} (ids in "
            f"that order) but the corpus's languages are {corpus}: tokenize the corpus with the "
            "same language names (en, zh, ja for VALL-E X)")


def architecture_hparams(cfg: TrainConfig, payload: dict | None) -> dict[str, Any]:
    """The model's hyper-parameters: the flags (``cfg.model``), or a checkpoint's when resuming
    or starting from one (old checkpoints included: keys they predate take the values they were
    trained with); the training-loss settings stay the flags'."""
    from valle.models.convert import ours_hparams

    values = cfg.model.hparams()
    if payload is not None:
        # The architecture is the checkpoint's, whatever the flags say.
        values.update(ours_hparams(payload.get("config", {}), payload["model"]))
    return values


def start_from(run: Run | None, state: dict[str, torch.Tensor], model: torch.nn.Module | None = None,
               where: str = "") -> None:
    """--start-from: initial weights from a checkpoint (ours or lifeiteng/vall-e's, already
    converted); the architecture came from it too; optimizer, schedule and data start afresh."""
    model = model if model is not None else run.model
    model.load_state_dict(state, strict=True)
    logger.info("initial weights from %s", where or run.cfg.start_from)


def backward_reserve_mb(cfg: TrainConfig, ctx: DistContext) -> int:
    if cfg.backward_reserve_mb >= 0:
        return cfg.backward_reserve_mb
    return 1024 if ctx.device.type == "cuda" and cfg.trains_nar else 0


def find_resume_payload(cfg: TrainConfig) -> dict | None:
    if cfg.start_batch > 0:
        return load_checkpoint(cfg.exp_dir / f"checkpoint-{cfg.start_batch}.pt")
    if cfg.start_epoch > 1:
        return load_checkpoint(cfg.exp_dir / f"epoch-{cfg.start_epoch - 1}.pt")
    # A stage-2 run in the AR run's directory continues its own checkpoints once it
    # has some, and starts from the newest AR one (a stage switch) before that.
    found = find_latest_checkpoint(cfg.exp_dir, prefer_stage=cfg.train_stage)
    if found is None:
        return None
    path, payload = found
    logger.info("resuming from %s (step %d, epoch %d)", path, payload["step"], payload["epoch"])
    return payload


def restore(run: Run, payload: dict) -> list[str]:
    """Load a checkpoint into the run; returns what a stage switch dropped."""
    payload, dropped = apply_stage_switch(payload, run.cfg.train_stage)
    if dropped:
        logger.warning("checkpoint was trained in another stage: dropped %s; keeping the weights",
                       ", ".join(dropped))
    if run.lora is not None:
        load_adapters(run.model, payload, f"the checkpoint resumed from in {run.cfg.exp_dir}")
        missing, unexpected = [], []
    else:
        missing, unexpected = run.model.load_state_dict(payload["model"], strict=False)
    if missing or unexpected:
        logger.warning("checkpoint weights: %d missing, %d unexpected keys", len(missing), len(unexpected))
    if run.averager is not None and payload.get("model_avg") is not None:
        run.averager.load_from_model_state_dict(payload["model_avg"], strict=False)
    if payload.get("optimizer") is not None:
        run.optimizer.load_state_dict(payload["optimizer"])
    if payload.get("scheduler") is not None:
        run.scheduler.load_state_dict(payload["scheduler"])
    if payload.get("scaler") is not None and run.scaler is not None:
        run.scaler.load_state_dict(payload["scaler"])
    if payload.get("sampler") is not None:
        run.data.load_state_dict(payload["sampler"], run.ctx)
    run.quarantine.merge(payload.get("quarantine") or [])
    run.step, run.epoch = payload["step"], payload["epoch"]
    return dropped


def averaged_state(run: Run) -> dict[str, torch.Tensor] | None:
    """The averaged model as a full model state dict (None without --average-period); a
    LoRA run's adapters alone."""
    state = run.averager.averaged_state_dict(run.model) if run.averager else None
    return adapters_only(state) if run.lora is not None else state


def model_state(run: Run) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the model: its state dict, or a LoRA run's adapters."""
    from valle.models.lora import lora_state_dict

    return lora_state_dict(run.model) if run.lora is not None else run.model.state_dict()


def checkpoint_extras(run: Run) -> dict[str, Any]:
    """Payload entries beyond the documented format: a LoRA run's ``lora`` (its base)."""
    return {"lora": run.lora.entry()} if run.lora is not None else {}


def active_scaler(run: Run) -> torch.amp.GradScaler | None:
    """The GradScaler when it scales (--dtype float16), else None."""
    return run.scaler if run.scaler is not None and run.scaler.is_enabled() else None

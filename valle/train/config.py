"""Trainer flags (the names VALL-E users know) and the typed config built from them."""

from __future__ import annotations

import argparse
import logging
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from valle.args import DTYPE_NAMES
from valle.config_flags import add_flags, flag, flag_values, from_namespace
from valle.data.datamodule import DataConfig, add_data_flags
from valle.models.config import ModelConfig, add_model_arguments
from valle.models.generation import DecodeOptions
from valle.models.lora import LoraConfig
from valle.train.optim import OPTIMIZERS, OptimizerRecipe
from valle.train.resilience.faults import FaultSpec, parse_fault
from valle.train.resilience.gradsync import SYNC_MODES
from valle.train.schedulers import SCHEDULERS

logger = logging.getLogger(__name__)


TRAINING = "training"
SAMPLES = "validation samples"
RESILIENCE = "resilience"
SYNTHETIC = "synthetic data"


def _training(default: Any = MISSING, help: str | None = None, **spec: Any) -> Any:
    return flag(default, help, group=TRAINING, **spec)


def _samples(default: Any, help: str) -> Any:
    """Hear it train (docs/training.md, valle/train/samples.py): rank 0 synthesises fixed
    held-out items at each validation and writes them to TensorBoard."""
    return flag(default, help, group=SAMPLES)


def _resilience(default: Any = MISSING, help: str | None = None, **spec: Any) -> Any:
    return flag(default, help, group=RESILIENCE, **spec)


@dataclass
class TrainConfig:
    """A training run's configuration: every trainer flag is declared here once, with its help.

    The training, optimizer, validation-sample and resilience options are this class's own
    fields (flat: ``cfg.base_lr``, as the loop and the resilient step read them); the model's
    hyper-parameters are ``cfg.model`` (``valle.models.config.ModelConfig``) and the corpus and
    batching options ``cfg.data`` (``valle.data.datamodule.DataConfig``). Each field made with
    ``flag()`` is a ``--flag`` (``valle.config_flags``): adding an option is adding a field.
    """

    exp_dir: Path = _training(Path("exp/valle"))
    train_stage: int = _training(0, "0: AR and NAR together; 1: AR only; 2: NAR only",
                                 choices=(0, 1, 2))
    num_epochs: int = _training(20)
    start_epoch: int = _training(
        1, "resume from epoch-(N-1).pt; default: the newest valid checkpoint in --exp-dir")
    start_batch: int = _training(0, "resume from checkpoint-N.pt")
    start_from: str = _training(  # initial weights (ours or lifeiteng/vall-e's)
        "", "initial weights (and architecture) from a checkpoint: this project's or "
        "lifeiteng/vall-e's (converted on load); optimizer and data start afresh")
    add_language: str = _training(
        "", "teach a VALL-E X --start-from checkpoint a new language, named as its espeak "
        "voice (e.g. de): its language tables grow by this row, which trains (with "
        "--lora-rank: it and the adapters alone); checkpoints record the grown table")
    add_language_init: str = _training(
        "mean", "--add-language's row starts as the mean of the table's rows (mean), or as a "
        "copy of one language's row (e.g. en)")
    max_steps: int = _training(0, "stop after this many steps (0: no limit)")
    seed: int = _training(42)
    device: str = _training("auto", "auto, cpu or cuda")
    dtype: str = _training("float32", choices=DTYPE_NAMES)
    # optimisation
    optimizer_name: str = _training("ScaledAdam", choices=tuple(OPTIMIZERS))
    scheduler_name: str = _training("Eden", choices=tuple(SCHEDULERS))
    base_lr: float = _training(0.05)
    warmup_steps: int = _training(200)
    lr_batches: float = _training(5000.0)
    lr_epochs: float = _training(4.0)
    weight_decay: float = _training(0.0)
    grad_clip: float = _training(
        1.0, "max gradient norm for the Adam family (ScaledAdam clips itself)")
    grad_scale_init: float = _training(
        1.0, "--dtype float16: the GradScaler's initial scale. 1.0 as in the icefall/"
        "VALL-E recipes: the loss is a sum over frames, already large (torch's "
        "default 65536 overflows the first steps and skips them)")
    accumulate_grad_steps: int = _training(1)
    average_period: int = _training(
        0, "update the averaged model every N steps (0: no averaged model)")
    # bookkeeping
    save_every_n: int = _training(10000)
    keep_last_k: int = _training(20)
    valid_interval: int = _training(10000)
    log_interval: int = _training(10)
    tensorboard: bool = _training(True)
    log_trained_cuts: bool = _training(
        False, "append each step's cut ids to <exp-dir>/trained-cuts-rank<R>.tsv")
    # hear it train: held-out syntheses in TensorBoard at each validation (valle/train/samples.py)
    valid_samples: int = _samples(  # 0: off
        4, "held-out items synthesised at each --valid-interval, prompted by another "
        "utterance of the same speaker (0: off; needs --tensorboard)")
    valid_samples_interval: int = _samples(  # steps, a multiple of valid_interval
        0, "steps between sampling passes, a multiple of --valid-interval (0: at "
        "every validation)")
    valid_samples_max_seconds: float = _samples(  # decoding cap per item (the cost bound)
        10.0, "decode at most this many seconds per item: bounds the pass's cost (its "
        "wall time is logged; the other ranks wait for it in their next collective)")
    valid_samples_decode: str = _samples(  # parsed once into valid_samples_decoding
        "", "bin/infer.py decoding flags in one string, e.g. '--top-k 3 --num-candidates "
        "4 --nar-decoding mmse --seed 1' (default: bin/infer.py's defaults)")
    valid_samples_codec_dir: str = _samples(  # "": the corpus's codec (none with --synthetic-data)
        "", "directory holding the codec (audio_codec.json, mel_rvq.pt) that turns codes "
        "into audio; default: the corpus's (with --synthetic-data: none, the codes "
        "are shown as images)")
    valid_judge: str = _samples(  # phoneme judge (judge.pt): held-out PER and speaker similarity
        "", "phoneme judge (e.g. {manifest-dir}/judge.pt): the samples' held-out PER and "
        "speaker similarity as TensorBoard scalars (default: not measured)")
    compile: bool = _training(  # torch.compile the training forward + loss (valle.train.compile)
        False, "torch.compile the training forward and loss (and so its backward); "
        "the first step compiles (minutes on CPU), for CUDA (docs/training.md)",
        nargs="?", const=True)
    compile_pad: int = _training(
        32, "--compile: pad text and frames to multiples of this so bucketed "
        "lengths do not recompile (masks keep the loss exact); 1: no padding")
    compile_backend: str = _training("inductor", hidden=True)  # tests use aot_eager
    # resilience
    grad_sync: str = _resilience("overlap", choices=SYNC_MODES)
    bucket_cap_mb: float = _resilience(25.0)
    oom_check: bool = _resilience(
        True, "run the pessimistic batches before training and report peak memory")
    backward_reserve_mb: int = _resilience(
        -1, "contiguous block held through the NAR forward (-1: 1024 on CUDA when the "
        "NAR is trained; 0 disables)")
    save_oom_batches: int = _resilience(3)
    oom_snapshot: bool = _resilience(
        False, "record CUDA allocator history and dump it at each OOM "
        "(<exp-dir>/oom/snapshot-*.pickle, for https://pytorch.org/memory_viz)",
        names=("--oom-snapshot", "--memory-snapshot"))
    max_quarantined_cuts: int = _resilience(
        100, "stop (exit 15: the GPU, not the data) when more cuts than this were "
        "quarantined in one run")
    max_fitted_before_quarantines: int = _resilience(
        3, "stop (exit 15) when more cuts than this failed alone although larger "
        "cuts had trained before")
    max_unreadable_cuts: int = _resilience(
        100, "stop (exit 19) when more training cuts than this could not be read "
        "(truncated HDF5, missing file, corrupt Shar member; each is listed in "
        "<exp-dir>/unreadable-rank*.jsonl and skipped until then)")
    max_failed_saves: int = _resilience(
        3, "stop (exit 20) after this many checkpoint saves in a row could not be written "
        "(disk full or failing); nothing is deleted to make room; 0: never stop for it (a "
        "run whose last checkpoint is not written still exits 20)")
    update_retries: int = _resilience(
        2, "local retries of an optimizer/averaging phase that ran out of memory "
        "(it resumes where it stopped) before the rank is repaired from another")
    # memory (valle/train/autobatch.py, valle/train/resilience/meter.py, docs/oom.md)
    memory_budget_gb: float = _resilience(  # 0: on CUDA the device's free memory at start
        0.0, "memory this run may use per device (default on CUDA: the device's free memory "
        "at start). --max-duration auto fills it; on CPU it is a simulated device: the "
        "memory meter raises an OOM past it (docs/oom.md)")
    memory_headroom: float = _resilience(  # -1: 0.10 on CUDA, 0.03 with the CPU meter
        -1.0, "--max-duration auto leaves this fraction of the budget free for "
        "fragmentation (-1: 0.10 on CUDA, 0.03 on CPU)")
    activation_checkpointing: bool = _resilience(  # recompute each decoder layer in backward
        False, "recompute each decoder layer's activations in backward: less memory (so "
        "--max-duration auto picks larger batches), more time", nargs="?", const=True)
    count_allocations: str = _resilience("", hidden=True)  # the sweep's dry run: the census file
    inject_fault: list[FaultSpec] = _resilience(
        default_factory=list, append=True, parse=parse_fault,
        metavar="PHASE@STEP[xK][:RANKS]|PHASE@cut=ID|alloc@STEP:N[:RANKS]|disk@KIND:N[xK][:RANKS]")
    inject_fault_real: bool = _resilience(False)
    preempt_grace_s: float = _resilience(  # SIGTERM/SIGUSR1 -> save at the next step boundary
        25.0, "after SIGTERM/SIGUSR1: stop at the next step boundary, save, exit 17; "
        "exit 18 without saving if that takes longer than this (torchrun kills "
        "its workers 30 s after forwarding SIGTERM); 0: no deadline")
    check_consistency_every: int = _resilience(0)
    collective_timeout: float = _resilience(300.0, "seconds")
    stall_factor: float = _resilience(10.0)
    stall_min_seconds: float = _resilience(300.0)
    stall_seconds: float = _resilience(3600.0, hidden=True)  # how long an injected stall sleeps
    # data
    synthetic_data: int = flag(  # >0: train on that many synthetic cuts (no corpus needed)
        0, "train on N synthetic cuts instead of --manifest-dir (checks, benchmarks)",
        group=SYNTHETIC)
    synthetic_batch_size: int = flag(8, group=SYNTHETIC)
    synthetic_partition: str = flag("rows", group=SYNTHETIC, choices=("rows", "batches"))
    # the recipes' optimizer settings that have no flag (valle/train/optim.py)
    optimizer_recipe: OptimizerRecipe = field(default_factory=OptimizerRecipe)
    # the typed sub-configs of the other flags
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # --lora-*: adapters on --start-from
    # --valid-samples-decode, parsed once (at the edge, config_from_args)
    valid_samples_decoding: DecodeOptions = field(default_factory=lambda: parse_decode_flags(""))
    # what the data source found out about the corpus, recorded in checkpoints (audio_codec)
    corpus_record: dict[str, Any] = field(default_factory=dict)

    @property
    def trains_nar(self) -> bool:
        return self.train_stage in (0, 2)

    def checkpoint_config(self) -> dict[str, Any]:
        """Every flag as plain Python types (model, training and data flags, as resolved: the
        symbol table's path, the --max-text-tokens budget, the language order) and the corpus
        record: a checkpoint's "config", which bin/infer.py and resumed runs read."""
        return {**flag_values(self.model), **flag_values(self), **flag_values(self.data),
                **flag_values(self.lora), **self.corpus_record}


def add_trainer_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of bin/trainer.py: the model's, the training's, the data's."""
    add_model_arguments(parser)
    add_flags(parser, TrainConfig)
    add_flags(parser, LoraConfig)
    add_data_flags(parser)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The typed config of parsed trainer flags (ValueError naming the flag when one is bad)."""
    cfg = from_namespace(TrainConfig, args, model=ModelConfig.from_params(args),
                         data=from_namespace(DataConfig, args), lora=from_namespace(LoraConfig, args))
    validate_config(cfg)
    if cfg.valid_samples:
        cfg.valid_samples_decoding = parse_decode_flags(cfg.valid_samples_decode)
    return cfg


def parse_decode_flags(text: str) -> DecodeOptions:
    """--valid-samples-decode: bin/infer.py's decoding flags in one string -> DecodeOptions
    (bin/infer.py's defaults for what it leaves out)."""
    import shlex

    parser = argparse.ArgumentParser(prog="--valid-samples-decode", add_help=False,
                                     exit_on_error=False)
    add_flags(parser, DecodeOptions)
    try:
        args, unknown = parser.parse_known_args(shlex.split(text))
        if unknown:
            raise ValueError(f"not a decoding flag of bin/infer.py: {' '.join(unknown)}")
        return DecodeOptions.from_flags(args)
    except (argparse.ArgumentError, ValueError) as e:
        raise ValueError(f"--valid-samples-decode: {text!r}: {e}") from e


def validate_config(cfg: TrainConfig) -> None:
    def bad(flag: str, why: str) -> None:
        raise ValueError(f"{flag}: {why}")

    if cfg.memory_budget_gb < 0:
        bad("--memory-budget-gb", "must be >= 0 (0: the device's free memory)")
    if cfg.memory_headroom >= 1:
        bad("--memory-headroom", "must be below 1 (-1: the default)")
    if cfg.accumulate_grad_steps < 1:
        bad("--accumulate-grad-steps", "must be >= 1")
    if cfg.dtype == "float16" and cfg.device == "cpu":
        # CPU autocast float16 with torch.amp.GradScaler("cpu") works, slowly: it is how the
        # GradScaler path is tested without a GPU. Say so rather than refuse.
        logger.warning(
            "--dtype float16 on CPU: slow, meant for testing the GradScaler path "
            "(use bfloat16 or float32 to train on CPU)")
    if cfg.valid_samples < 0:
        bad("--valid-samples", "must be >= 0 (0: off)")
    if cfg.valid_samples_interval < 0 or (
            cfg.valid_samples_interval and cfg.valid_samples_interval % max(1, cfg.valid_interval)):
        bad("--valid-samples-interval", "must be 0 (every validation) or a multiple of --valid-interval")
    if cfg.valid_samples_max_seconds <= 0:
        bad("--valid-samples-max-seconds", "must be > 0")
    try:
        cfg.lora.check()
    except ValueError as e:
        bad("--lora-*", str(e))
    if cfg.lora.enabled and not cfg.start_from:
        bad("--lora-rank", "LoRA adapts pretrained weights: give them with --start-from")
    if cfg.add_language and not cfg.start_from:
        bad("--add-language", "a new language grows a pretrained model's language table: give "
            "the model with --start-from (a VALL-E X checkpoint)")
    if cfg.lora.enabled and cfg.optimizer_name == "ScaledAdam":
        # ScaledAdam scales each update by the tensor's own size, and lora_B starts at zero.
        logger.warning("--lora-rank with --optimizer-name ScaledAdam: the zero-initialised "
                       "adapters barely move; use --optimizer-name AdamW (docs/training.md)")
    if cfg.compile_pad < 1:
        bad("--compile-pad", "must be >= 1")
    if cfg.save_every_n < 1 or cfg.valid_interval < 1 or cfg.log_interval < 1:
        bad("--save-every-n/--valid-interval/--log-interval", "must be >= 1")
    if cfg.max_failed_saves < 0:
        bad("--max-failed-saves", "must be >= 0 (0: never stop for failed saves)")
    for spec in cfg.inject_fault:
        if spec.phase == "grad_sync" and cfg.grad_sync == "ddp":
            bad("--inject-fault", f"{spec}: --grad-sync ddp has no grad_sync point (DDP "
                "all-reduces inside backward; backward@STEP tests that), use --grad-sync "
                "overlap or after-backward")
    if cfg.synthetic_data == 0 and not cfg.data.manifest_dir:
        bad("--manifest-dir", "no corpus given (or pass --synthetic-data N to train on synthetic cuts)")

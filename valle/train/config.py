"""Trainer flags (the names VALL-E users know) and the typed config built from them."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from valle.args import DTYPE_NAMES, str2bool
from valle.train.optim import OPTIMIZERS
from valle.train.resilience.faults import FaultSpec, parse_fault
from valle.train.resilience.gradsync import SYNC_MODES
from valle.train.schedulers import SCHEDULERS

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    exp_dir: Path = Path("exp/valle")
    train_stage: int = 0
    num_epochs: int = 20
    start_epoch: int = 1
    start_batch: int = 0
    start_from: str = ""  # initial weights (ours or lifeiteng/vall-e's)
    max_steps: int = 0  # 0: no limit
    seed: int = 42
    device: str = "auto"
    dtype: str = "float32"
    # optimisation
    optimizer_name: str = "ScaledAdam"
    scheduler_name: str = "Eden"
    base_lr: float = 0.05
    warmup_steps: int = 200
    lr_batches: float = 5000.0
    lr_epochs: float = 4.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    grad_scale_init: float = 1.0
    accumulate_grad_steps: int = 1
    average_period: int = 0
    # bookkeeping
    save_every_n: int = 10000
    keep_last_k: int = 20
    valid_interval: int = 10000
    log_interval: int = 10
    tensorboard: bool = True
    log_trained_cuts: bool = False
    # hear it train: held-out syntheses in TensorBoard at each validation (valle/train/samples.py)
    valid_samples: int = 4  # 0: off
    valid_samples_interval: int = 0  # steps, a multiple of valid_interval (0: every validation)
    valid_samples_max_seconds: float = 10.0  # decoding cap per item (the cost bound)
    valid_samples_decode: str = ""  # bin/infer.py decoding flags ("": its defaults)
    valid_samples_codec_dir: str = ""  # "": the corpus's codec (none with --synthetic-data)
    valid_judge: str = ""  # phoneme judge (judge.pt): held-out PER and speaker similarity
    compile: bool = False  # torch.compile the training forward + loss (valle.train.compile)
    compile_pad: int = 32  # --compile: pad text/frames to multiples of this (fewer shapes)
    compile_backend: str = "inductor"  # tests use aot_eager (same graphs, no code generation)
    # resilience
    grad_sync: str = "overlap"
    bucket_cap_mb: float = 25.0
    oom_check: bool = True
    backward_reserve_mb: int = -1  # -1: 1024 on CUDA when the NAR is trained, else 0
    save_oom_batches: int = 3
    oom_snapshot: bool = False
    max_quarantined_cuts: int = 100
    max_fitted_before_quarantines: int = 3
    update_retries: int = 2
    max_unreadable_cuts: int = 100
    # memory (valle/train/autobatch.py, valle/train/resilience/meter.py)
    memory_budget_gb: float = 0.0  # 0: on CUDA the device's free memory at start; on CPU none
    memory_headroom: float = -1.0  # -1: 0.10 on CUDA, 0.03 with the CPU meter
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    count_allocations: str = ""  # the sweep's dry run: write the per-step census here
    inject_fault: list[FaultSpec] = field(default_factory=list)
    inject_fault_real: bool = False
    preempt_grace_s: float = 25.0  # SIGTERM/SIGUSR1 -> save at the next step boundary within this
    check_consistency_every: int = 0
    collective_timeout: float = 300.0
    stall_factor: float = 10.0
    stall_min_seconds: float = 300.0
    stall_seconds: float = 3600.0  # how long an injected stall sleeps
    # data
    synthetic_data: int = 0  # >0: train on that many synthetic cuts (no corpus needed)
    synthetic_batch_size: int = 8
    synthetic_partition: str = "rows"
    # every flag as given (model and data flags included), for checkpoints and builders
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def trains_nar(self) -> bool:
        return self.train_stage in (0, 2)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The training, resilience and synthetic-data flags; their defaults are TrainConfig's."""
    d = TrainConfig()
    g = parser.add_argument_group("training")
    g.add_argument("--exp-dir", type=Path, default=d.exp_dir)
    g.add_argument("--train-stage", type=int, default=d.train_stage, choices=(0, 1, 2),
                   help="0: AR and NAR together; 1: AR only; 2: NAR only")
    g.add_argument("--num-epochs", type=int, default=d.num_epochs)
    g.add_argument("--start-epoch", type=int, default=d.start_epoch,
                   help="resume from epoch-(N-1).pt; default: the newest valid checkpoint in --exp-dir")
    g.add_argument("--start-batch", type=int, default=d.start_batch, help="resume from checkpoint-N.pt")
    g.add_argument("--start-from", default=d.start_from,
                   help="initial weights (and architecture) from a checkpoint: this project's or "
                        "lifeiteng/vall-e's (converted on load); optimizer and data start afresh")
    g.add_argument("--max-steps", type=int, default=d.max_steps, help="stop after this many steps (0: no limit)")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES)
    g.add_argument("--optimizer-name", default=d.optimizer_name, choices=OPTIMIZERS)
    g.add_argument("--scheduler-name", default=d.scheduler_name, choices=SCHEDULERS)
    g.add_argument("--base-lr", type=float, default=d.base_lr)
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    g.add_argument("--lr-batches", type=float, default=d.lr_batches)
    g.add_argument("--lr-epochs", type=float, default=d.lr_epochs)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip,
                   help="max gradient norm for the Adam family (ScaledAdam clips itself)")
    g.add_argument("--grad-scale-init", type=float, default=d.grad_scale_init,
                   help="--dtype float16: the GradScaler's initial scale. 1.0 as in the icefall/"
                        "VALL-E recipes: the loss is a sum over frames, already large (torch's "
                        "default 65536 overflows the first steps and skips them)")
    g.add_argument("--accumulate-grad-steps", type=int, default=d.accumulate_grad_steps)
    g.add_argument("--average-period", type=int, default=d.average_period,
                   help="update the averaged model every N steps (0: no averaged model)")
    g.add_argument("--save-every-n", type=int, default=d.save_every_n)
    g.add_argument("--keep-last-k", type=int, default=d.keep_last_k)
    g.add_argument("--valid-interval", type=int, default=d.valid_interval)
    g.add_argument("--log-interval", type=int, default=d.log_interval)
    g.add_argument("--tensorboard", type=str2bool, default=d.tensorboard)
    g.add_argument("--log-trained-cuts", type=str2bool, default=d.log_trained_cuts,
                   help="append each step's cut ids to <exp-dir>/trained-cuts-rank<R>.tsv")
    add_sample_arguments(parser, d)
    g.add_argument("--compile", type=str2bool, nargs="?", const=True, default=d.compile,
                   help="torch.compile the training forward and loss (and so its backward); "
                        "the first step compiles (minutes on CPU), for CUDA (docs/training.md)")
    g.add_argument("--compile-pad", type=int, default=d.compile_pad,
                   help="--compile: pad text and frames to multiples of this so bucketed "
                        "lengths do not recompile (masks keep the loss exact); 1: no padding")
    g.add_argument("--compile-backend", default=d.compile_backend, help=argparse.SUPPRESS)

    r = parser.add_argument_group("resilience")
    r.add_argument("--grad-sync", default=d.grad_sync, choices=SYNC_MODES)
    r.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    r.add_argument("--oom-check", type=str2bool, default=d.oom_check,
                   help="run the pessimistic batches before training and report peak memory")
    r.add_argument("--backward-reserve-mb", type=int, default=d.backward_reserve_mb,
                   help="contiguous block held through the NAR forward (-1: 1024 on CUDA when the "
                        "NAR is trained; 0 disables)")
    r.add_argument("--save-oom-batches", type=int, default=d.save_oom_batches)
    r.add_argument("--oom-snapshot", "--memory-snapshot", dest="oom_snapshot", type=str2bool,
                   default=d.oom_snapshot, help="record CUDA allocator history and dump it at each OOM "
                   "(<exp-dir>/oom/snapshot-*.pickle, for https://pytorch.org/memory_viz)")
    r.add_argument("--max-quarantined-cuts", type=int, default=d.max_quarantined_cuts,
                   help="stop (exit 15: the GPU, not the data) when more cuts than this were "
                        "quarantined in one run")
    r.add_argument("--max-fitted-before-quarantines", type=int, default=d.max_fitted_before_quarantines,
                   help="stop (exit 15) when more cuts than this failed alone although larger "
                        "cuts had trained before")
    r.add_argument("--max-unreadable-cuts", type=int, default=d.max_unreadable_cuts,
                   help="stop (exit 19) when more training cuts than this could not be read "
                        "(truncated HDF5, missing file, corrupt Shar member; each is listed in "
                        "<exp-dir>/unreadable-rank*.jsonl and skipped until then)")
    r.add_argument("--update-retries", type=int, default=d.update_retries,
                   help="local retries of an optimizer/averaging phase that ran out of memory "
                        "(it resumes where it stopped) before the rank is repaired from another")
    r.add_argument("--memory-budget-gb", type=float, default=d.memory_budget_gb,
                   help="memory this run may use per device (default on CUDA: the device's free "
                        "memory at start). --max-duration auto fills it; on CPU it is a simulated "
                        "device: the memory meter raises an OOM past it (docs/oom.md)")
    r.add_argument("--memory-headroom", type=float, default=d.memory_headroom,
                   help="--max-duration auto leaves this fraction of the budget free for "
                        "fragmentation (-1: 0.10 on CUDA, 0.03 on CPU)")
    r.add_argument("--activation-checkpointing", type=str2bool, nargs="?", const=True,
                   default=d.activation_checkpointing,
                   help="recompute each decoder layer's activations in backward: less memory "
                        "(so --max-duration auto picks larger batches), more time")
    r.add_argument("--count-allocations", default=d.count_allocations, help=argparse.SUPPRESS)
    r.add_argument("--inject-fault", action="append", default=[], type=parse_fault,
                   metavar="PHASE@STEP[xK][:RANKS]|PHASE@cut=ID|alloc@STEP:N[:RANKS]")
    r.add_argument("--inject-fault-real", type=str2bool, default=d.inject_fault_real)
    r.add_argument("--preempt-grace-s", type=float, default=d.preempt_grace_s,
                   help="after SIGTERM/SIGUSR1: stop at the next step boundary, save, exit 17; "
                        "exit 18 without saving if that takes longer than this (torchrun kills "
                        "its workers 30 s after forwarding SIGTERM); 0: no deadline")
    r.add_argument("--check-consistency-every", type=int, default=d.check_consistency_every)
    r.add_argument("--collective-timeout", type=float, default=d.collective_timeout, help="seconds")
    r.add_argument("--stall-factor", type=float, default=d.stall_factor)
    r.add_argument("--stall-min-seconds", type=float, default=d.stall_min_seconds)
    r.add_argument("--stall-seconds", type=float, default=d.stall_seconds, help=argparse.SUPPRESS)

    s = parser.add_argument_group("synthetic data")
    s.add_argument("--synthetic-data", type=int, default=d.synthetic_data,
                   help="train on N synthetic cuts instead of --manifest-dir (checks, benchmarks)")
    s.add_argument("--synthetic-batch-size", type=int, default=d.synthetic_batch_size)
    s.add_argument("--synthetic-partition", default=d.synthetic_partition, choices=("rows", "batches"))


def add_sample_arguments(parser: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Hear it train (docs/training.md): rank 0 synthesises fixed held-out items at each
    validation and writes audio, mel/attention images and scores to TensorBoard."""
    g = parser.add_argument_group("validation samples")
    g.add_argument("--valid-samples", type=int, default=d.valid_samples,
                   help="held-out items synthesised at each --valid-interval, prompted by another "
                        "utterance of the same speaker (0: off; needs --tensorboard)")
    g.add_argument("--valid-samples-interval", type=int, default=d.valid_samples_interval,
                   help="steps between sampling passes, a multiple of --valid-interval (0: at "
                        "every validation)")
    g.add_argument("--valid-samples-max-seconds", type=float, default=d.valid_samples_max_seconds,
                   help="decode at most this many seconds per item: bounds the pass's cost (its "
                        "wall time is logged; the other ranks wait for it in their next collective)")
    g.add_argument("--valid-samples-decode", default=d.valid_samples_decode,
                   help="bin/infer.py decoding flags in one string, e.g. '--top-k 3 --num-candidates "
                        "4 --nar-decoding mmse --seed 1' (default: bin/infer.py's defaults)")
    g.add_argument("--valid-samples-codec-dir", default=d.valid_samples_codec_dir,
                   help="directory holding the codec (audio_codec.json, mel_rvq.pt) that turns codes "
                        "into audio; default: the corpus's (with --synthetic-data: none, the codes "
                        "are shown as images)")
    g.add_argument("--valid-judge", default=d.valid_judge,
                   help="phoneme judge (e.g. {manifest-dir}/judge.pt): the samples' held-out PER and "
                        "speaker similarity as TensorBoard scalars (default: not measured)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"args"}
    values = {k: v for k, v in vars(args).items() if k in names}
    cfg = TrainConfig(**values, args=plain_args(args))
    validate_config(cfg)
    return cfg


def plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag as plain Python types (for checkpoints and TensorBoard)."""
    out: dict[str, Any] = {}
    for k, v in vars(args).items():
        if isinstance(v, Path):
            v = str(v)
        elif isinstance(v, list):
            v = [str(x) if isinstance(x, (Path, FaultSpec)) else x for x in v]
        out[k] = v
    return out


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
    if cfg.valid_samples:
        from valle.train.samples import DecodeFlagsError, decode_flags

        try:
            decode_flags(cfg.valid_samples_decode)
        except DecodeFlagsError as e:
            bad("--valid-samples-decode", str(e))
    if cfg.compile_pad < 1:
        bad("--compile-pad", "must be >= 1")
    if cfg.save_every_n < 1 or cfg.valid_interval < 1 or cfg.log_interval < 1:
        bad("--save-every-n/--valid-interval/--log-interval", "must be >= 1")
    for spec in cfg.inject_fault:
        if spec.phase == "grad_sync" and cfg.grad_sync == "ddp":
            bad("--inject-fault", f"{spec}: --grad-sync ddp has no grad_sync point (DDP "
                "all-reduces inside backward; backward@STEP tests that), use --grad-sync "
                "overlap or after-backward")
    if cfg.synthetic_data == 0 and not cfg.args.get("manifest_dir"):
        bad("--manifest-dir", "no corpus given (or pass --synthetic-data N to train on synthetic cuts)")

"""LoRA: low-rank adapters on a frozen pretrained model (fine-tuning a new voice or corpus).

``apply_lora(model, LoraConfig(lora_rank=16))`` wraps the chosen layers in place: each keeps its
own ``weight``/``bias`` parameters under the same names (so the base's state-dict keys do not
change and a base checkpoint still loads into it) and gains ``lora_A``/``lora_B``, whose
product, scaled by ``alpha / rank``, is added to the layer's weight. ``lora_B`` (for
embeddings ``lora_A``) starts at zero, so the wrapped model starts out computing exactly what
the base does. Every base parameter gets ``requires_grad=False``: only the adapters train and
hold optimizer state.

``lora_state_dict(model)`` is the adapters alone (a small file), ``base_fingerprint`` the
sha256 that ties them to their base, ``merge_lora(model)`` folds them into the weights (the
model is then a plain one, saved as a normal checkpoint).

A new language (``--add-language``, a VALL-E X model) grows the AR and NAR language tables by
one row each (``add_language_rows``): ``LanguageRows`` keeps the base's table as its frozen
``weight`` and the new rows as ``added_rows``, which train and travel with the adapters.

The attention's fused projections are ``nn.Linear`` modules read through
``transformer.project`` (their key bias lives outside the module), which adds the
adapter's ``low_rank_update`` when there is one. Imports torch only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from valle.config_flags import flag

from .convert import CheckpointError
from .transformer import MultiHeadAttention, TransformerLayer

LORA_TARGETS = ("attn", "ffn", "embed", "head")
# ``added_rows``: a new language's rows (LanguageRows), saved and loaded with the adapters.
ADAPTER_SUFFIXES = (".lora_A", ".lora_B", ".added_rows")
# The VALL-E X language tables a new language grows.
LANGUAGE_TABLES = ("ar_language_embedding", "nar_language_embedding")


class LoraError(CheckpointError):
    """Adapters that do not fit a model or its base; the message names the file (a usage
    error: the trainer exits 2 with it, bin/infer.py prints it)."""


LORA_GROUP = "LoRA fine-tuning"


def parse_targets(text: str) -> tuple[str, ...]:
    """``attn,ffn`` -> ("attn", "ffn") (the --lora-targets flag)."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


@dataclass(frozen=True)
class LoraConfig:
    """The adapters' shape, and their flags (docs/training.md, "Fine-tuning with LoRA").
    lora_rank 0: no LoRA (full fine-tuning or training from scratch)."""

    lora_rank: int = flag(0, "train rank-R adapters on the frozen --start-from weights; "
                          "checkpoints hold the adapters alone (0: off, every parameter trains)",
                          group=LORA_GROUP)
    lora_alpha: float = flag(16.0, "the adapters' update is scaled by alpha / rank",
                             group=LORA_GROUP)
    # on the adapter's input only (the base path has its own dropout)
    lora_dropout: float = flag(0.0, "dropout on the adapters' input", group=LORA_GROUP)
    lora_targets: tuple[str, ...] = flag(
        ("attn", "ffn"), f"layers given adapters, comma separated, of {','.join(LORA_TARGETS)} "
        "(attn: attention projections, ffn: feed-forward, embed: embeddings, head: the AR "
        "output layer)", group=LORA_GROUP, parse=parse_targets, cli_default="attn,ffn")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.lora_rank

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["lora_targets"] = list(self.lora_targets)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoraConfig:
        return cls(lora_rank=int(values["lora_rank"]), lora_alpha=float(values["lora_alpha"]),
                   lora_dropout=float(values["lora_dropout"]),
                   lora_targets=tuple(values["lora_targets"]))

    def check(self) -> None:
        """Raise ValueError naming the flag that is out of range."""
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank: must be >= 0, got {self.lora_rank}")
        if self.enabled and self.lora_alpha <= 0:
            raise ValueError(f"--lora-alpha: must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout: must be in [0, 1), got {self.lora_dropout}")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or (self.enabled and not self.lora_targets):
            raise ValueError(f"--lora-targets: {','.join(unknown) or 'empty'}; choose from "
                             f"{','.join(LORA_TARGETS)}")


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` plus ``scaling * B @ A``; ``weight`` and ``bias`` are the base's own
    parameters (not copies), so the base's state-dict keys are unchanged."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.scaling = scaling
        like = base.weight
        self.lora_A = nn.Parameter(like.new_empty(rank, self.in_features))
        # As nn.Linear initialises its weight; B = 0 makes the update start at zero.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(like.new_zeros(self.out_features, rank))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def low_rank_update(self, x: torch.Tensor) -> torch.Tensor:
        # Two thin products on the activations: never the (out, in) delta matrix.
        return F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.low_rank_update(x)

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def merged(self) -> nn.Linear:
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device="meta")
        plain.weight, plain.bias = self.weight, self.bias
        with torch.no_grad():
            plain.weight.add_(self.delta_weight().to(plain.weight.dtype))
        return plain


class LoraEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose table gains ``scaling * A @ B`` (A: one row per entry, zero
    at the start; B: rank x dim). Tables are small, so the sum is formed per forward."""

    def __init__(self, base: nn.Embedding, rank: int, scaling: float):
        nn.Module.__init__(self)
        for name in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(self, name, getattr(base, name))
        self.weight = base.weight
        self.scaling = scaling
        self.lora_A = nn.Parameter(base.weight.new_zeros(self.num_embeddings, rank))
        self.lora_B = nn.Parameter(base.weight.new_empty(rank, self.embedding_dim))
        nn.init.normal_(self.lora_B)

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_A.float() @ self.lora_B.float()) * self.scaling

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        table = self.weight + (self.lora_A @ self.lora_B) * self.scaling
        return F.embedding(idx, table, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def merged(self) -> nn.Embedding:
        plain = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx,
                             device="meta")
        plain.weight = self.weight
        with torch.no_grad():
            plain.weight.add_(self.delta_weight().to(plain.weight.dtype))
        return plain


class LanguageRows(nn.Embedding):
    """A language table grown by new rows (--add-language): ``weight`` is the base's table,
    frozen, under its own key (so the base's fingerprint and checkpoint are unchanged), and
    ``added_rows`` the new languages' rows (ids ``base_rows`` on), which train. Two tensors,
    not one table with a gradient mask: weight decay would move masked rows too."""

    def __init__(self, base: nn.Embedding, added: torch.Tensor):
        nn.Module.__init__(self)
        for name in ("embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(self, name, getattr(base, name))
        self.weight = base.weight
        self.base_rows = base.weight.shape[0]
        self.num_embeddings = self.base_rows + added.shape[0]
        self.added_rows = nn.Parameter(added.to(base.weight))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, torch.cat([self.weight, self.added_rows]), self.padding_idx,
                           self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)

    def merged(self) -> nn.Embedding:
        plain = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx,
                             device="meta")
        plain.weight = nn.Parameter(torch.cat([self.weight, self.added_rows]).detach().clone())
        return plain


ADAPTER_TYPES = (LoraLinear, LoraEmbedding, LanguageRows)


@dataclass
class LoraPlan:
    """Which layers ``apply_lora`` wrapped, and which it left alone with the reason."""

    wrapped: list[str]
    skipped: dict[str, str]


def _target_of(name: str, module: nn.Module, parent: nn.Module) -> str | None:
    """The --lora-targets group a layer belongs to (None: none)."""
    if isinstance(module, nn.Linear) and isinstance(parent, MultiHeadAttention):
        return "attn"
    if isinstance(module, nn.Linear) and isinstance(parent, TransformerLayer) \
            and name.rsplit(".", 1)[-1] in ("linear1", "linear2"):
        return "ffn"
    if isinstance(module, nn.Embedding):
        return "embed"
    if isinstance(module, nn.Linear) and name.endswith("predict_layer"):
        return "head"
    return None


def plan_lora(model: nn.Module, config: LoraConfig) -> LoraPlan:
    """The layers ``config.lora_targets`` select, and those a target would select but cannot take."""
    modules = dict(model.named_modules())
    plan = LoraPlan(wrapped=[], skipped={})
    for name, module in modules.items():
        if not name:
            continue
        parent = modules[name.rsplit(".", 1)[0] if "." in name else ""]
        target = _target_of(name, module, parent)
        if target is None or target not in config.lora_targets:
            continue
        if isinstance(module, LanguageRows):
            plan.skipped[name] = "its new language's row trains whole (--add-language)"
            continue
        if isinstance(module, ADAPTER_TYPES):
            raise LoraError(f"{name} already has LoRA adapters")
        if target == "embed" and name == "ar_audio_embedding" and getattr(model, "tie_ar_head", False):
            # The tied AR head reads this table's weight directly; an adapter seen only by
            # the lookup would make the merged model differ from the unmerged one.
            plan.skipped[name] = "its table is also the tied AR head (--tie-ar-head)"
            continue
        plan.wrapped.append(name)
    return plan


def apply_lora(model: nn.Module, config: LoraConfig) -> LoraPlan:
    """Freeze every parameter of ``model`` and wrap the selected layers with adapters, in
    place. Returns the plan (what was wrapped, what was skipped and why)."""
    config.check()
    if not config.enabled:
        raise ValueError("apply_lora: rank 0 means no LoRA")
    plan = plan_lora(model, config)
    if not plan.wrapped:
        raise LoraError(f"--lora-targets {','.join(config.lora_targets)} selects no layer of this model")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in plan.wrapped:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        if isinstance(base, nn.Embedding):
            wrapped: nn.Module = LoraEmbedding(base, config.lora_rank, config.scaling)
        else:
            wrapped = LoraLinear(base, config.lora_rank, config.scaling, config.lora_dropout)
        wrapped.train(base.training)
        setattr(parent, child, wrapped)
    for module in model.modules():  # a new language's rows train with the adapters
        if isinstance(module, LanguageRows):
            module.added_rows.requires_grad_(True)
    return plan


def add_language_rows(model: nn.Module, count: int, init: str | int = "mean") -> None:
    """Grow the model's AR and NAR language tables by ``count`` rows each, in place (before
    ``apply_lora``, after the base is fingerprinted). Each new row starts as ``init``: "mean"
    (the mean of the base's rows) or a row index (a copy of that language's row)."""
    if count < 1:
        raise ValueError(f"add_language_rows: count must be >= 1, got {count}")
    tables = [name for name in LANGUAGE_TABLES if getattr(model, name, None) is not None]
    if not tables:
        raise LoraError("--add-language: this model has no language table (a VALL-E X model has "
                        "one; --num-languages 0 models do not)")
    for name in tables:
        base = getattr(model, name)
        if isinstance(base, ADAPTER_TYPES):
            raise LoraError(f"--add-language: {name} is already wrapped ({type(base).__name__})")
        with torch.no_grad():
            w = base.weight.detach()
            row = w.float().mean(0, keepdim=True) if init == "mean" else w[int(init)][None].float()
            setattr(model, name, LanguageRows(base, row.to(w.dtype).repeat(count, 1)))
    rows = getattr(model, tables[0]).num_embeddings
    # Everything that reads the table's size: id checks, the hparams checkpoints record.
    model.num_languages = rows
    if isinstance(getattr(model, "hparams", None), dict):
        model.hparams["num_languages"] = rows
    if dataclasses.is_dataclass(getattr(model, "config", None)):
        model.config = dataclasses.replace(model.config, num_languages=rows)


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, ADAPTER_TYPES) for m in model.modules())


def is_adapter_key(key: str) -> bool:
    return key.endswith(ADAPTER_SUFFIXES)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters alone (``...lora_A``, ``...lora_B``), detached."""
    return {k: v.detach() for k, v in model.state_dict().items() if is_adapter_key(k)}


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything but the adapters: the base model's state dict, keys as in its checkpoint."""
    return {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}


def load_lora_state_dict(model: nn.Module, adapters: Mapping[str, torch.Tensor],
                         source: str = "adapters") -> None:
    """Load adapters into a model that has them (apply_lora with the same config); every
    adapter of the model must be in ``adapters`` and nothing else."""
    own = set(lora_state_dict(model))
    given = set(adapters)
    missing, unexpected = sorted(own - given), sorted(given - own)
    if missing or unexpected:
        raise LoraError(
            f"{source}: adapters do not fit this model and --lora-targets ({len(missing)} "
            f"missing, e.g. {missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]})")
    state = model.state_dict()
    for key in own:
        if tuple(adapters[key].shape) != tuple(state[key].shape):
            raise LoraError(f"{source}: {key} has shape {tuple(adapters[key].shape)}, the model "
                            f"{tuple(state[key].shape)} (another --lora-rank?)")
    model.load_state_dict(dict(adapters), strict=False)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer's weight and put the plain layer back, in place;
    the parameters train again (``requires_grad=True``) as in any loaded model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, ADAPTER_TYPES):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.merged())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def base_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over a base state dict's names, dtypes, shapes and bytes (adapter keys left
    out): equal exactly when the adapters' base is bit-identical."""
    digest = hashlib.sha256()
    for key in sorted(k for k in state if not is_adapter_key(k)):
        tensor = state[key].detach().cpu().contiguous().reshape(-1)
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def trainable(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """The parameters that train (a frozen LoRA base has none of its own)."""
    return [(n, p) for n, p in named if p.requires_grad]


# ------------------------------------------------------------------ adapter files
def read_adapters(path: str | Path) -> dict[str, Any]:
    """An adapters file of a LoRA run (a trainer checkpoint with a ``lora`` entry)."""
    from .convert import load_payload

    payload = load_payload(path)
    if not isinstance(payload.get("lora"), Mapping):
        raise LoraError(f"{path}: not LoRA adapters (no 'lora' entry): a full checkpoint")
    return payload


def is_adapters_payload(payload: Mapping[str, Any]) -> bool:
    return isinstance(payload.get("lora"), Mapping)


def attach_adapters(model: nn.Module, payload: Mapping[str, Any], source: str, base_name: str,
                    use_averaged_model: bool = False) -> None:
    """Apply an adapters file's LoRA to ``model`` (holding its base weights, in the dtype it
    was trained in) after checking that the base is the one the adapters were trained on."""
    entry = payload["lora"]
    found = base_fingerprint(model.state_dict())
    if found != entry["base_sha256"]:
        raise LoraError(
            f"{source}: trained on base {entry['base']} (sha256 {entry['base_sha256'][:12]}...), "
            f"but {base_name} has sha256 {found[:12]}...: pass the base they were trained on")
    added = list(entry.get("added_languages") or [])
    if added:  # rows the run added (--add-language): their values are among the adapters
        add_language_rows(model, len(added))
    apply_lora(model, LoraConfig.from_dict(entry["config"]))
    key = "model_avg" if use_averaged_model else "model"
    if payload.get(key) is None:
        raise LoraError(f"{source}: holds no {key!r} (averaged adapters)")
    load_lora_state_dict(model, payload[key], source)
    model.requires_grad_(False)


def merged_checkpoint(adapters_payload: Mapping[str, Any], model: nn.Module,
                      hparams: Mapping[str, Any]) -> dict[str, Any]:
    """A normal checkpoint of ``model`` with its adapters merged (``merge_lora`` first): the
    adapters file's payload with the full weights, the base's architecture in its config,
    and no training state (it starts a new run with --start-from, or synthesises)."""
    if has_lora(model):
        raise ValueError("merged_checkpoint: merge_lora(model) first")
    out = {k: v for k, v in adapters_payload.items() if k != "lora"}
    out.update(model={k: v.detach().cpu() for k, v in model.state_dict().items()}, model_avg=None,
               optimizer=None, scheduler=None, scaler=None, sampler=None,
               # a normal checkpoint: its flags no longer say LoRA
               config={**dict(adapters_payload.get("config") or {}), **dict(hparams),
                       "lora_rank": 0})
    return out

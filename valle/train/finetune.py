"""LoRA fine-tuning runs (--lora-rank on top of --start-from): the frozen base, its adapters,
and the checkpoint entry that ties them together.

A LoRA run's checkpoints hold the adapters alone under ``model`` (and ``model_avg``) plus a
``lora`` entry: the adapter config, the sha256 of the base state dict and the --start-from
path it came from. Resuming loads the base from --start-from again, checks its hash and
loads the adapters; another base is refused with a message naming both files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from valle.models.lora import (
    LoraConfig,
    LoraError,
    LoraPlan,
    apply_lora,
    base_fingerprint,
    is_adapter_key,
    load_lora_state_dict,
    lora_state_dict,
)

logger = logging.getLogger(__name__)


@dataclass
class LoraRun:
    """The adapters a run trains and the base they belong to."""

    config: LoraConfig
    base_sha256: str
    base_path: str
    plan: LoraPlan

    def entry(self) -> dict[str, Any]:
        """The checkpoint's ``lora`` entry."""
        from pathlib import Path

        # Absolute: bin/infer.py and the synthesis page find the base from any directory.
        return {"config": self.config.to_dict(), "base_sha256": self.base_sha256,
                "base": str(Path(self.base_path).resolve())}


def attach_lora(config: LoraConfig, start_from: str, model: torch.nn.Module,
                base_state: dict[str, torch.Tensor]) -> LoraRun:
    """Load the base weights into ``model``, fingerprint them, then freeze them and add the
    adapters (in place)."""
    model.load_state_dict(base_state, strict=True)
    base_sha256 = base_fingerprint(model.state_dict())
    plan = apply_lora(model, config)
    for name, why in plan.skipped.items():
        logger.warning("LoRA: %s left without an adapter: %s", name, why)
    adapters = sum(t.numel() for t in lora_state_dict(model).values())
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA rank %d (alpha %g) on %d layers (%s): %.3f M adapter parameters, %.2f%% of "
                "the model; base %s (sha256 %s...) frozen", config.lora_rank, config.lora_alpha,
                len(plan.wrapped), ",".join(config.lora_targets), adapters / 1e6,
                100.0 * adapters / max(total, 1), start_from, base_sha256[:12])
    return LoraRun(config, base_sha256, start_from, plan)


def check_lora_resume(lora: LoraRun | None, payload: dict[str, Any], where: str) -> None:
    """Refuse to resume adapters onto another base, or a LoRA checkpoint without LoRA (and
    the reverse), naming the files."""
    saved = payload.get("lora")
    if lora is None and saved is not None:
        raise LoraError(f"{where} holds LoRA adapters (rank {saved['config']['lora_rank']}, base "
                        f"{saved['base']}): resume with the same --lora-rank and --start-from")
    if lora is None:
        return
    if saved is None:
        raise LoraError(f"{where} holds a full model, not LoRA adapters: use a new --exp-dir "
                        "for a LoRA run (or drop --lora-rank)")
    if saved["base_sha256"] != lora.base_sha256:
        raise LoraError(
            f"{where}: its adapters were trained on base {saved['base']} (sha256 "
            f"{saved['base_sha256'][:12]}...), but --start-from {lora.base_path} has sha256 "
            f"{lora.base_sha256[:12]}...: pass the base they were trained on")
    if LoraConfig.from_dict(saved["config"]) != lora.config:
        raise LoraError(f"{where}: adapters of {saved['config']}, the flags ask for "
                        f"{lora.config.to_dict()}: pass the same --lora-* flags")


def load_adapters(model: torch.nn.Module, payload: dict[str, Any], where: str) -> None:
    load_lora_state_dict(model, payload["model"], where)


def adapters_only(state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """A full state dict cut down to its adapters (the averaged model's, for checkpoints)."""
    return None if state is None else {k: v for k, v in state.items() if is_adapter_key(k)}


def check_text_tokens(base_table: str | None, corpus_table: str | None, start_from: str) -> None:
    """The corpus's symbols must have the ids the base was trained with: a corpus tokenized
    with its own table would feed the adapters other phonemes under the same ids."""
    from pathlib import Path

    if not corpus_table or not base_table or Path(base_table).resolve() == Path(corpus_table).resolve():
        return
    if not Path(base_table).is_file():
        logger.warning("--start-from %s names the symbol table %s, which is not here: cannot check "
                       "that the corpus's (%s) gives the same ids", start_from, base_table, corpus_table)
        return
    from valle.data.symbols import SymbolTable

    base, corpus = SymbolTable.from_file(base_table), SymbolTable.from_file(corpus_table)
    differ = [s for s in corpus.symbols if s not in base or base.get(s) != corpus.get(s)]
    if differ:
        raise LoraError(
            f"--text-tokens {corpus_table}: {len(differ)} symbol(s) ({', '.join(differ[:5])}) are "
            f"missing from, or have other ids than in, the symbol table {base_table} of --start-from "
            f"{start_from}: tokenize the corpus with bin/tokenizer.py --text-tokens {base_table} "
            f"and train with --text-tokens {base_table}")

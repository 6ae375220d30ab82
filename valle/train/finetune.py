"""LoRA fine-tuning runs (--lora-rank on top of --start-from): the frozen base, its adapters,
and the checkpoint entry that ties them together.

A LoRA run's checkpoints hold the adapters alone under ``model`` (and ``model_avg``) plus a
``lora`` entry: the adapter config, the sha256 of the base state dict and the --start-from
path it came from. Resuming loads the base from --start-from again, checks its hash and
loads the adapters; another base is refused with a message naming both files.

``--add-language NAME`` (a VALL-E X base: it has a language table) grows the AR and NAR
language tables by one row, initialised by ``--add-language-init`` (the mean of the base's
rows, or a copy of one language's row). With LoRA that row trains with the adapters and the
rest of the base stays frozen; the ``lora`` entry names the added language and the grown
table. Without LoRA the grown table is a plain one and every weight trains.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from valle.models.lora import (
    ADAPTER_TYPES,
    LoraConfig,
    LoraError,
    LoraPlan,
    add_language_rows,
    apply_lora,
    base_fingerprint,
    is_adapter_key,
    load_lora_state_dict,
    lora_state_dict,
)

logger = logging.getLogger(__name__)


MIX_NAMES = ("mix", "auto")  # the VALL-E X frontend's own words for text languages


@dataclass(frozen=True)
class NewLanguage:
    """--add-language: the language, how its row starts, and the grown table (row order)."""

    name: str
    init: str  # "mean", or a language of the base's table whose row is copied
    languages: tuple[str, ...]

    @property
    def init_row(self) -> str | int:
        return "mean" if self.init == "mean" else self.languages.index(self.init)


def plan_new_language(name: str, init: str, table: list[str] | None, start_from: str) -> NewLanguage:
    """Check --add-language NAME against the base's language table; LoraError names the flag."""
    import re

    from valle.data.vallex_text import language_code

    if not table:
        raise LoraError(f"--add-language {name}: --start-from {start_from} has no language table "
                        "(a Plachtaa/VALL-E-X checkpoint, or a run started from one, has one)")
    if not re.fullmatch(r"[a-z][a-z0-9-]*", name) or name in MIX_NAMES:
        raise LoraError(f"--add-language {name!r}: name the language as espeak names its voice "
                        "(lower case, e.g. de, fr-fr, pt-br); mix and auto are taken")
    if name in table or language_code(name) in table:
        raise LoraError(f"--add-language {name}: already in the language table {list(table)} of "
                        f"--start-from {start_from}")
    if init != "mean" and init not in table:
        raise LoraError(f"--add-language-init {init}: mean, or one of the table's languages "
                        f"{list(table)} (its row is copied)")
    return NewLanguage(name, init, (*table, name))


def grow_language_table(model: torch.nn.Module, new: NewLanguage, trainable_rows_only: bool) -> None:
    """The model's language tables with the new language's row (in place). Without LoRA
    (``trainable_rows_only`` False) the grown tables become plain ones: every row trains."""
    add_language_rows(model, 1, new.init_row)
    logger.info("--add-language %s: language tables grown to %d rows %s, its row from %s",
                new.name, len(new.languages), list(new.languages),
                "the mean of the others" if new.init == "mean" else f"{new.init}'s row")
    if not trainable_rows_only:
        for name, module in list(model.named_children()):
            if isinstance(module, ADAPTER_TYPES):
                setattr(model, name, module.merged())
        model.requires_grad_(True)


@dataclass
class LoraRun:
    """The adapters a run trains and the base they belong to."""

    config: LoraConfig
    base_sha256: str
    base_path: str
    plan: LoraPlan
    new_language: NewLanguage | None = None

    def entry(self) -> dict[str, Any]:
        """The checkpoint's ``lora`` entry."""
        from pathlib import Path

        # Absolute: bin/infer.py and the synthesis page find the base from any directory.
        out = {"config": self.config.to_dict(), "base_sha256": self.base_sha256,
               "base": str(Path(self.base_path).resolve())}
        if self.new_language is not None:  # its rows are among the adapters (``added_rows``)
            out.update(added_languages=[self.new_language.name], languages=list(self.new_language.languages),
                       added_language_init=self.new_language.init)
        return out


def attach_lora(config: LoraConfig, start_from: str, model: torch.nn.Module,
                base_state: dict[str, torch.Tensor], new_language: NewLanguage | None = None) -> LoraRun:
    """Load the base weights into ``model``, fingerprint them, grow its language tables
    (--add-language), then freeze the base and add the adapters (in place)."""
    model.load_state_dict(base_state, strict=True)
    base_sha256 = base_fingerprint(model.state_dict())
    if new_language is not None:
        grow_language_table(model, new_language, trainable_rows_only=True)
    plan = apply_lora(model, config)
    for name, why in plan.skipped.items():
        logger.warning("LoRA: %s left without an adapter: %s", name, why)
    adapters = sum(t.numel() for t in lora_state_dict(model).values())
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA rank %d (alpha %g) on %d layers (%s): %.3f M adapter parameters, %.2f%% of "
                "the model; base %s (sha256 %s...) frozen", config.lora_rank, config.lora_alpha,
                len(plan.wrapped), ",".join(config.lora_targets), adapters / 1e6,
                100.0 * adapters / max(total, 1), start_from, base_sha256[:12])
    return LoraRun(config, base_sha256, start_from, plan, new_language)


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
    added = list(saved.get("added_languages") or [])
    asked = [lora.new_language.name] if lora.new_language is not None else []
    if added != asked:
        raise LoraError(f"{where}: adapters trained with --add-language {','.join(added) or '(none)'}, "
                        f"the flags ask for {','.join(asked) or '(none)'}: pass the same --add-language")


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

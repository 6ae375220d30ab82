"""The trainer's view of a tokenized lhotse corpus (`valle.train.data.TrainData`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from valle.data.datamodule import TtsDataModule
from valle.data.loader import ManifestLoader, ResumableLoader
from valle.train.batching import Batch
from valle.train.config import TrainConfig
from valle.train.dist import DistContext
from valle.train.sampler_state import pick_rank_state, sampler_payload

logger = logging.getLogger(__name__)


class LhotseTrainData:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, ar_codebook_size: int = 1024):
        self.cfg = cfg
        self.ctx = ctx
        # "auto" --max-text-tokens is resolved (and logged) in cfg.data by the data module;
        # checkpoints keep the number.
        self.module = TtsDataModule(cfg.data, seed=cfg.seed, num_languages=cfg.model.num_languages,
                                    prefix_mode=cfg.model.prefix_mode)
        # Checkpoints carry the resolved symbol table path: bin/infer.py reads it from there.
        cfg.data.text_tokens = self.module.text_tokens_path().resolve()
        # ... and the codec's identity (a refitted mel-rvq codec gives other codes).
        cfg.corpus_record["audio_codec"] = self.module.codec_identity()
        # ... whose codebook 0 must fit the AR's head (--ar-codebook-size).
        from valle.codec import check_ar_codebook_size

        check_ar_codebook_size(ar_codebook_size, cfg.data.manifest_dir)
        # VALL-E X: the language-id order, so bin/infer.py maps --language to the same ids.
        languages = self.module.languages()
        if languages is not None:
            cfg.data.languages = languages
            logger.info("languages (id order): %s", ", ".join(languages))
        self.train: ResumableLoader = self.module.train_dataloader(ctx.rank, ctx.world_size)
        self.train.pin_memory = ctx.device.type == "cuda"
        self._unreadable: list[dict[str, str]] = []
        self.valid: ManifestLoader | None = None
        try:
            self.valid = self.module.valid_dataloader(ctx.rank, ctx.world_size)
            self.valid.pin_memory = self.train.pin_memory
        except FileNotFoundError as e:
            logger.warning("no validation data: %s", e)
        self._filtered_written = 0  # entries of the filter report already in filtered-cuts.tsv
        self.write_filter_report()

    def write_filter_report(self) -> None:
        """``<exp-dir>/filtered-cuts.tsv``: the cuts the filters removed so far (all of them
        at start when a part had no extremes record and was read with a pass; otherwise as
        the sampler meets them). Rewritten when it grew: at start, each epoch's end, and with
        each checkpoint."""
        report = self.module.filter_report
        if not self.ctx.is_main or len(report) == self._filtered_written:
            return
        path = self.cfg.exp_dir / "filtered-cuts.tsv"
        report.write(path)
        self._filtered_written = len(report)
        logger.info("cuts removed by the filters: %s (listed in %s)", report.summary(), path)

    def train_batches(self, epoch: int) -> Iterator[Batch]:
        self.train.set_epoch(epoch)
        return self._reporting(self._readable(iter(self.train), self._unreadable))

    def _reporting(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        yield from batches
        self.write_filter_report()  # the epoch met every cut the filters remove

    def valid_batches(self) -> Iterator[Batch]:
        unreadable: list[dict[str, str]] = []
        yield from self._readable(iter(self.valid) if self.valid is not None else iter(()),
                                  unreadable)
        for entry in unreadable:  # validation: said, not counted in the epoch's cuts
            logger.warning("validation cut %s skipped: its codes cannot be read from %s (%s)",
                           entry["cut_id"], entry["file"] or "?", entry["error"])

    @staticmethod
    def _readable(batches: Iterator[Batch], unreadable: list) -> Iterator[Batch]:
        """The batches without the cuts whose codes could not be read (collected in
        `unreadable`); a batch left with no cut is not yielded at all."""
        for batch in batches:
            unreadable += batch.pop("unreadable", [])
            if batch["cut_ids"]:
                yield batch

    def take_unreadable(self) -> list[dict[str, str]]:
        """The training cuts found unreadable since the last call (the loop counts them)."""
        taken = list(self._unreadable)
        self._unreadable.clear()  # in place: the batch iterator appends to this list
        return taken

    def pessimistic_batches(self) -> dict[str, Batch]:
        """The worst batch per criterion: built from the extremes record (no pass; the same
        batches on every rank), or without one from a pass over this rank's batches."""
        return pessimistic_batches_of(self.module, self.ctx, self.train.dataset)

    def state_dict(self, ctx: DistContext, next_epoch: bool = False) -> dict[str, Any]:
        self.write_filter_report()  # with each checkpoint
        return sampler_payload(self.train.state_dict(), ctx, next_epoch, "batches_consumed")

    def load_state_dict(self, state: dict[str, Any], ctx: DistContext) -> None:
        self.train.load_state_dict(pick_rank_state(state, ctx))

    def steps_hint(self, num_epochs: int) -> int | None:
        return None  # a lazy manifest does not know its length without a pass


def pessimistic_batches_of(module: TtsDataModule, ctx: DistContext, dataset: Any = None
                           ) -> dict[str, Batch]:
    """The worst batch per criterion of `module`'s training data, collated by `dataset` (the
    train loader's; None: the scan's): from the extremes record, else by a pass over this
    rank's batches (metadata only). --max-duration auto calls it at several budgets."""
    worst = module.worst_batches()
    if worst is None or dataset is None:
        from tqdm import tqdm

        from valle.data.pessimistic import worst_of

        batches, dataset = module.scan_batches(ctx.rank, ctx.world_size)
        if worst is None:
            worst = worst_of(tqdm(batches, desc="scanning for pessimistic batches",
                                  disable=not ctx.is_main))
    return {f"{name} ({value:.1f})": dataset[cuts] for name, (value, cuts) in worst.items()}

"""The trainer's resumable loaders: one state format for both data sources.

A loader counts the batches it handed to the caller (not the batches a sampler produced,
which DataLoader workers prefetch ahead), so the state (epoch, batches consumed, world size,
rank, seed) says exactly where to resume: the same loader, rebuilt, skips that many batches
of the epoch. ``ManifestLoader`` (``--manifest-dir``) skips them in the sampler without
loading features; ``valle.data.shar.SharLoader`` (``--shar-dir``) replays them. A state
records which kind wrote it: the two deal cuts differently, so a mid-epoch position of one
means nothing to the other and is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

STATE_FORMAT = "valle-sampler-1"
SOURCE_FLAGS = {"manifest": "--manifest-dir", "shar": "--shar-dir"}


def worker_context():
    """DataLoader workers by fork where the platform has it (Linux's default, what torchrun
    gives): a process that was itself started by spawn (multi-rank tests, notebooks) would
    otherwise inherit spawn and re-import torch in every worker, every epoch (~10 s each)."""
    import multiprocessing as mp

    return "fork" if "fork" in mp.get_all_start_methods() else None


def state_source(state: dict[str, Any]) -> str:
    """Which loader wrote ``state`` (states written before the field existed: Shar ones
    carried ``"shar": True``)."""
    return state.get("source") or ("shar" if state.get("shar") else "manifest")


class ResumableLoader:
    """Batches of one epoch, counted; subclasses say how to start an epoch past its first
    ``skip`` batches."""

    source = ""  # "manifest" | "shar"
    # Batches in page-locked host memory (the trainer sets it on CUDA): only from there does a
    # non_blocking upload leave the host free to prepare the next step while the copy runs.
    pin_memory = False

    def __init__(self, dataset, num_workers: int, world_size: int, rank: int, seed: int) -> None:
        self.dataset = dataset
        self.num_workers = num_workers
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.batches_consumed = 0

    def _seek_epoch(self, epoch: int) -> None:
        raise NotImplementedError

    def _batches(self, skip: int) -> Iterable[dict]:
        """The epoch's batches after its first ``skip``."""
        raise NotImplementedError

    def _dataloader(self, data, **kwargs):
        """Its workers are forked when it is iterated (every epoch): they must not inherit the
        HDF5 code files this process read (prompts, samples, the batch scan; lhotse keeps them
        open, with their locks), and die with this process (``valle.data.workers``)."""
        import torch

        from valle.data.workers import forget_cached_files, worker_init_fn

        if self.num_workers:
            forget_cached_files()
        return torch.utils.data.DataLoader(
            data, batch_size=None, num_workers=self.num_workers, persistent_workers=False,
            multiprocessing_context=worker_context() if self.num_workers else None,
            worker_init_fn=worker_init_fn() if self.num_workers else None,
            pin_memory=self.pin_memory, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.batches_consumed = 0
        self.epoch = epoch
        self._seek_epoch(epoch)

    def __iter__(self) -> Iterator[dict]:
        for batch in self._batches(self.batches_consumed):
            self.batches_consumed += 1
            yield batch
        # A finished epoch: the next iteration of the same epoch starts from the beginning.
        self.batches_consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT, "source": self.source, "epoch": self.epoch,
            "batches_consumed": self.batches_consumed, "world_size": self.world_size,
            "rank": self.rank, "seed": self.seed,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a state this loader cannot resume from, naming what differs."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"sampler state has format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        saved = state_source(state)
        if saved != self.source and state.get("batches_consumed", 0) > 0:
            raise ValueError(
                f"sampler state was saved mid-epoch training from {SOURCE_FLAGS.get(saved, saved)}; this run "
                f"trains from {SOURCE_FLAGS[self.source]}, which deals the cuts differently: resume with "
                f"{SOURCE_FLAGS.get(saved, saved)}, or from an epoch-N.pt checkpoint (--start-epoch)")
        if state.get("world_size") != self.world_size:
            raise ValueError(
                f"sampler state was saved with world size {state.get('world_size')} and cannot resume "
                f"mid-epoch with {self.world_size}: the ranks' partitions differ (restart the epoch)")
        if state.get("seed") != self.seed:
            raise ValueError(f"sampler state was saved with --seed {state.get('seed')}, now {self.seed}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.set_epoch(state["epoch"])
        self.batches_consumed = state["batches_consumed"]


class ManifestLoader(ResumableLoader):
    """A DataLoader over a ``BudgetedSampler`` of a cut manifest; resuming skips batches in
    the sampler, so the skipped cuts' features are never loaded."""

    source = "manifest"

    def __init__(self, dataset, sampler, num_workers: int, world_size: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_workers, world_size, rank, seed)
        self.sampler = sampler

    def _seek_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _batches(self, skip: int) -> Iterable[dict]:
        self.sampler.skip_batches = skip
        return self._dataloader(self.dataset, sampler=self.sampler)


"""Training from Lhotse Shar shards (``--shar-dir``): no global manifest in memory.

Shards (``cuts.NNNNNN.jsonl.gz`` + ``features.NNNNNN.tar``, written by ``bin/tokenizer.py
--shar-dir`` or ``python -m valle.data.recipe shar``) are dealt to (rank, DataLoader worker)
slots: every epoch the shard list is shuffled with (seed, epoch), identically on every rank,
and slot ``rank * workers + worker`` takes every ``world_size * workers``-th shard. Each shard
is read by exactly one slot, so every cut is seen once per epoch. Inside a slot a
``DynamicBucketingSampler`` (world size 1) and the text-token budget make the batches.
Ranks may end up with different numbers of batches; the trainer lets a dry rank step with
an empty gradient (docs/oom.md).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from valle.data.loader import ResumableLoader

logger = logging.getLogger(__name__)


class SharError(FileNotFoundError):
    """A --shar-dir that holds no usable shards (one line naming the directory)."""


def find_shards(shar_dirs: str) -> list[dict[str, str]]:
    """``[{"cuts": path, "features": path}, ...]`` from comma-separated Shar directories.

    A shard missing one of its two files, or a gap in the shard numbers (a whole shard
    gone), is reported by name and left out: the rest trains. No usable shard at all is
    an error."""
    shards = []
    for d in [Path(x) for x in str(shar_dirs).split(",") if x.strip()]:
        if not d.is_dir():
            raise SharError(f"--shar-dir {d}: no such directory")
        cuts = _by_index(d, "cuts.", ".jsonl")
        feats = _by_index(d, "features.", ".tar")
        if not cuts:
            raise SharError(f"--shar-dir {d}: no cuts.*.jsonl.gz shards (export with bin/tokenizer.py --shar-dir)")
        for index in sorted(set(range(max(cuts | feats) + 1)) - (cuts.keys() & feats.keys())):
            have = cuts.get(index) or feats.get(index)
            logger.warning("--shar-dir %s: shard %06d %s: left out, the other shards train",
                           d, index, f"has {Path(have).name} but not its "
                           f"{'features' if index in cuts else 'cuts'} file" if have else "is missing")
        shards += [{"cuts": cuts[i], "features": feats[i]} for i in sorted(cuts.keys() & feats.keys())]
    if not shards:
        raise SharError(f"--shar-dir {shar_dirs}: no shard has both its cuts and features files")
    return shards


def shar_extremes(shar_dirs: str):
    """The extremes records of the Shar directories merged, or None when one has none (shards
    written before the records were). A part's shards are in ``DIR/<part>``, its record beside
    them, ``DIR/{prefix}_extremes_{part}.json`` (not inside: lhotse's ``from_shar(in_dir)``
    takes every file of a shard dir for a field)."""
    from valle.data.extremes import Extremes

    merged = None
    for d in [Path(x) for x in str(shar_dirs).split(",") if x.strip()]:
        paths = sorted(d.resolve().parent.glob(f"*_extremes_{d.resolve().name}.json"))
        if not paths:
            logger.warning("--shar-dir %s has no extremes record beside it (%s/PREFIX_extremes_%s.json): "
                           "the sampler's bins come from the shards and the scan from a pass over them "
                           "(slow for a large corpus). The record of the part's cuts file "
                           "(python -m valle.data.recipe extremes CUTS writes it) can be copied there",
                           d, d.resolve().parent, d.resolve().name)
            return None
        for path in paths:
            record = Extremes.read(path)
            merged = record if merged is None else merged.merge(record)
    return merged


def _by_index(directory: Path, prefix: str, kind: str) -> dict[int, str]:
    """{shard number: path} of the files named PREFIX<number>KIND... in `directory`."""
    found = {}
    for p in directory.iterdir():
        number = p.name[len(prefix):].split(".", 1)[0]
        if p.name.startswith(prefix) and kind in p.name and number.isdigit():
            found[int(number)] = str(p)
    return found


class SharTrainSet(torch.utils.data.IterableDataset):
    """Yields collated batches of this rank's share of the shards (split again per worker)."""

    def __init__(self, shards: list[dict[str, str]], dataset, constraint, rank: int, world_size: int,
                 seed: int, shuffle: bool, num_buckets: int, buffer_size: int, cut_filter,
                 duration_bins: list[float] | None = None) -> None:
        super().__init__()
        self.shards, self.dataset, self.constraint = shards, dataset, constraint
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.num_buckets, self.buffer_size, self.cut_filter = num_buckets, buffer_size, cut_filter
        self.duration_bins = duration_bins  # from the extremes records' sample, when present
        self.epoch = 0

    def shards_for(self, worker: int, num_workers: int) -> list[dict[str, str]]:
        order = list(range(len(self.shards)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        slot, slots = self.rank * num_workers + worker, self.world_size * num_workers
        return [self.shards[i] for i in order[slot::slots]]

    def cut_batches(self, worker: int = 0, num_workers: int = 1, with_features: bool = True) -> Iterator:
        from lhotse import CutSet
        from lhotse.dataset import DynamicBucketingSampler

        from valle.data.sampling import BudgetedSampler

        mine = self.shards_for(worker, num_workers)
        if not mine:
            return
        fields = {"cuts": [s["cuts"] for s in mine]}
        if with_features:
            fields["features"] = [s["features"] for s in mine]
        cuts = CutSet.from_shar(fields=fields).filter(self.cut_filter)
        sampler = DynamicBucketingSampler(
            cuts, constraint=self.constraint.copy(), duration_bins=self._duration_bins(fields["cuts"]),
            shuffle=self.shuffle, drop_last=False,
            buffer_size=self.buffer_size, seed=self.seed + self.epoch, world_size=1, rank=0,
        )
        sampler.set_epoch(self.epoch)
        yield from BudgetedSampler(sampler, self.constraint)

    def _duration_bins(self, cuts_paths: list[str], sample: int = 10_000) -> list[float]:
        """Bucket edges: from the extremes records' sample of the whole corpus when the Shar
        directories hold them, else from the first ``sample`` cuts of these shards (metadata
        only). A slot may hold fewer cuts than --num-buckets, which lhotse's own estimate
        refuses."""
        from itertools import islice

        if self.duration_bins is not None:
            return self.duration_bins
        from lhotse import CutSet
        from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets

        head = list(islice(CutSet.from_shar(fields={"cuts": cuts_paths}), sample))
        buckets = min(self.num_buckets, len(head))
        if buckets < 2:
            return [1e9]  # one bucket holds everything
        return sorted(set(estimate_duration_buckets(head, buckets, self.constraint)))

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for cuts in self.cut_batches(worker, num_workers):
            yield self.dataset[cuts]


class SharLoader(ResumableLoader):
    """The trainer's loader over Shar shards. A mid-epoch resume replays the epoch's first
    ``batches_consumed`` batches without handing them out."""

    source = "shar"

    def __init__(self, data: SharTrainSet, num_workers: int, world_size: int, rank: int, seed: int) -> None:
        super().__init__(data.dataset, num_workers, world_size, rank, seed)
        self.data = data

    def _seek_epoch(self, epoch: int) -> None:
        self.data.epoch = epoch

    def _batches(self, skip: int) -> Iterable[dict]:
        return itertools.islice(self._dataloader(self.data), skip, None)

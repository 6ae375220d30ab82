"""Where pretrained codec weights come from, for EnCodec and Vocos alike.

In order: the file given on the command line; the library's cache; a download into that
cache, checked against the file's published hash; random weights, only when the user asked
for them (tests and demos: the audio is noise); otherwise one line naming the file, the cache
and the flags. Resolving is cheap, so callers do it before any long work.
The download libraries (torch.hub, huggingface_hub) are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)


class WeightsError(FileNotFoundError):
    """No weights (one line naming the file, the cache and the flag)."""


def one_line(error: BaseException) -> str:
    """``Type: first line`` of an exception, short enough for a one-line error."""
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class WeightsSource(Protocol):
    def cached(self) -> Path | None: ...  # the file in the cache, or None
    def download(self) -> Path: ...  # into the cache, hash-checked; raises when it cannot
    def missing(self) -> str: ...  # "<file> is not in <cache> and <where> could not be fetched"


@dataclass(frozen=True)
class TorchHubFile:
    """A file in torch.hub's checkpoint cache, downloaded from ``url``. Its name ends with a
    prefix of its sha256 (``name-<hex>.ext``, torch.hub's convention), which a download is
    checked against."""

    url: str

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def hash_prefix(self) -> str:
        return Path(self.name).stem.rsplit("-", 1)[-1]

    def path(self) -> Path:
        import torch

        return Path(torch.hub.get_dir()) / "checkpoints" / self.name

    def cached(self) -> Path | None:
        path = self.path()
        return path if path.is_file() else None

    def download(self) -> Path:
        import torch

        dest = self.path()
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.hub.download_url_to_file(self.url, str(dest), hash_prefix=self.hash_prefix, progress=False)
        except BaseException:
            if dest.exists() and dest.stat().st_size == 0:
                dest.unlink()  # an empty file would pass as cached next time
            raise
        return dest

    def missing(self) -> str:
        return f"{self.name} is not at {self.path()} (copy it there) and {self.url} could not be fetched"


@dataclass(frozen=True)
class HubRepoFile:
    """A file of a Hugging Face hub repository, kept in the hub's cache. The hub stores a
    large file as a blob named by its sha256, which a download is checked against."""

    repo_id: str
    filename: str

    def cached(self) -> Path | None:
        try:
            from huggingface_hub import hf_hub_download

            return Path(hf_hub_download(self.repo_id, self.filename, local_files_only=True))
        except Exception:  # not cached, or huggingface_hub missing
            return None

    def download(self) -> Path:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(self.repo_id, self.filename))
        blob = path.resolve().name
        if re.fullmatch(r"[0-9a-f]{64}", blob) and sha256_of(path) != blob:
            raise RuntimeError(f"{path}: sha256 differs from the hub's {blob[:12]} (a damaged download)")
        return path

    def cache_dir(self) -> str:
        try:
            from huggingface_hub.constants import HF_HUB_CACHE

            return str(HF_HUB_CACHE)
        except Exception:
            return "~/.cache/huggingface/hub"

    def missing(self) -> str:
        return (f"{self.repo_id}/{self.filename} is not in the hub cache {self.cache_dir()} and could "
                "not be fetched")


@dataclass(frozen=True)
class PretrainedWeights:
    """One codec's weights: where they come from and the flags that name them."""

    label: str  # "EnCodec"
    source: WeightsSource
    checkpoint_flag: str  # "--encodec-checkpoint"
    random_flag: str  # "--allow-random-encodec"
    error: type[WeightsError] = WeightsError

    def present(self, checkpoint: str | os.PathLike | None = None) -> bool:
        """Are weights here without a download?"""
        if checkpoint is not None and Path(checkpoint).is_file():
            return True
        return self.source.cached() is not None

    def resolve(self, checkpoint: str | os.PathLike | None = None, allow_random: bool = False,
                download: bool = True) -> Path | None:
        """The weights file; ``None`` means random weights (only with ``allow_random``)."""
        if checkpoint is not None:
            path = Path(checkpoint)
            if not path.is_file():
                raise self.error(f"{self.checkpoint_flag} {path}: no such file")
            return path
        cached = self.source.cached()
        if cached is not None:
            return cached
        why = "downloads disabled"
        if download:
            try:
                path = self.source.download()
            except Exception as e:  # offline (several kinds of error), or a hash mismatch
                why = one_line(e)
            else:
                logger.info("%s weights downloaded to %s (hash checked)", self.label, path)
                return path
        if allow_random:
            return None
        raise self.error(
            f"no {self.label} weights: {self.source.missing()} ({why}); pass {self.checkpoint_flag} "
            f"PATH to the file ({self.random_flag} gives random weights for tests: the audio is noise)")

"""Files that appear whole or not at all, and stay after a power cut: the one home of the
fsync-then-rename steps that checkpoints (valle/train/checkpoint.py) and the tokenizer's
chunks (valle/data/pipeline.py) both take. Imports nothing of valle."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make the renames inside ``directory`` durable; a no-op where the platform or the file
    system refuses fsync on a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Make the complete file ``tmp`` appear as ``path``, atomically and durably: its data
    on disk first, then the rename, then the rename itself on disk. A reader (or a resume
    after a kill, or after a power cut) sees the whole file or none."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)

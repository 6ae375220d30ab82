#!/usr/bin/env python3
"""Train VALL-E / VALL-F.

One process:   python bin/trainer.py --model-name valle --manifest-dir data/tokenized ...
Many GPUs:     torchrun --nproc_per_node=8 bin/trainer.py ...
No corpus:     python bin/trainer.py --synthetic-data 256 --device cpu ...

See docs/training.md and docs/oom.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    from valle.train.cli import parse_config
    from valle.train.loop import main_from_config

    try:
        cfg = parse_config(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return main_from_config(cfg)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Train VALL-E / VALL-F.

One process:   python bin/trainer.py --model-name valle --manifest-dir data/tokenized ...
Many GPUs:     torchrun --nproc_per_node=8 bin/trainer.py ...
No corpus:     python bin/trainer.py --synthetic-data 256 --device cpu ...

See docs/training.md and docs/oom.md.
"""

from __future__ import annotations

import logging
import os
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


def exit_process(code: int) -> None:
    """Exit with ``code``. After a peer failure, without interpreter teardown: the process
    group is left alive then (destroying it can block on the dead peer), and at teardown a
    gloo thread that is still joinable can call std::terminate, so the rank died of SIGABRT
    (exit -6) instead of 14 (seen in the test suite under load). Checkpoints and TensorBoard
    are closed by then; only the standard streams and logging need a flush."""
    from valle.train.loop import EXIT_CODES

    if code == EXIT_CODES["PeerFailure"]:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())

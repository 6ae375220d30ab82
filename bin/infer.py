#!/usr/bin/env python3
"""Zero-shot TTS from a checkpoint. See ``valle/infer.py`` and ``--help``.

Example:
    python bin/infer.py --checkpoint exp/valle/checkpoint-20000.pt \
        --text-prompts "the prompt's words" --audio-prompts prompt.wav \
        --text "what to say" --output-dir infer/demo
"""

import sys
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from valle.infer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

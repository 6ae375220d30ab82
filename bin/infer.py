#!/usr/bin/env python3
"""Zero-shot TTS from a checkpoint (ours or lifeiteng/vall-e's). Every flag: docs/inference.md.

Example:
    python bin/infer.py --checkpoint exp/valle \
        --text-prompts "the prompt's words" --audio-prompts prompt.wav \
        --text "what to say" --output-dir infer/demo
(an exp dir means its best-valid-loss.pt)
"""

import sys
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from valle.infer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

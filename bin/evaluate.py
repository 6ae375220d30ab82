#!/usr/bin/env python3
"""Measure synthesised speech (PER, speaker similarity, duration, length-cap hits, WER).
See ``valle/eval/evaluate.py``, ``--help`` and docs/evaluation.md.

Examples:
    # the wavs bin/infer.py wrote for a TSV (a 5th column ref_wav adds ground-truth figures)
    python bin/evaluate.py --tsv items.tsv --output-dir out --manifest-dir data/tokenized
    # the same flags as bin/infer.py; the checkpoint's config leads to the judge and codec
    python bin/evaluate.py --checkpoint exp/valle/best-valid-loss.pt --output-dir out \
        --text-prompts "..." --audio-prompts prompt.wav --text "..."
"""

import sys
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from valle.eval.evaluate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

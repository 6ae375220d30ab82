#!/usr/bin/env python3
"""A corpus in one eSpeak voice that egs/tiny's training voices do not include (the LoRA demo's
"new voice": egs/tiny/lora.sh). Writes {out}/wavs and metadata.tsv as valle.data.tiny does;
`python -m valle.data.tiny manifests` reads it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from valle.data.tiny import VOICES, Voice, read_sentences, synthesize_items  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sentences", required=True, help="one sentence a line (egs/tiny/sentences.txt)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--voice", default="en-us+f2", help="eSpeak NG voice+variant")
    p.add_argument("--rate", type=int, default=150, help="words per minute")
    p.add_argument("--pitch", type=int, default=80, help="0..100")
    p.add_argument("--limit", type=int, default=48, help="the first N sentences")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if any(v.name == args.voice for v in VOICES):
        p.error(f"--voice {args.voice} is one of egs/tiny's training voices: choose another")
    voice = Voice("new_" + args.voice.replace("+", "_").replace("-", "_"), args.voice,
                  rate=args.rate, pitch=args.pitch)
    sentences = read_sentences(args.sentences)[: args.limit]
    synthesize_items([(text, voice) for text in sentences], args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

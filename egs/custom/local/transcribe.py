#!/usr/bin/env python3
"""egs/custom stage 1: transcribe the utterances that have no transcript with Whisper, where its
weights are already on disk (valle.eval.asr finds them; nothing is downloaded). Without them,
every such utterance stays listed by name in the bad-items report and out of the corpus.

  egs/custom/local/transcribe.py --manifest-dir data/manifests [--prefix custom]
      [--whisper-model base] [--whisper-backend openai-whisper] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # runs from a checkout too


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="egs/custom/local/transcribe.py", description=__doc__.split("\n")[0])
    p.add_argument("--manifest-dir", type=Path, required=True)
    p.add_argument("--prefix", default="custom")
    p.add_argument("--whisper-model", default="base", help="a name (~/.cache/whisper/NAME.pt) or a .pt path")
    p.add_argument("--whisper-backend", default="openai-whisper", help="openai-whisper or faster-whisper")
    p.add_argument("--device", default="cpu")
    return p


def english_only(asr):
    """valle.eval.asr's Whisper decodes English: other languages stay untranscribed (None)."""
    import torch

    from valle.data.validation import base_language

    def transcribe(samples, sample_rate: int, language: str) -> str | None:
        if base_language(language or "en") != "en":
            return None
        return asr.transcribe(torch.from_numpy(samples), sample_rate)

    return transcribe


def main(argv: list[str] | None = None) -> int:
    from valle.data.custom import manifest_paths, transcribe_pending
    from valle.data.manifests import ManifestError, read_jsonl
    from valle.eval.asr import AsrUnavailable, WhisperAsr

    args = get_parser().parse_args(argv)
    paths = manifest_paths(args.manifest_dir, args.prefix)
    try:
        waiting = sum(1 for _ in read_jsonl(paths["pending"]))
    except ManifestError as e:  # stage 0 not run into this --manifest-dir
        print(f"egs/custom/local/transcribe.py: error: {e} (run stage 0 first)", file=sys.stderr)
        return 2
    if waiting == 0:
        print("transcribe: every utterance has a transcript")
        return 0
    try:
        asr = WhisperAsr(args.whisper_model, args.whisper_backend, args.device)
    except (AsrUnavailable, ValueError) as e:
        print(f"transcribe: Whisper unavailable ({e}): {waiting} utterance(s) without a transcript stay out, "
              f"each named in {paths['report']}")
        return 0
    done, report = transcribe_pending(args.manifest_dir, args.prefix, english_only(asr))
    print(f"transcribe: {done} of {waiting} utterance(s) transcribed by Whisper; {report.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

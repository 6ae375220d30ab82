#!/usr/bin/env python3
"""Zero-shot synthesis items from the held-out test part: each held-out sentence is said in a
held-out voice, prompted by another held-out sentence of the same voice.

Writes bin/infer.py's TSV (prompt_text, prompt_wav, text, out_wav) and bin/evaluate.py's (the
same plus ref_wav: the ground truth of the text in that voice)."""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cuts", type=Path, required=True)
    p.add_argument("--num-items", type=int, default=8)
    p.add_argument("--infer-tsv", type=Path, required=True)
    p.add_argument("--eval-tsv", type=Path, required=True)
    args = p.parse_args()
    from lhotse import CutSet

    by_voice: dict[str, list] = {}
    for cut in CutSet.from_file(args.cuts):
        by_voice.setdefault(cut.supervisions[0].speaker, []).append(cut)
    voices = sorted(by_voice)
    rows = []
    for k in range(args.num_items):
        cuts = sorted(by_voice[voices[k % len(voices)]], key=lambda c: c.id)
        i = (k // len(voices)) % len(cuts)
        target, prompt = cuts[i], cuts[(i + 1) % len(cuts)]
        rows.append((prompt.supervisions[0].text, prompt.recording.sources[0].source,
                     target.supervisions[0].text, f"{target.id}.wav", target.recording.sources[0].source))
    args.infer_tsv.parent.mkdir(parents=True, exist_ok=True)
    args.infer_tsv.write_text("".join("\t".join(r[:4]) + "\n" for r in rows), encoding="utf-8")
    header = "prompt_text\tprompt_wav\ttext\tout_wav\tref_wav\n"
    args.eval_tsv.write_text(header + "".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} items ({', '.join(voices)}) -> {args.infer_tsv}, {args.eval_tsv}")


if __name__ == "__main__":
    main()

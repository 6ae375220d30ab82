#!/usr/bin/env python3
"""Cross-lingual synthesis items from the bilingual tiny corpus's test part (VALL-E X): each
test sentence of one language said in a voice of the other, prompted by that voice's own
test utterance (its transcript in its own language).

Writes, under --out-dir, bin/infer.py's TSV for each direction (one run each: --language and
--prompt-language are per run) and bin/evaluate.py's TSV of both, whose language and
prompt_language columns let it phonemize each text in its language and report PER per language:
    en_text_zh_prompt.tsv   English text, Mandarin prompt  (--language en-us --prompt-language cmn)
    zh_text_en_prompt.tsv   Mandarin text, English prompt  (--language cmn --prompt-language en-us)
    eval.tsv                prompt_text, prompt_wav, text, out_wav, language, prompt_language
"""

from __future__ import annotations

import argparse
from pathlib import Path

DIRECTIONS = (("en-us", "cmn", "en_text_zh_prompt"), ("cmn", "en-us", "zh_text_en_prompt"))


def by_language(cuts) -> dict[str, list]:
    """Test cuts per text language (the espeak voice bin/tokenizer.py recorded), sorted by id."""
    out: dict[str, list] = {}
    for cut in sorted(cuts, key=lambda c: c.id):
        out.setdefault(cut.supervisions[0].custom["espeak_voice"], []).append(cut)
    return out


def items(cuts: dict[str, list], text_language: str, prompt_language: str, name: str, n: int) -> list[tuple]:
    """``n`` rows (prompt_text, prompt_wav, text, out_wav): text i of one language, prompt i of the other."""
    texts, prompts = cuts[text_language], cuts[prompt_language]
    rows = []
    for i in range(n):
        text, prompt = texts[i % len(texts)], prompts[i % len(prompts)]
        rows.append((prompt.supervisions[0].text, prompt.recording.sources[0].source,
                     text.supervisions[0].text, f"{name}_{i}.wav"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cuts", type=Path, required=True, help="the bilingual corpus's tiny_cuts_test.jsonl.gz")
    p.add_argument("--num-items", type=int, default=2, help="items per direction")
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args()
    from lhotse import CutSet

    cuts = by_language(CutSet.from_file(args.cuts))
    missing = {lang for lang, _, _ in DIRECTIONS} - set(cuts)
    if missing:
        raise SystemExit(f"{args.cuts}: no test cuts in {sorted(missing)} (prepare with --bilingual true)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    evaluation = ["prompt_text\tprompt_wav\ttext\tout_wav\tlanguage\tprompt_language"]
    for text_language, prompt_language, name in DIRECTIONS:
        rows = items(cuts, text_language, prompt_language, name, args.num_items)
        (args.out_dir / f"{name}.tsv").write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
        evaluation += ["\t".join((*r, text_language, prompt_language)) for r in rows]
    (args.out_dir / "eval.tsv").write_text("\n".join(evaluation) + "\n", encoding="utf-8")
    print(f"{args.num_items} items per direction -> {args.out_dir}/{{{','.join(n for *_, n in DIRECTIONS)},eval}}.tsv")


if __name__ == "__main__":
    main()

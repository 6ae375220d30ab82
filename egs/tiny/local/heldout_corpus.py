#!/usr/bin/env python3
"""The demo's corpus with held-out sentences AND held-out voices, kept apart.

    synth      sentences.txt -> {out}/wavs, metadata.tsv (utt, speaker, wav, text), parts.tsv (utt, part)
    manifests  -> {prefix}_{recordings,supervisions}_{train,dev,test}.jsonl.gz

train: the training sentences, each in ``--voices-per-sentence`` of the training voices, plus
       ``--generated N`` sentences made of random words of the training sentences (a few hundred
       natural sentences let a model memorise them; many varied ones make it learn phonemes).
dev:   other sentences in the training voices (validation loss: new text, known voices).
test:  other sentences again, each in every held-out voice (zero-shot synthesis: new text,
       new voice; prompts are other test utterances of the same voice).
Nothing of dev/test reaches the codec fit, the judge or the model's training.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from valle.data.tiny import VOICES, EspeakSynth, Voice, read_sentences, trim_silence  # noqa: E402

logger = logging.getLogger("heldout_corpus")

TRAIN_VOICES = VOICES
# More training voices (--train-voices N takes the first N of VOICES + these): zero-shot synthesis
# is learnt from many speakers, and eSpeak's variants give them for free.
MORE_TRAIN_VOICES = (
    Voice("spk_m2", "en-us+m2", rate=170, pitch=35),
    Voice("spk_f1", "en-us+f1", rate=175, pitch=70, pitch_range=40),
    Voice("spk_m4", "en-us+m4", rate=185, pitch=45, pitch_range=60),
    Voice("spk_f5", "en-us+f5", rate=160, pitch=55),
    Voice("spk_m5", "en-us+m5", rate=165, pitch=50, pitch_range=40),
    Voice("spk_m6", "en-us+m6", rate=190, pitch=40),
    Voice("spk_linda", "en-us+linda", rate=170, pitch=65),
    Voice("spk_adam", "en-us+adam", rate=175, pitch=45),
)
HELD_OUT_VOICES = (
    Voice("spk_m7", "en-us+m7", rate=175, pitch=50),
    Voice("spk_f2", "en-us+f2", rate=165, pitch=65, pitch_range=60),
)


def split_sentences(sentences: list[str], n_dev: int, n_test: int, seed: int) -> dict[str, list[int]]:
    idx = list(range(len(sentences)))
    random.Random(seed).shuffle(idx)
    if n_dev + n_test >= len(idx):
        raise ValueError(f"{len(idx)} sentences cannot give {n_dev} dev + {n_test} test + some train")
    return {"test": sorted(idx[:n_test]), "dev": sorted(idx[n_test : n_test + n_dev]),
            "train": sorted(idx[n_test + n_dev :])}


def generate_sentences(source: list[str], n: int, seed: int) -> list[str]:
    """``n`` utterances drawn from the words of ``source`` (training text only): half are one
    sentence of 4-10 words, half two sentences of 3-7 words. Two-sentence utterances teach the
    AR what zero-shot synthesis asks of it: after a finished sentence and its pause (the
    prompt), speech goes on while text is left."""
    words = sorted({w.strip(".,;:!?\"'").lower() for s in source for w in s.split()} - {""})
    rng = random.Random(seed + 1)

    def sentence(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi))).capitalize() + "."

    return [sentence(4, 10) if k % 2 == 0 else f"{sentence(3, 7)} {sentence(3, 7)}" for k in range(n)]


def training_voices(n: int) -> tuple[Voice, ...]:
    voices = tuple(TRAIN_VOICES) + MORE_TRAIN_VOICES
    if not 1 <= n <= len(voices):
        raise ValueError(f"--train-voices must be in [1, {len(voices)}], got {n}")
    return voices[:n]


def plan(sentences: list[str], n_dev: int, n_test: int, voices_per_sentence: int, seed: int,
         limit: int | None = None, generated: int = 0, train_voices: int = len(TRAIN_VOICES)):
    """(utt, part, voice, text) rows; ``limit`` caps the natural training sentences (tests)."""
    voices = training_voices(train_voices)
    parts = split_sentences(sentences, n_dev, n_test, seed)
    rows = []
    train_ids = parts["train"][:limit] if limit else parts["train"]
    train = [(f"{i:04d}", sentences[i]) for i in train_ids]
    extra = generate_sentences([sentences[i] for i in parts["train"]], generated, seed)
    train += [(f"g{k:05d}", text) for k, text in enumerate(extra)]
    for k, (key, text) in enumerate(train):
        for j in range(voices_per_sentence):
            v = voices[(k + j) % len(voices)]
            rows.append((f"{v.speaker}_{key}", "train", v, text))
    for k, i in enumerate(parts["dev"]):
        v = voices[k % len(voices)]
        rows.append((f"{v.speaker}_{i:04d}", "dev", v, sentences[i]))
    for i in parts["test"]:
        for v in HELD_OUT_VOICES:
            rows.append((f"{v.speaker}_{i:04d}", "test", v, sentences[i]))
    return rows


def synth(args) -> None:
    import soundfile as sf

    out = Path(args.out_dir)
    sentences = read_sentences(args.sentences)
    rows = plan(sentences, args.num_dev, args.num_test, args.voices_per_sentence, args.seed, args.limit,
                args.generated, args.train_voices)
    # What the corpus will hold, voice parameters included. A corpus already synthesised from
    # the same plan is kept: eSpeak's waveforms depend on what it synthesised before (its
    # oscillator state carries over), so synthesising again would change every wav a little
    # and with them the tokens, the judge and every measured figure (docs/evaluation.md).
    planned = "".join(f"{utt}\t{part}\t{v.speaker}\t{v.name}\t{v.rate}\t{v.pitch}\t{v.pitch_range}\t{text}\n"
                      for utt, part, v, text in rows)
    plan_file = out / "plan.tsv"
    if (plan_file.is_file() and plan_file.read_text(encoding="utf-8") == planned
            and all((out / "wavs" / v.speaker / f"{utt}.wav").is_file() for utt, _, v, _ in rows)):
        logger.info("corpus %s: already synthesised from this plan (%d utterances), kept", out, len(rows))
        return
    plan_file.unlink(missing_ok=True)  # written last: an interrupted run is never taken as done
    engine = EspeakSynth.get()
    meta, parts = [], []
    for n, (utt, part, voice, text) in enumerate(rows, start=1):
        wav = out / "wavs" / voice.speaker / f"{utt}.wav"
        wav.parent.mkdir(parents=True, exist_ok=True)
        sf.write(wav, trim_silence(engine.synthesize(text, voice), engine.sample_rate), engine.sample_rate,
                 subtype="PCM_16")
        meta.append(f"{utt}\t{voice.speaker}\t{wav.relative_to(out)}\t{text}")
        parts.append(f"{utt}\t{part}")
        if n % 100 == 0:
            logger.info("synthesised %d/%d utterances", n, len(rows))
    (out / "metadata.tsv").write_text("\n".join(meta) + "\n", encoding="utf-8")
    (out / "parts.tsv").write_text("\n".join(parts) + "\n", encoding="utf-8")
    plan_file.write_text(planned, encoding="utf-8")
    counts = {p: sum(1 for r in rows if r[1] == p) for p in ("train", "dev", "test")}
    logger.info("corpus %s: %s utterances; training voices %s, held-out voices %s", out, counts,
                [v.speaker for v in training_voices(args.train_voices)], [v.speaker for v in HELD_OUT_VOICES])


def manifests(args) -> None:
    from lhotse import RecordingSet, SupervisionSet

    from valle.data.tiny import make_manifests

    out = Path(args.output_dir)
    make_manifests(args.corpus_dir, out, args.prefix)
    part_of = dict(line.split("\t") for line in
                   (Path(args.corpus_dir) / "parts.tsv").read_text(encoding="utf-8").splitlines() if line)
    recs = RecordingSet.from_file(out / f"{args.prefix}_recordings_all.jsonl.gz")
    sups = SupervisionSet.from_file(out / f"{args.prefix}_supervisions_all.jsonl.gz")
    for part in ("train", "dev", "test"):
        recs.filter(lambda r, p=part: part_of[r.id] == p).to_file(out / f"{args.prefix}_recordings_{part}.jsonl.gz")
        sups.filter(lambda s, p=part: part_of[s.recording_id] == p).to_file(
            out / f"{args.prefix}_supervisions_{part}.jsonl.gz")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth")
    s.add_argument("--sentences", required=True)
    s.add_argument("--out-dir", required=True)
    s.add_argument("--num-dev", type=int, default=16)
    s.add_argument("--num-test", type=int, default=16)
    s.add_argument("--voices-per-sentence", type=int, default=1)
    s.add_argument("--limit", type=int, default=None, help="at most N natural training sentences")
    s.add_argument("--generated", type=int, default=0, help="add N generated training sentences")
    s.add_argument("--train-voices", type=int, default=len(TRAIN_VOICES),
                   help=f"training voices (up to {len(TRAIN_VOICES) + len(MORE_TRAIN_VOICES)})")
    s.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("manifests")
    m.add_argument("--corpus-dir", required=True)
    m.add_argument("--output-dir", required=True)
    m.add_argument("--prefix", default="tiny")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    synth(args) if args.cmd == "synth" else manifests(args)


if __name__ == "__main__":
    main()

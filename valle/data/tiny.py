"""A tiny multi-speaker corpus synthesised locally with eSpeak NG (no network).

eSpeak NG is driven through its C API (ctypes on espeakng-loader's libespeak-ng.so):
synchronous output, a callback collecting int16 samples, one voice variant per
speaker. Used by egs/tiny/prepare.sh, the demo and the tests.

CLI: python -m valle.data.tiny {synth,manifests,split} ...
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

AUDIO_OUTPUT_SYNCHRONOUS = 2
ESPEAK_CHARS_UTF8 = 1
POS_CHARACTER = 1
ESPEAK_RATE, ESPEAK_VOLUME, ESPEAK_PITCH, ESPEAK_RANGE = 1, 2, 3, 4
LANGUAGE = "en-us"


@dataclass(frozen=True)
class Voice:
    speaker: str
    name: str  # espeak voice + variant, e.g. "en-us+f3"
    rate: int  # words per minute
    pitch: int  # 0..100
    pitch_range: int = 50
    language: str = LANGUAGE  # the supervision language written to the manifests


VOICES: tuple[Voice, ...] = (
    Voice("spk_f3", "en-us+f3", rate=170, pitch=60),
    Voice("spk_m1", "en-us+m1", rate=180, pitch=40),
    Voice("spk_m3", "en+m3", rate=160, pitch=45, pitch_range=70),
    Voice("spk_f4", "en-us+f4", rate=190, pitch=70, pitch_range=30),
)

# The bilingual corpus (VALL-E X, egs/tiny/prepare.sh --bilingual true): two English voices of
# VOICES and two of eSpeak NG's Mandarin voice, each language's sentences dealt over its voices.
MANDARIN = "cmn"
BILINGUAL_VOICES: dict[str, tuple[Voice, ...]] = {
    LANGUAGE: VOICES[:2],
    MANDARIN: (Voice("zh_f3", "cmn+f3", rate=150, pitch=65, language=MANDARIN),
               Voice("zh_m1", "cmn+m1", rate=145, pitch=40, language=MANDARIN)),
}

# espeak keeps one synthesiser per process (voice, parameters, callback are global state).
_LOCK = threading.Lock()
_SynthCallback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class EspeakSynth:
    """Process-wide espeak synthesiser; every call holds the module lock."""

    _instance: EspeakSynth | None = None

    def __init__(self) -> None:
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        data_dir = Path(espeakng_loader.get_data_path())
        lib = self.lib
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        # The path argument is the directory that *contains* espeak-ng-data.
        rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, str(data_dir.parent).encode(), 0)
        if rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed (data {data_dir})")
        self.sample_rate = rate
        self.data_dir = data_dir
        self._chunks: list[np.ndarray] = []
        # Keep a reference: ctypes callbacks are freed when garbage collected.
        self._callback = _SynthCallback(self._on_samples)
        lib.espeak_SetSynthCallback(self._callback)

    @classmethod
    def get(cls) -> EspeakSynth:
        with _LOCK:
            if cls._instance is None:
                cls._instance = EspeakSynth()
            return cls._instance

    def _on_samples(self, wav, numsamples, events) -> int:
        if numsamples > 0 and wav:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(numsamples,)).copy())
        return 0  # 0 = continue synthesis

    def synthesize(self, text: str, voice: Voice) -> np.ndarray:
        """Return int16 samples at ``self.sample_rate`` for ``text`` spoken by ``voice``."""
        _, plus, variant = voice.name.partition("+")
        # eSpeak falls back to the plain voice for a variant it lacks, without an error.
        if plus and not (self.data_dir / "voices" / "!v" / variant).is_file():
            raise ValueError(f"espeak has no voice variant {variant!r} ({voice.name!r})")
        with _LOCK:
            if self.lib.espeak_SetVoiceByName(voice.name.encode()) != 0:
                raise ValueError(f"espeak has no voice {voice.name!r}")
            self.lib.espeak_SetParameter(ESPEAK_RATE, voice.rate, 0)
            self.lib.espeak_SetParameter(ESPEAK_PITCH, voice.pitch, 0)
            self.lib.espeak_SetParameter(ESPEAK_RANGE, voice.pitch_range, 0)
            self._chunks = []
            data = text.encode("utf-8") + b"\0"
            err = self.lib.espeak_Synth(data, len(data), 0, POS_CHARACTER, 0, ESPEAK_CHARS_UTF8, None, None)
            if err != 0:
                raise RuntimeError(f"espeak_Synth failed ({err}) on {text!r}")
            chunks, self._chunks = self._chunks, []
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)


def trim_silence(samples: np.ndarray, sample_rate: int, keep_s: float = 0.05) -> np.ndarray:
    """Drop espeak's trailing/leading silence, keeping a short margin."""
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > 200)
    if loud.size == 0:
        return samples
    keep = int(keep_s * sample_rate)
    return samples[max(0, loud[0] - keep) : loud[-1] + keep]


def read_sentences(path: str | Path) -> list[str]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]


def synthesize_corpus(
    sentences: Sequence[str],
    out_dir: str | Path,
    voices: Sequence[Voice] = VOICES,
    limit: int | None = None,
) -> Path:
    """Write ``wavs/<speaker>/<utt>.wav`` and ``metadata.tsv`` (utt, speaker, wav, text, language).
    Sentence i goes to voice i % len(voices) so every speaker gets a share of the text list."""
    sentences = sentences[:limit] if limit else sentences
    return synthesize_items([(text, voices[i % len(voices)]) for i, text in enumerate(sentences)], out_dir)


def bilingual_items(sentences: dict[str, Sequence[str]], limit: int | None = None,
                    voices: dict[str, Sequence[Voice]] = BILINGUAL_VOICES) -> list[tuple[str, Voice]]:
    """(text, voice) pairs of a multilingual corpus: the first ``limit`` sentences of each
    language, sentence i in voice i % (that language's voices), languages one after another."""
    items = []
    for language, texts in sentences.items():
        own = voices[language]
        items += [(text, own[i % len(own)]) for i, text in enumerate(texts[:limit] if limit else texts)]
    return items


def synthesize_items(items: Sequence[tuple[str, Voice]], out_dir: str | Path) -> Path:
    """(text, voice) pairs -> wavs and ``metadata.tsv``; utterance i is ``<speaker>_<i:04d>``.
    Voices of several languages make a multilingual corpus (VALL-E X)."""
    import soundfile as sf

    out_dir = Path(out_dir)
    synth = EspeakSynth.get()
    rows = []
    for i, (text, voice) in enumerate(items):
        utt = f"{voice.speaker}_{i:04d}"
        wav_path = out_dir / "wavs" / voice.speaker / f"{utt}.wav"
        wav_path.parent.mkdir(parents=True, exist_ok=True)
        samples = trim_silence(synth.synthesize(text, voice), synth.sample_rate)
        sf.write(wav_path, samples, synth.sample_rate, subtype="PCM_16")
        rows.append(f"{utt}\t{voice.speaker}\t{wav_path.relative_to(out_dir)}\t{text}\t{voice.language}")
    meta = out_dir / "metadata.tsv"
    tmp = meta.with_suffix(".tmp")
    tmp.write_text("\n".join(rows) + "\n", encoding="utf-8")
    tmp.replace(meta)
    logger.info("synthesised %d utterances, %d voices, into %s", len(rows),
                len({v.speaker for _, v in items}), out_dir)
    return meta


def make_manifests(corpus_dir: str | Path, output_dir: str | Path, prefix: str = "tiny") -> None:
    """metadata.tsv -> {prefix}_recordings_all.jsonl.gz and {prefix}_supervisions_all.jsonl.gz.
    A fifth column (language) is optional: without it the supervision language is en-us."""
    from lhotse import Recording, RecordingSet, SupervisionSegment, SupervisionSet

    corpus_dir, output_dir = Path(corpus_dir), Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    recordings, supervisions = [], []
    for line in (corpus_dir / "metadata.tsv").read_text(encoding="utf-8").splitlines():
        utt, speaker, rel, text, *rest = line.split("\t")
        rec = Recording.from_file(corpus_dir / rel, recording_id=utt)
        recordings.append(rec)
        supervisions.append(
            SupervisionSegment(
                id=utt, recording_id=utt, start=0.0, duration=rec.duration, channel=0,
                text=text, speaker=speaker, language=rest[0] if rest else LANGUAGE,
            )
        )
    RecordingSet.from_recordings(recordings).to_file(output_dir / f"{prefix}_recordings_all.jsonl.gz")
    SupervisionSet.from_segments(supervisions).to_file(output_dir / f"{prefix}_supervisions_all.jsonl.gz")


def split_cuts(
    cuts_path: str | Path, output_dir: str | Path, prefix: str = "tiny",
    dev_frac: float = 0.08, test_frac: float = 0.08, seed: int = 0,
) -> dict[str, int]:
    """Split per speaker (every speaker in every part, so prompts exist everywhere). Each part
    gets its extremes record too, as bin/tokenizer.py writes one per part it tokenizes."""
    from lhotse import CutSet

    from valle.data.extremes import Extremes, extremes_path

    cuts = CutSet.from_file(cuts_path)
    by_speaker: dict[str, list[str]] = {}
    for cut in cuts:
        by_speaker.setdefault(cut.supervisions[0].speaker, []).append(cut.id)
    parts: dict[str, set[str]] = {"train": set(), "dev": set(), "test": set()}
    rng = random.Random(seed)
    for spk in sorted(by_speaker):
        ids = sorted(by_speaker[spk])
        rng.shuffle(ids)
        n_dev = max(1, round(dev_frac * len(ids)))
        n_test = max(1, round(test_frac * len(ids)))
        parts["dev"].update(ids[:n_dev])
        parts["test"].update(ids[n_dev : n_dev + n_test])
        parts["train"].update(ids[n_dev + n_test :])
    counts = {}
    for name, ids in parts.items():
        subset = CutSet.from_cuts(c for c in cuts if c.id in ids)
        subset.to_file(Path(output_dir) / f"{prefix}_cuts_{name}.jsonl.gz")
        Extremes.of(subset).write(extremes_path(Path(output_dir), prefix, name))
        counts[name] = len(subset)
    return counts


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m valle.data.tiny", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth", help="synthesise wavs + metadata.tsv")
    s.add_argument("--sentences", required=True)
    s.add_argument("--out-dir", required=True)
    s.add_argument("--limit", type=int, default=None,
                   help="use only the first N sentences (of each language with --zh-sentences)")
    s.add_argument("--zh-sentences", default=None,
                   help="Mandarin sentences: a bilingual corpus (English and Mandarin voices, VALL-E X)")
    m = sub.add_parser("manifests", help="lhotse RecordingSet/SupervisionSet")
    m.add_argument("--corpus-dir", required=True)
    m.add_argument("--output-dir", required=True)
    m.add_argument("--prefix", default="tiny")
    sp = sub.add_parser("split", help="split tokenized cuts into train/dev/test per speaker")
    sp.add_argument("--cuts", required=True)
    sp.add_argument("--output-dir", required=True)
    sp.add_argument("--prefix", default="tiny")
    sp.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "synth" and args.zh_sentences:
        texts = {LANGUAGE: read_sentences(args.sentences), MANDARIN: read_sentences(args.zh_sentences)}
        synthesize_items(bilingual_items(texts, args.limit), args.out_dir)
    elif args.cmd == "synth":
        synthesize_corpus(read_sentences(args.sentences), args.out_dir, limit=args.limit)
    elif args.cmd == "manifests":
        make_manifests(args.corpus_dir, args.output_dir, args.prefix)
    else:
        counts = split_cuts(args.cuts, args.output_dir, args.prefix, seed=args.seed)
        logger.info("split: %s", counts)


if __name__ == "__main__":
    main()

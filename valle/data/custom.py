"""Your own corpus -> lhotse manifests (egs/custom/prepare.sh): transcript layouts, speakers,
languages, an energy VAD that cuts long recordings at their longest silences, the held-out split.

Layouts (``--layout auto`` picks the first whose file is there):

* ``kaldi``: ``wav.scp`` (``utt path``) + ``text`` (``utt words...``), optional ``utt2spk``; with
  a ``segments`` file (``utt recording start end``) ``wav.scp`` lists recordings and each
  segment is an utterance with its own transcript (how a long recording is transcribed);
* ``ljspeech``: ``metadata.csv`` (``id|text`` or ``id|text|normalized``), audio in ``wavs/``;
* ``sidecar``: every audio file with a ``.txt`` or ``.lab`` of the same name beside it.

An audio file no transcript names is kept for Whisper (stage 1, egs/custom/local/transcribe.py)
and reported as ``no_transcript`` until it is transcribed. Speakers: ``utt2spk``, else the first
folder under the corpus (a top ``wavs``/``wav``/``audio`` folder skipped), else the corpus
folder's name. Languages: ``--language``, per speaker from ``--speaker-languages`` (default: the
corpus's ``spk2lang`` or ``speakers.tsv``). Every bad file is one line of the bad-items report.

CLI: python -m valle.data.custom {manifests,split} ...
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from valle.data import validation as V
from valle.data.manifests import END_TOLERANCE_S

logger = logging.getLogger(__name__)

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".sph")
TRANSCRIPT_SUFFIXES = (".txt", ".lab")
AUDIO_FOLDERS = {"wavs", "wav", "audio"}  # a corpus's audio folder is not a speaker
SPEAKER_LANGUAGE_FILES = ("spk2lang", "speakers.tsv")
LAYOUTS = ("auto", "kaldi", "ljspeech", "sidecar")
# Reasons of this stage (the tokenizer's are in valle/data/validation.py).
NO_TRANSCRIPT = "no_transcript"
SILENT_AUDIO = "silent_audio"
VAD_RATE = 16_000  # the VAD reads audio at this rate: energy needs no more


class CorpusError(ValueError):
    """The corpus as a whole cannot be read (no layout, a bad flag or file): one line naming it."""


@dataclass
class SpanUtterance:
    """A span of a recording with its own transcript (a line of Kaldi's ``segments``)."""

    utt_id: str
    start: float
    end: float
    speaker: str
    text: str | None  # None: no line in ``text``


@dataclass
class SourceItem:
    """One audio file of the corpus and what its layout says about it."""

    utt_id: str  # the recording id too
    audio: Path
    speaker: str
    text: str | None = None  # None: no transcript (Whisper may give one)
    normalized: str | None = None  # LJSpeech's third column: the text as spoken
    spans: list[SpanUtterance] | None = None  # Kaldi segments: the utterances, each transcribed


@dataclass
class Segment:
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class VadConfig:
    """Energy VAD: a frame is speech when it is within ``range_db`` of the loud frames (their
    99th percentile) and above ``floor_db`` (dBFS); silences shorter than ``min_silence_s``
    are pauses inside speech, not places to cut."""

    frame_s: float = 0.025
    hop_s: float = 0.010
    range_db: float = 35.0
    floor_db: float = -55.0
    min_silence_s: float = 0.25
    margin_s: float = 0.10  # silence kept at each side of a cut


@dataclass
class PrepareConfig:
    corpus_dir: Path
    output_dir: Path
    prefix: str = "custom"
    layout: str = "auto"
    language: str = "en-us"
    speaker_languages: Path | None = None
    max_segment_duration: float = 14.0
    min_duration: float = 0.5
    vad: VadConfig = field(default_factory=VadConfig)


# ----------------------------------------------------------------------------- layouts
def list_audio(corpus_dir: Path) -> list[Path]:
    return sorted(p for p in corpus_dir.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())


def relative_parts(corpus_dir: Path, audio: Path) -> list[str]:
    """The file's folders under the corpus, a top audio folder (``wavs/``) left out."""
    try:
        parts = list(audio.relative_to(corpus_dir).parent.parts)
    except ValueError:  # a wav.scp path outside the corpus: only its own folder says anything
        parts = [audio.parent.name]
    return parts[1:] if parts and parts[0].lower() in AUDIO_FOLDERS else parts


def speaker_from_path(corpus_dir: Path, audio: Path) -> str:
    parts = relative_parts(corpus_dir, audio)
    return parts[0] if parts else corpus_dir.resolve().name


def utt_id_from_path(corpus_dir: Path, audio: Path) -> str:
    return "_".join([*relative_parts(corpus_dir, audio), audio.stem])


def read_lines(path: Path) -> list[str]:
    """A corpus-wide file's lines (metadata.csv, Kaldi tables): one it cannot read stops all."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 ({e.reason} at byte {e.start}); convert it") from None


def read_text_file(path: Path) -> str:
    return " ".join(path.read_text(encoding="utf-8").split())


def detect_layout(corpus_dir: Path) -> str:
    if (corpus_dir / "wav.scp").is_file():
        return "kaldi"
    if (corpus_dir / "metadata.csv").is_file():
        return "ljspeech"
    return "sidecar"


def read_sidecar(corpus_dir: Path, report: V.ValidationReport) -> list[SourceItem]:
    """Every audio file; its transcript is the ``.txt``/``.lab`` of the same name, if any."""
    items = []
    for audio in list_audio(corpus_dir):
        item = SourceItem(utt_id_from_path(corpus_dir, audio), audio, speaker_from_path(corpus_dir, audio))
        transcript = next((audio.with_suffix(x) for x in TRANSCRIPT_SUFFIXES if audio.with_suffix(x).is_file()), None)
        try:
            item.text = read_text_file(transcript) if transcript else None
        except UnicodeDecodeError as e:  # not guessed at: another encoding would phonemize garbage
            report.add(item.utt_id, V.BAD_MANIFEST_ITEM, f"{transcript}: not UTF-8 ({e.reason} at byte {e.start})")
            continue
        items.append(item)
    return items


def read_ljspeech(corpus_dir: Path, report: V.ValidationReport) -> list[SourceItem]:
    """``metadata.csv`` rows; audio files it does not name are kept without a transcript."""
    by_id = {utt_id_from_path(corpus_dir, a): a for a in list_audio(corpus_dir)}
    items, listed = [], set()
    lines = read_lines(corpus_dir / "metadata.csv")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split("|")
        utt_id = fields[0].strip()
        if len(fields) < 2:
            report.add(utt_id or f"metadata.csv:{lineno}", V.BAD_MANIFEST_ITEM,
                       f"metadata.csv:{lineno}: expected id|text or id|text|normalized")
            continue
        audio = by_id.get(utt_id)
        if audio is None:
            report.add(utt_id, V.NO_RECORDING, f"metadata.csv:{lineno}: no audio file {utt_id}.* "
                                               f"in {corpus_dir} or its wavs/")
            continue
        listed.add(utt_id)
        normalized = fields[2].strip() if len(fields) > 2 and fields[2].strip() else None
        items.append(SourceItem(utt_id, audio, speaker_from_path(corpus_dir, audio), fields[1].strip(),
                                normalized))
    items += [SourceItem(u, a, speaker_from_path(corpus_dir, a)) for u, a in by_id.items() if u not in listed]
    return items


def read_kaldi_table(path: Path) -> dict[str, str]:
    """``key rest-of-line`` per line (Kaldi's text tables); the first of repeated keys kept."""
    table: dict[str, str] = {}
    for line in read_lines(path):
        key, _, value = line.strip().partition(" ")
        if key:
            table.setdefault(key, value.strip())
    return table


def read_kaldi_spans(corpus_dir: Path, texts: dict[str, str], spk: dict[str, str],
                     report: V.ValidationReport) -> dict[str, list[SpanUtterance]]:
    """Kaldi's ``segments`` (``utt recording start end``): recording id -> its utterances."""
    spans: dict[str, list[SpanUtterance]] = {}
    for lineno, line in enumerate(read_lines(corpus_dir / "segments"), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            utt_id, rec_id, start, end = fields[0], fields[1], float(fields[2]), float(fields[3])
        except (IndexError, ValueError):
            report.add(fields[0], V.BAD_MANIFEST_ITEM, f"segments:{lineno}: expected 'utt recording start end'")
            continue
        spans.setdefault(rec_id, []).append(SpanUtterance(utt_id, start, end, spk.get(utt_id, ""), texts.get(utt_id)))
    return spans


def read_kaldi(corpus_dir: Path, report: V.ValidationReport) -> list[SourceItem]:
    """``wav.scp`` + ``text`` (+ ``utt2spk``, ``segments``); paths relative to the corpus folder."""
    wavs = read_kaldi_table(corpus_dir / "wav.scp")
    texts = read_kaldi_table(corpus_dir / "text") if (corpus_dir / "text").is_file() else {}
    spk = read_kaldi_table(corpus_dir / "utt2spk") if (corpus_dir / "utt2spk").is_file() else {}
    spans = read_kaldi_spans(corpus_dir, texts, spk, report) if (corpus_dir / "segments").is_file() else None
    items = []
    for rec_id, where in wavs.items():
        if where.endswith("|"):
            report.add(rec_id, V.UNREADABLE_AUDIO, "wav.scp: piped commands are not run; "
                                                   "write the audio to a file and list its path")
            continue
        audio = Path(where) if Path(where).is_absolute() else corpus_dir / where
        item = SourceItem(rec_id, audio, spk.get(rec_id) or speaker_from_path(corpus_dir, audio))
        if spans is None:
            item.text = texts.get(rec_id)
        else:
            item.spans = spans.get(rec_id, [])
            for span in item.spans:
                span.speaker = span.speaker or item.speaker
        items.append(item)
    utterances = texts.keys() if spans is None else {s.utt_id for ss in spans.values() for s in ss}
    for utt_id in sorted(set(texts) - (wavs.keys() if spans is None else utterances)):
        report.add(utt_id, V.NO_RECORDING, "in text but not in " + ("wav.scp" if spans is None else "segments"))
    for rec_id in sorted(set(spans or {}) - wavs.keys()):
        for span in spans[rec_id]:
            report.add(span.utt_id, V.NO_RECORDING, f"segments: recording {rec_id} is not in wav.scp")
    return items


READERS: dict[str, Callable[[Path, V.ValidationReport], list[SourceItem]]] = {
    "kaldi": read_kaldi, "ljspeech": read_ljspeech, "sidecar": read_sidecar}


def read_corpus(corpus_dir: Path, layout: str, report: V.ValidationReport) -> tuple[str, list[SourceItem]]:
    """(the layout read, its items); repeated utterance ids are reported, the first kept."""
    if not corpus_dir.is_dir():
        raise CorpusError(f"--corpus-dir {corpus_dir}: no such folder")
    if layout not in LAYOUTS:
        raise CorpusError(f"--layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    layout = detect_layout(corpus_dir) if layout == "auto" else layout
    items, seen = [], set()
    for item in READERS[layout](corpus_dir, report):
        if item.utt_id in seen:
            report.add(item.utt_id, V.DUPLICATE_ID, f"{item.audio}: another file has this id (the first is kept)")
            continue
        seen.add(item.utt_id)
        items.append(item)
    return layout, items


# ----------------------------------------------------------------------------- languages
def find_speaker_languages(corpus_dir: Path, path: Path | None) -> Path | None:
    if path is not None:
        if not path.is_file():
            raise CorpusError(f"--speaker-languages {path}: no such file")
        return path
    found = [corpus_dir / name for name in SPEAKER_LANGUAGE_FILES if (corpus_dir / name).is_file()]
    return found[0] if found else None


def read_speaker_languages(path: Path | None) -> dict[str, str]:
    """``speaker language`` per line (tab or spaces; ``#`` comments; a ``speaker`` header
    skipped); every language must name an espeak voice (the line is named if not)."""
    from valle.data.languages import UnknownLanguageError, espeak_voice

    if path is None:
        return {}
    languages = {}
    for lineno, line in enumerate(read_lines(path), 1):
        fields = line.split("#")[0].split()
        if not fields or (lineno == 1 and fields[0].lower() == "speaker"):
            continue
        if len(fields) < 2:
            raise CorpusError(f"{path}:{lineno}: expected 'speaker language'")
        try:
            espeak_voice(fields[1])
        except UnknownLanguageError as e:
            raise CorpusError(f"{path}:{lineno}: speaker {fields[0]}: {e}") from None
        languages[fields[0]] = fields[1]
    return languages


# ----------------------------------------------------------------------------- VAD, segmentation
def frame_levels_db(samples: np.ndarray, sample_rate: int, vad: VadConfig) -> np.ndarray:
    """RMS level (dBFS) of each hop-spaced frame."""
    frame, hop = max(1, round(vad.frame_s * sample_rate)), max(1, round(vad.hop_s * sample_rate))
    if samples.size < frame:
        samples = np.pad(samples, (0, frame - samples.size))
    count = 1 + (samples.size - frame) // hop
    windows = np.lib.stride_tricks.as_strided(
        samples, shape=(count, frame), strides=(samples.strides[0] * hop, samples.strides[0]), writeable=False)
    power = np.mean(np.square(windows, dtype=np.float64), axis=1)
    return 10.0 * np.log10(power + 1e-12)


def speech_frames(levels_db: np.ndarray, vad: VadConfig) -> np.ndarray:
    loud = np.percentile(levels_db, 99)
    return levels_db > max(loud - vad.range_db, vad.floor_db)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index runs where ``mask`` is true."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def speech_and_silences(samples: np.ndarray, sample_rate: int,
                        vad: VadConfig) -> tuple[Segment | None, list[Segment]]:
    """The span from the first to the last speech frame (None: no speech at all) and the
    silences inside it that are long enough to cut at, in seconds."""
    speech = speech_frames(frame_levels_db(samples, sample_rate, vad), vad)
    if not speech.any():
        return None, []
    first, last = int(np.argmax(speech)), len(speech) - 1 - int(np.argmax(speech[::-1]))
    span = Segment(first * vad.hop_s, min(samples.size / sample_rate, last * vad.hop_s + vad.frame_s))
    min_frames = math.ceil(vad.min_silence_s / vad.hop_s)
    silences = [Segment(s * vad.hop_s + vad.frame_s, e * vad.hop_s)
                for s, e in runs(~speech[first:last + 1]) if e - s >= min_frames]
    return span, [Segment(s.start + span.start, s.end + span.start) for s in silences if s.end > s.start]


def split_at_silences(piece: Segment, silences: Sequence[Segment], max_duration: float,
                      margin: float) -> list[Segment]:
    """Cut ``piece`` at its longest silence, recursively, until no part is longer than
    ``max_duration``; a part with no silence left to cut at stays longer (the caller reports it)."""
    if piece.duration <= max_duration:
        return [piece]
    inside = [s for s in silences if s.start > piece.start and s.end < piece.end]
    if not inside:
        return [piece]
    cut = max(inside, key=lambda s: (s.duration, -s.start))
    keep = min(margin, cut.duration / 2)
    left = Segment(piece.start, cut.start + keep)
    right = Segment(cut.end - keep, piece.end)
    return (split_at_silences(left, silences, max_duration, margin)
            + split_at_silences(right, silences, max_duration, margin))


def load_for_vad(audio: Path) -> tuple[object, np.ndarray]:
    """The lhotse Recording of a file and its channels' mean at ``VAD_RATE``: what is
    tokenized (a stereo file's cuts span both channels, and bin/tokenizer.py averages them)."""
    from lhotse import Recording

    from valle.codec.audio import use_torch_resampling_in_lhotse

    use_torch_resampling_in_lhotse()  # the same cut boundaries with or without torchaudio
    recording = Recording.from_file(audio)
    samples = np.asarray(recording.resample(VAD_RATE).load_audio(), dtype=np.float32)
    return recording, samples.mean(axis=0)


def all_channels(recording) -> int | list[int]:
    """A supervision's channel that covers every channel of ``recording``: a stereo file's
    speech is said on both, and its cuts load both (bin/tokenizer.py downmixes them to their
    mean) rather than channel 0 alone, which may be the quieter or an empty one."""
    channels = list(recording.channel_ids)
    return channels if len(channels) > 1 else channels[0]


# ----------------------------------------------------------------------------- one file
@dataclass
class PreparedItem:
    """What one source file becomes: its recording and one supervision per segment (text
    None: waiting for a transcript)."""

    recording: object
    supervisions: list = field(default_factory=list)


def segments_of(item: SourceItem, duration: float, samples: np.ndarray, cfg: PrepareConfig,
                report: V.ValidationReport) -> list[tuple[str, Segment]]:
    """(id, span) of the utterances of one file: the whole file when short enough, else (only
    without a transcript) its pieces cut at silences, ``<id>-000``, ``<id>-001``, ... in time
    order. Each problem is reported by the id of what it concerns."""
    span, silences = speech_and_silences(samples, VAD_RATE, cfg.vad)
    if span is None:
        report.add(item.utt_id, SILENT_AUDIO, f"{item.audio}: no frame above {cfg.vad.floor_db:g} dBFS")
        return []
    if duration <= cfg.max_segment_duration:
        return [(item.utt_id, Segment(0.0, duration))]
    if item.text is not None:
        report.add(item.utt_id, V.TOO_LONG, (
            f"{item.audio}: {duration:.1f}s with one transcript > --max-segment-duration "
            f"{cfg.max_segment_duration:g}: it cannot be cut without an alignment; split the file, "
            "or remove its transcript so Whisper transcribes each piece"))
        return []
    whole = Segment(max(0.0, span.start - cfg.vad.margin_s), min(duration, span.end + cfg.vad.margin_s))
    pieces = []
    for k, piece in enumerate(split_at_silences(whole, silences, cfg.max_segment_duration, cfg.vad.margin_s)):
        piece_id = f"{item.utt_id}-{k:03d}"
        if piece.duration > cfg.max_segment_duration:
            report.add(piece_id, V.TOO_LONG, (
                f"{item.audio} {piece.start:.2f}-{piece.end:.2f}s: no silence of {cfg.vad.min_silence_s:g}s "
                f"to cut at, {piece.duration:.1f}s > --max-segment-duration {cfg.max_segment_duration:g}"))
        elif piece.duration < cfg.min_duration:
            report.add(piece_id, V.TOO_SHORT, (
                f"{item.audio} {piece.start:.2f}-{piece.end:.2f}s: {piece.duration:.2f}s < "
                f"--min-duration {cfg.min_duration:g}"))
        else:
            pieces.append((piece_id, piece))
    return pieces


def checked_spans(item: SourceItem, duration: float, cfg: PrepareConfig,
                  report: V.ValidationReport) -> list[tuple[str, Segment, str, str | None]]:
    """Kaldi segments of one recording that are usable as they are: (id, span, speaker, text)."""
    out = []
    for span in item.spans or []:
        where = f"{item.audio} {span.start:.2f}-{span.end:.2f}s"
        piece = Segment(span.start, min(span.end, duration))
        if span.start < 0 or span.end <= span.start or span.end > duration + END_TOLERANCE_S:
            report.add(span.utt_id, V.BAD_SEGMENT, f"{where}: outside the recording ({duration:.2f}s)")
        elif piece.duration > cfg.max_segment_duration:
            report.add(span.utt_id, V.TOO_LONG, f"{where}: {piece.duration:.1f}s > --max-segment-duration "
                                                f"{cfg.max_segment_duration:g}")
        elif piece.duration < cfg.min_duration:
            report.add(span.utt_id, V.TOO_SHORT, f"{where}: {piece.duration:.2f}s < --min-duration {cfg.min_duration:g}")
        elif span.text is not None and not span.text.strip():
            report.add(span.utt_id, V.EMPTY_TEXT, f"{where}: its transcript is empty")
        else:
            out.append((span.utt_id, piece, span.speaker, span.text))
    return out


def utterances_of(item: SourceItem, recording, samples: np.ndarray, cfg: PrepareConfig,
                  report: V.ValidationReport) -> list[tuple[str, Segment, str, str | None]]:
    """(id, span, speaker, text) of each utterance one file holds."""
    if item.spans is not None:
        if speech_and_silences(samples, VAD_RATE, cfg.vad)[0] is None:
            report.add(item.utt_id, SILENT_AUDIO, f"{item.audio}: no frame above {cfg.vad.floor_db:g} dBFS")
            return []
        return checked_spans(item, recording.duration, cfg, report)
    return [(utt_id, piece, item.speaker, item.text)
            for utt_id, piece in segments_of(item, recording.duration, samples, cfg, report)]


def prepare_item(item: SourceItem, language_of: Callable[[str], str], cfg: PrepareConfig,
                 report: V.ValidationReport) -> PreparedItem | None:
    """Read, check and segment one file; None (reported) when nothing of it is usable.
    ``language_of(speaker)`` is the language of a speaker's utterances."""
    from lhotse import SupervisionSegment
    from lhotse.utils import fastcopy

    try:
        recording, samples = load_for_vad(item.audio)
    except Exception as e:  # lhotse, soundfile and audioread raise many types on bad files
        report.add(item.utt_id, V.UNREADABLE_AUDIO, f"{item.audio}: {type(e).__name__}: {e}"[:300])
        return None
    recording = fastcopy(recording, id=item.utt_id)
    if recording.duration < cfg.min_duration:
        report.add(item.utt_id, V.TOO_SHORT, f"{item.audio}: {recording.duration:.2f}s < --min-duration "
                                             f"{cfg.min_duration:g}")
        return None
    if item.text is not None and not item.text.strip():
        report.add(item.utt_id, V.EMPTY_TEXT, f"{item.audio}: its transcript is empty")
        return None
    custom = {"normalized_text": item.normalized} if item.normalized else None
    sups = [SupervisionSegment(id=utt_id, recording_id=item.utt_id, start=round(p.start, 3),
                               duration=round(p.duration, 3), channel=all_channels(recording), text=text, speaker=speaker,
                               language=language_of(speaker), custom=custom)
            for utt_id, p, speaker, text in utterances_of(item, recording, samples, cfg, report)]
    return PreparedItem(recording, sups) if sups else None


# ----------------------------------------------------------------------------- the corpus
def manifest_paths(output_dir: Path, prefix: str) -> dict[str, Path]:
    return {"recordings": output_dir / f"{prefix}_recordings_all.jsonl.gz",
            "supervisions": output_dir / f"{prefix}_supervisions_all.jsonl.gz",
            "pending": output_dir / f"{prefix}_untranscribed_all.jsonl.gz",
            "report": output_dir / f"{prefix}_bad_items.tsv"}


def write_jsonl(path: Path, items: Sequence[dict]) -> None:
    """A ``.jsonl.gz`` written under a temporary name, then renamed into place."""
    import gzip
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp." + path.name)
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in items)
    os.replace(tmp, path)


def report_untranscribed(pending: Sequence[dict], report: V.ValidationReport, why: str) -> None:
    for entry in pending:
        sup = entry["supervision"]
        where = f"{entry['recording']['sources'][0]['source']} {sup['start']:.2f}-{sup['start'] + sup['duration']:.2f}s"
        report.add(sup["id"], NO_TRANSCRIPT, f"{where}: {why}")


def prepare_corpus(cfg: PrepareConfig) -> V.ValidationReport:
    """The corpus -> recordings + supervisions of transcribed utterances, the untranscribed
    ones (for Whisper), and the bad-items report; returns the report."""
    from tqdm import tqdm

    report = V.ValidationReport()
    layout, items = read_corpus(cfg.corpus_dir, cfg.layout, report)
    if not items:
        raise CorpusError(f"--corpus-dir {cfg.corpus_dir}: no audio files found ({layout} layout; "
                          f"audio is {', '.join(AUDIO_SUFFIXES)})")
    languages = read_speaker_languages(find_speaker_languages(cfg.corpus_dir, cfg.speaker_languages))
    recordings, supervisions, pending = [], [], []
    for item in tqdm(items, desc=f"read {layout} corpus", unit="file"):
        report.checked += 1
        prepared = prepare_item(item, lambda speaker: languages.get(speaker, cfg.language), cfg, report)
        if prepared is None:
            continue
        rec = prepared.recording.to_dict()
        done = [s.to_dict() for s in prepared.supervisions if s.text is not None]
        pending += [{"recording": rec, "supervision": s.to_dict()} for s in prepared.supervisions if s.text is None]
        if done:
            recordings.append(rec)
            supervisions += done
    report_untranscribed(pending, report, "no transcript; stage 1 transcribes it where Whisper weights are present")
    paths = manifest_paths(cfg.output_dir, cfg.prefix)
    write_jsonl(paths["recordings"], recordings)
    write_jsonl(paths["supervisions"], supervisions)
    write_jsonl(paths["pending"], pending)
    report.write(paths["report"])
    logger.info("%s layout: %d files -> %d utterances with a transcript, %d without; %s",
                layout, len(items), len(supervisions), len(pending), report.summary())
    return report


# ----------------------------------------------------------------------------- transcription
def transcribe_pending(manifest_dir: Path, prefix: str, transcribe: Callable[[np.ndarray, int, str], str | None],
                       ) -> tuple[int, V.ValidationReport]:
    """Give the untranscribed utterances the text ``transcribe(samples, rate, language)``
    returns (None: it cannot, the item stays reported). Transcribed ones join the manifests
    and leave the report. Returns (how many were transcribed, the report)."""
    from lhotse import Recording
    from tqdm import tqdm

    from valle.data.manifests import read_jsonl

    paths = manifest_paths(manifest_dir, prefix)
    pending = list(read_jsonl(paths["pending"]))
    report = V.ValidationReport.read(paths["report"])
    waiting = {e["supervision"]["id"] for e in pending}
    kept = V.ValidationReport([e for e in report.entries if e.cut_id not in waiting], report.checked)
    recordings = {d["id"]: d for d in read_jsonl(paths["recordings"])}
    supervisions = list(read_jsonl(paths["supervisions"]))
    still = []
    for entry in tqdm(pending, desc="transcribe", unit="utt"):
        sup = entry["supervision"]
        samples = Recording.from_dict(entry["recording"]).load_audio(  # (channels, samples)
            channels=sup["channel"], offset=sup["start"], duration=sup["duration"]).mean(axis=0)
        text = transcribe(samples, entry["recording"]["sampling_rate"], sup.get("language") or "")
        if text is None:
            still.append(entry)
        elif not text.strip():
            kept.add(sup["id"], V.EMPTY_TEXT, "Whisper heard no words")
        else:
            supervisions.append(dict(sup, text=text.strip(), custom={**(sup.get("custom") or {}), "transcribed_by": "whisper"}))
            recordings.setdefault(entry["recording"]["id"], entry["recording"])
    report_untranscribed(still, kept, "no transcript; Whisper here transcribes English only")
    write_jsonl(paths["recordings"], list(recordings.values()))
    write_jsonl(paths["supervisions"], supervisions)
    write_jsonl(paths["pending"], still)
    kept.write(paths["report"])
    return len(pending) - len(still), kept


# ----------------------------------------------------------------------------- held-out split
def held_out_counts(sizes: dict[str, int], fraction: float, min_valid: int) -> dict[str, int]:
    """Utterances held out per speaker: ``fraction`` of each, rounded down, never a speaker's
    last one (every speaker stays in train); topped up to ``min_valid`` one at a time, to the
    speaker with fewest held out (then most utterances left), so the top-up spreads over speakers."""
    counts = {spk: min(n - 1, math.floor(fraction * n)) for spk, n in sizes.items()}
    while sum(counts.values()) < min_valid:
        spare = [spk for spk in sorted(sizes, key=lambda s: (counts[s], counts[s] - sizes[s], s))
                 if sizes[spk] - counts[spk] > 1]
        if not spare:
            break
        counts[spare[0]] += 1
    return counts


def split_held_out(cuts_path: Path, output_dir: Path, prefix: str, fraction: float = 0.05,
                   min_valid: int = 1, seed: int = 0) -> dict[str, int]:
    """Tokenized cuts -> ``{prefix}_cuts_train`` and ``{prefix}_cuts_dev``, by utterance, the
    same on every run: each speaker's utterances ordered by a hash of (seed, id), the first
    ones held out. Each part gets its extremes record, as bin/tokenizer.py writes one per part."""
    from lhotse import CutSet

    from valle.data.extremes import Extremes, extremes_path
    from valle.data.manifests import read_jsonl

    def key(cut_id: str) -> str:
        return hashlib.sha1(f"{seed}:{cut_id}".encode()).hexdigest()

    by_speaker: dict[str, list[str]] = {}
    for cut in read_jsonl(cuts_path):
        by_speaker.setdefault(cut["supervisions"][0].get("speaker") or "", []).append(cut["id"])
    counts = held_out_counts({s: len(ids) for s, ids in by_speaker.items()}, fraction, min_valid)
    dev = {i for spk, ids in by_speaker.items() for i in sorted(ids, key=key)[:counts[spk]]}
    if not dev:
        raise CorpusError(f"{cuts_path}: no speaker has 2 utterances, so none can be held out "
                          "with its speaker kept in train")
    parts: dict[str, list[dict]] = {"train": [], "dev": []}
    for cut in read_jsonl(cuts_path):
        parts["dev" if cut["id"] in dev else "train"].append(cut)
    for name, cuts in parts.items():
        write_jsonl(output_dir / f"{prefix}_cuts_{name}.jsonl.gz", cuts)
        Extremes.of(CutSet.from_dicts(cuts)).write(extremes_path(output_dir, prefix, name))
    return {name: len(cuts) for name, cuts in parts.items()}


# ----------------------------------------------------------------------------- CLI
def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m valle.data.custom", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifests", help="corpus folder -> lhotse recordings/supervisions + bad-items report")
    m.add_argument("--corpus-dir", type=Path, required=True)
    m.add_argument("--output-dir", type=Path, required=True)
    m.add_argument("--prefix", default="custom")
    m.add_argument("--layout", default="auto", choices=LAYOUTS)
    m.add_argument("--language", default="en-us", help="language of speakers --speaker-languages does not name")
    m.add_argument("--speaker-languages", type=Path, default=None,
                   help="'speaker language' per line (default: the corpus's spk2lang or speakers.tsv)")
    m.add_argument("--max-segment-duration", type=float, default=14.0,
                   help="longer untranscribed recordings are cut at silences into pieces at most this long")
    m.add_argument("--min-duration", type=float, default=0.5, help="shorter files and pieces are reported")
    s = sub.add_parser("split", help="tokenized cuts -> train + dev (held out by utterance)")
    s.add_argument("--cuts", type=Path, required=True)
    s.add_argument("--output-dir", type=Path, required=True)
    s.add_argument("--prefix", default="custom")
    s.add_argument("--valid-fraction", type=float, default=0.05)
    s.add_argument("--min-valid", type=int, default=1, help="hold out at least this many utterances")
    s.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    from valle.data.manifests import ManifestError

    args = get_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "manifests":
            cfg = PrepareConfig(args.corpus_dir, args.output_dir, args.prefix, args.layout, args.language,
                                args.speaker_languages, args.max_segment_duration, args.min_duration)
            report = prepare_corpus(cfg)
            for e in report.entries:
                print(f"left out {e.cut_id}: {e.reason} ({e.detail})")
            print(f"manifests: {report.summary()}; bad items in {manifest_paths(cfg.output_dir, cfg.prefix)['report']}")
        else:
            counts = split_held_out(args.cuts, args.output_dir, args.prefix, args.valid_fraction,
                                    args.min_valid, args.seed)
            print(f"split: {counts} -> {args.output_dir}")
    except (CorpusError, ManifestError) as e:
        print(f"python -m valle.data.custom: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

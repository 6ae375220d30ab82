"""Evaluate synthesised speech: what ``bin/evaluate.py`` runs (see docs/evaluation.md).

Per row (text, prompt wav, output wav[, ground-truth wav of the text in the prompt's voice]):
PER by the corpus's phoneme judge, speaker similarity of output and prompt, the output's
duration against the text (at the prompt's speaking rate, and against the ground truth when
given), whether decoding hit the length cap, and WER when Whisper's weights are present.
Aggregates, plus the same figures on the ground-truth audio (the judge's ceiling) and on the
codec's resynthesis of it (the ceiling a model of this codec can reach). Rows may name their
text's language (VALL-E X, cross-lingual items): each text is phonemized in its own language and
PER is also reported per language.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from valle.codec.constants import HOP_LENGTH, SAMPLE_RATE
from valle.eval.per import edit_distance, spoken

logger = logging.getLogger(__name__)

COLUMNS = ("prompt_text", "prompt_wav", "text", "out_wav", "ref_wav")
# Named in a header line only: the espeak language of the text and of the prompt's transcript
# (default: --language and --prompt-language).
LANGUAGE_COLUMNS = ("language", "prompt_language")


class EvalInputError(ValueError):
    """Bad input (missing file, malformed TSV): reported in one line naming the item."""


@dataclass
class Row:
    name: str
    text: str
    prompt_wav: str
    out_wav: str
    prompt_text: str = ""
    ref_wav: str | None = None
    language: str = ""  # espeak language of text ("": the run's --language)
    prompt_language: str = ""  # of prompt_text ("": --prompt-language, else the text's)


@dataclass
class Scores:
    """Per-row figures for one kind of audio (output, ground truth or codec resynthesis)."""

    per: float = math.nan
    edits: int = 0
    ref_phonemes: int = 0
    hyp: str = ""
    similarity: float = math.nan
    seconds: float = math.nan
    wer: float = math.nan
    asr: str = ""


@dataclass
class RowResult:
    row: Row
    output: Scores
    duration_ratio: float = math.nan  # output seconds / the text's seconds at the prompt's rate
    duration_ratio_ref: float = math.nan  # output seconds / ground-truth seconds
    hit_length_cap: bool = False
    missing_output: bool = False  # bin/infer.py wrote nothing (the model stopped at once)
    ground_truth: Scores | None = None
    resynthesis: Scores | None = None


# ----------------------------------------------------------------------------- inputs
def read_rows_tsv(path: Path, out_dir: Path | None) -> list[Row]:
    """A TSV: bin/infer.py's 4 columns (prompt_text, prompt_wav, text, out_wav), optionally a
    5th ref_wav; a header line naming columns from COLUMNS may set any order; without one, 3
    columns mean (text, prompt_wav, out_wav); a header may also name ``language`` and
    ``prompt_language``. Relative out_wav paths are under ``out_dir``."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            lines = [r for r in csv.reader(f, delimiter="\t") if r and any(c.strip() for c in r)]
    except OSError as e:
        raise EvalInputError(f"cannot read --tsv {path}: {e}") from e
    if not lines:
        raise EvalInputError(f"--tsv {path} holds no rows")
    header = [c.strip() for c in lines[0]]
    start = 1
    if set(header) <= set(COLUMNS + LANGUAGE_COLUMNS) and {"text", "out_wav", "prompt_wav"} <= set(header):
        cols = header
        lines = lines[1:]
        start = 2
    elif len(header) == 3:
        cols = ["text", "prompt_wav", "out_wav"]
    elif len(header) in (4, 5):
        cols = list(COLUMNS[: len(header)])
    else:
        raise EvalInputError(f"{path}:1: expected 3-5 tab-separated columns or a header from {COLUMNS}")
    rows = []
    for lineno, line in enumerate(lines, start=start):
        if len(line) != len(cols):
            raise EvalInputError(f"{path}:{lineno}: expected {len(cols)} columns {cols}, got {len(line)}")
        d = {c: v.strip() for c, v in zip(cols, line)}
        out = Path(d["out_wav"])
        if not out.is_absolute() and out_dir is not None:
            out = out_dir / out
        rows.append(Row(f"{path.name}:{lineno}", d["text"], d["prompt_wav"], str(out),
                        d.get("prompt_text", ""), d.get("ref_wav") or None, d.get("language", ""),
                        d.get("prompt_language", "")))
    return rows


def rows_from_infer_flags(args: argparse.Namespace) -> list[Row]:
    """The rows bin/infer.py wrote for the same --text/--text-prompts/--audio-prompts/--output-dir."""
    from valle.infer import InputError, build_parser, read_items

    ns = build_parser().parse_args(["--checkpoint", "unused"])  # bin/infer.py's defaults
    ns.tsv, ns.output_dir, ns.continual = None, args.output_dir, False
    ns.text_prompts, ns.audio_prompts, ns.text = args.text_prompts, args.audio_prompts, args.text
    try:
        items = read_items(ns)
    except InputError as e:
        raise EvalInputError(str(e)) from e
    refs = [r.strip() for r in args.ref_wavs.split("|")] if args.ref_wavs else []
    if refs and len(refs) != len(items):
        raise EvalInputError(f"--ref-wavs has {len(refs)} entries for {len(items)} rows")
    # several prompt wavs of one item are joined in time (as bin/infer.py does): kept '|'-joined
    return [Row(it.name, it.text, "|".join(it.prompt_wavs), str(it.out_wav), it.prompt_text,
                refs[i] if refs else None, args.language, args.prompt_language or "")
            for i, it in enumerate(items)]


def load_wav(path: str, what: str, row: Row) -> torch.Tensor:
    from valle.codec.audio import load_audio_24k

    try:
        return load_audio_24k(path).reshape(-1)
    except Exception as e:
        raise EvalInputError(f"{row.name}: cannot read {what} {path}: {e}") from e


# ----------------------------------------------------------------------------- evaluation
@dataclass
class Tools:
    judge: object
    phonemize: object  # (text, espeak language) -> list of symbols (the project's espeak front end)
    language: str = "en-us"  # of a row's text when the row names none
    prompt_language: str = ""  # of a row's prompt transcript when the row names none ("": the text's)
    embedder: object | None = None
    asr: object | None = None
    codec: object | None = None
    max_len_ratio: float = 16.0
    missing_as_empty: bool = False
    cache: dict = field(default_factory=dict)


def score_wav(tools: Tools, wav: torch.Tensor, ref_symbols: list[str], text: str,
           prompt: torch.Tensor | None) -> Scores:
    ref = spoken(ref_symbols)
    hyp = tools.judge.transcribe([wav])[0] if wav.numel() >= HOP_LENGTH else []
    s = Scores(edits=edit_distance(ref, hyp), ref_phonemes=len(ref), hyp=" ".join(hyp),
               seconds=wav.numel() / SAMPLE_RATE)
    s.per = s.edits / max(1, s.ref_phonemes)
    if tools.embedder is not None and prompt is not None:
        s.similarity = tools.embedder.similarity(wav, SAMPLE_RATE, prompt, SAMPLE_RATE)
    if tools.asr is not None:
        from valle.eval.asr import word_error_rate

        s.asr = tools.asr.transcribe(wav, SAMPLE_RATE) if wav.numel() else ""
        s.wer = word_error_rate(text, s.asr)
    return s


def _phonemes(tools: Tools, text: str, language: str) -> list[str]:
    key = (text, language)
    if key not in tools.cache:
        tools.cache[key] = list(tools.phonemize(text, language)) if text.strip() else []
    return tools.cache[key]


def row_languages(tools: Tools, row: Row) -> tuple[str, str]:
    """(the text's language, the prompt transcript's language) of a row."""
    language = row.language or tools.language
    return language, row.prompt_language or tools.prompt_language or language


def evaluate_row(tools: Tools, row: Row, references: bool = True) -> RowResult:
    missing = tools.missing_as_empty and not Path(row.out_wav).exists()
    out = torch.zeros(0) if missing else load_wav(row.out_wav, "output wav", row)
    prompt = torch.cat([load_wav(p.strip(), "prompt wav", row) for p in row.prompt_wav.split("|")])
    language, prompt_language = row_languages(tools, row)
    ref_symbols = _phonemes(tools, row.text, language)
    if not spoken(ref_symbols):
        raise EvalInputError(f"{row.name}: text {row.text!r} has no phonemes to score")
    result = RowResult(row, score_wav(tools, out, ref_symbols, row.text, prompt), missing_output=missing)
    # The text's duration at the prompt's speaking rate (phonemes per second of the prompt).
    prompt_symbols = _phonemes(tools, row.prompt_text, prompt_language)
    prompt_phones = len(spoken(prompt_symbols))
    if prompt_phones:
        expected = len(spoken(ref_symbols)) * (prompt.numel() / SAMPLE_RATE) / prompt_phones
        result.duration_ratio = result.output.seconds / expected
    # The AR cap: floor(text tokens (BOS + prompt text + text + EOS) x --max-len-ratio) frames.
    # (prompt and text phonemized apart and joined by a word separator, as bin/infer.py does)
    full = len(prompt_symbols) + bool(prompt_symbols) + len(ref_symbols)
    cap = math.floor((full + 2) * tools.max_len_ratio)
    result.hit_length_cap = round(out.numel() / HOP_LENGTH) >= cap
    if references and row.ref_wav:
        ref = load_wav(row.ref_wav, "ground-truth wav", row)
        result.ground_truth = score_wav(tools, ref, ref_symbols, row.text, prompt)
        result.duration_ratio_ref = result.output.seconds / max(1e-9, result.ground_truth.seconds)
        if tools.codec is not None:
            with torch.inference_mode():
                codes = tools.codec.encode(ref.reshape(1, 1, -1))
                resyn = tools.codec.decode(codes).reshape(-1).float().cpu()
            result.resynthesis = score_wav(tools, resyn, ref_symbols, row.text, prompt)
    return result


def _nanmean(values) -> float:
    v = [x for x in values if not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan


def aggregate(scores: list[Scores]) -> dict:
    """Corpus PER (all edits / all reference phonemes), mean similarity, mean WER."""
    if not scores:
        return {}
    edits, phones = sum(s.edits for s in scores), sum(s.ref_phonemes for s in scores)
    return {"per": edits / max(1, phones), "per_mean_utt": _nanmean(s.per for s in scores),
            "similarity": _nanmean(s.similarity for s in scores),
            "similarity_missing": sum(math.isnan(s.similarity) for s in scores),
            "wer": _nanmean(s.wer for s in scores), "seconds": sum(s.seconds for s in scores),
            "rows": len(scores)}


def summarize_languages(results: list[RowResult], languages: list[str]) -> dict:
    """PER (and the other aggregates) of the rows of each text language: outputs, and the
    ground truth where the rows have one (the judge's ceiling in that language)."""
    out = {}
    for language in sorted(set(languages)):
        mine = [r for r, lang in zip(results, languages) if lang == language]
        out[language] = {"output": aggregate([r.output for r in mine])}
        gt = [r.ground_truth for r in mine if r.ground_truth is not None]
        if gt:
            out[language]["ground_truth"] = aggregate(gt)
    return out


def summarize(results: list[RowResult], languages: list[str] | None = None) -> dict:
    out = {"output": aggregate([r.output for r in results])}
    out["output"]["duration_ratio"] = _nanmean(r.duration_ratio for r in results)
    out["output"]["duration_ratio_ref"] = _nanmean(r.duration_ratio_ref for r in results)
    out["output"]["hit_length_cap"] = sum(r.hit_length_cap for r in results) / max(1, len(results))
    out["output"]["missing_output"] = sum(r.missing_output for r in results)
    gt = [r.ground_truth for r in results if r.ground_truth is not None]
    rs = [r.resynthesis for r in results if r.resynthesis is not None]
    if gt:
        out["ground_truth"] = aggregate(gt)
    if rs:
        out["codec_resynthesis"] = aggregate(rs)
    if languages and len(set(languages)) > 1:  # cross-lingual or multilingual rows: PER per language
        out["per_language"] = summarize_languages(results, languages)
    return out


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.3f}"
    return str(v)


def format_table(results: list[RowResult], summary: dict) -> str:
    lines = ["row | PER | sim | dur ratio | cap | GT PER | resyn PER | output wav"]
    for r in results:
        gt = r.ground_truth.per if r.ground_truth else math.nan
        rs = r.resynthesis.per if r.resynthesis else math.nan
        lines.append(" | ".join([r.row.name, _fmt(r.output.per), _fmt(r.output.similarity),
                                 _fmt(r.duration_ratio), _fmt(r.hit_length_cap), _fmt(gt), _fmt(rs),
                                 r.row.out_wav]))
    lines.append("")
    lines.append("aggregate      | PER   | similarity | WER   | dur ratio | hit cap")
    o = summary["output"]
    lines.append(f"output         | {_fmt(o['per'])} | {_fmt(o['similarity'])}      | {_fmt(o['wer'])} | "
                 f"{_fmt(o['duration_ratio'])}     | {o['hit_length_cap']:.2f}")
    for key, label in (("ground_truth", "ground truth"), ("codec_resynthesis", "codec resynth")):
        if key in summary:
            s = summary[key]
            lines.append(f"{label:<14} | {_fmt(s['per'])} | {_fmt(s['similarity'])}      | {_fmt(s['wer'])} |")
    if summary.get("per_language"):
        lines += ["", "language       | rows | PER   | GT PER"]
        for language, d in summary["per_language"].items():
            gt = d.get("ground_truth", {}).get("per", math.nan)
            lines.append(f"{language:<14} | {d['output']['rows']:>4} | {_fmt(d['output']['per'])} | {_fmt(gt)}")
    return "\n".join(lines)


def to_json(results: list[RowResult], summary: dict, meta: dict) -> dict:
    def clean(x):
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return clean({"meta": meta, "summary": summary, "rows": [asdict(r) for r in results]})


def write_tensorboard(exp_dir: Path, summary: dict, step: int, tag: str = "eval") -> Path:
    from torch.utils.tensorboard import SummaryWriter

    logdir = exp_dir / "tensorboard" / tag
    w = SummaryWriter(str(logdir))

    def add(prefix: str, values: dict) -> None:  # per_language nests a level deeper
        for k, v in values.items():
            if isinstance(v, dict):
                add(f"{prefix}/{k}", v)
            elif isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
                w.add_scalar(f"{prefix}/{k}", v, step)

    try:
        add(tag, summary)
    finally:
        w.close()
    return logdir


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Measure synthesised speech: PER (offline phoneme judge), speaker similarity, "
                    "duration, length-cap hits, WER when Whisper weights are present. See docs/evaluation.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("what to evaluate (the same flags as bin/infer.py, or a TSV)")
    g.add_argument("--tsv", type=Path, default=None,
                   help="rows: bin/infer.py's TSV (prompt_text, prompt_wav, text, out_wav[, ref_wav]) or "
                        "(text, prompt_wav, out_wav); a header line may name columns")
    g.add_argument("--output-dir", type=Path, default=None, help="where bin/infer.py wrote the wavs")
    g.add_argument("--text", default="", help="texts, joined by '|' (as given to bin/infer.py)")
    g.add_argument("--text-prompts", default="", help="prompt transcripts, joined by '|'")
    g.add_argument("--audio-prompts", default="", help="prompt wavs, joined by '|'")
    g.add_argument("--ref-wavs", default="", help="ground-truth wavs of the texts, joined by '|' (optional)")
    m = p.add_argument_group("judges")
    m.add_argument("--manifest-dir", type=Path, default=None,
                   help="tokenized corpus dir holding judge.pt and audio_codec.json")
    m.add_argument("--checkpoint", type=Path, default=None,
                   help="a training checkpoint: its config leads to the manifest dir (judge, codec) and its step")
    m.add_argument("--judge", type=Path, default=None, help="phoneme judge (default: {manifest-dir}/judge.pt)")
    m.add_argument("--speaker-model", default="resemblyzer", choices=["resemblyzer", "wavlm", "ecapa", "none"])
    m.add_argument("--speaker-model-path", default=None, help="local model dir for wavlm/ecapa")
    m.add_argument("--whisper-model", default=None,
                   help="measure WER with Whisper: a model name whose weights are in ~/.cache/whisper, a .pt "
                        "path, or a faster-whisper model dir")
    m.add_argument("--whisper-backend", default="openai-whisper", choices=["openai-whisper", "faster-whisper"])
    m.add_argument("--codec", default=None, choices=["encodec", "mel-rvq"],
                   help="codec for the resynthesis reference (default: the corpus's audio_codec.json)")
    m.add_argument("--no-references", action="store_true", help="skip ground-truth and resynthesis figures")
    m.add_argument("--language", default="en-us",
                   help="espeak language of the texts (a TSV's 'language' column overrides it per row)")
    m.add_argument("--prompt-language", default=None,
                   help="espeak language of the prompt transcripts (default: each text's; a TSV's "
                        "'prompt_language' column overrides it per row)")
    m.add_argument("--max-len-ratio", type=float, default=16.0, help="the --max-len-ratio bin/infer.py used")
    m.add_argument("--missing-as-empty", action="store_true",
                   help="score a missing output wav as silence (bin/infer.py writes none when the model "
                        "stops at once) instead of failing")
    m.add_argument("--allow-random-encodec", action="store_true",
                   help="EnCodec resynthesis with random weights (tests only)")
    o = p.add_argument_group("outputs")
    o.add_argument("--output-json", type=Path, default=None, help="default: {output-dir}/eval.json")
    o.add_argument("--exp-dir", type=Path, default=None, help="write TensorBoard scalars under {exp-dir}/tensorboard/eval")
    o.add_argument("--step", type=int, default=None, help="TensorBoard step (default: the checkpoint's)")
    o.add_argument("--device", default="cpu")
    return p


def _checkpoint_config(path: Path) -> tuple[dict, int]:
    if not path.is_file():
        raise EvalInputError(f"--checkpoint {path}: no such file")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    return dict(payload.get("config") or {}), int(payload.get("step", 0) or 0)


def build_tools(args: argparse.Namespace, config: dict) -> tuple[Tools, list[str]]:
    """Load the judges; return them and notes on what is not measured and why."""
    from valle.codec import (
        check_codec_identity,
        codec_for_checkpoint,
        make_audio_tokenizer,
        read_codec_record,
        record_dirs_from_config,
    )
    from valle.data.text import TextTokenizer
    from valle.eval.judge import JUDGE_FILE, Judge

    notes = []
    dirs = [args.manifest_dir] if args.manifest_dir else record_dirs_from_config(config)
    judge_path = args.judge or next((d / JUDGE_FILE for d in dirs if (d / JUDGE_FILE).is_file()), None)
    if judge_path is None:
        raise EvalInputError(f"no phoneme judge: pass --judge PATH or --manifest-dir DIR holding {JUDGE_FILE} "
                             f"(looked in {', '.join(map(str, dirs)) or 'nothing: no --manifest-dir/--checkpoint'})")
    judge = Judge.load(judge_path)
    tt = TextTokenizer(language=args.language)
    tools = Tools(judge=judge, phonemize=lambda text, language: tt([text], language=language)[0],
                  language=args.language, prompt_language=args.prompt_language or "",
                  max_len_ratio=args.max_len_ratio, missing_as_empty=args.missing_as_empty)
    if args.speaker_model != "none":
        from valle.eval.similarity import SpeakerEmbedder, SpeakerModelUnavailable

        try:
            tools.embedder = SpeakerEmbedder(args.speaker_model, args.speaker_model_path, args.device)
        except SpeakerModelUnavailable as e:
            notes.append(f"speaker similarity not measured: {e}")
    if args.whisper_model:
        from valle.eval.asr import AsrUnavailable, WhisperAsr

        try:
            tools.asr = WhisperAsr(args.whisper_model, args.whisper_backend, args.device)
        except AsrUnavailable as e:
            notes.append(f"WER not measured: {e}")
    else:
        notes.append("WER not measured: no --whisper-model (docs/evaluation.md)")
    if not args.no_references:
        try:
            if args.manifest_dir:
                record = read_codec_record(args.manifest_dir) or {"codec": "encodec"}
                if (args.codec or record["codec"]) == "mel-rvq":
                    check_codec_identity(config, args.manifest_dir)
                tools.codec = make_audio_tokenizer(args.codec or record["codec"], args.manifest_dir, args.device,
                                                   allow_random_encodec=args.allow_random_encodec)
            else:
                tools.codec = codec_for_checkpoint(config, args.device, allow_random_encodec=args.allow_random_encodec,
                                                   codec=args.codec)
        except Exception as e:  # no codec: the resynthesis reference is left out, and said so
            notes.append(f"codec resynthesis reference not measured: {str(e).splitlines()[0][:300]}")
    return tools, notes


def run(args: argparse.Namespace) -> dict:
    config, step = _checkpoint_config(args.checkpoint) if args.checkpoint else ({}, 0)
    if args.tsv:
        rows = read_rows_tsv(args.tsv, args.output_dir or args.tsv.parent)
    elif args.audio_prompts:
        if args.output_dir is None:
            raise EvalInputError("--output-dir (where bin/infer.py wrote the wavs) is required with --text")
        rows = rows_from_infer_flags(args)
    else:
        raise EvalInputError("nothing to evaluate: give --tsv, or --text/--text-prompts/--audio-prompts --output-dir")
    tools, notes = build_tools(args, config)
    for n in notes:
        logger.warning("%s", n)
    t0 = time.time()
    results = []
    for i, row in enumerate(rows, start=1):
        results.append(evaluate_row(tools, row, references=not args.no_references))
        if i % 10 == 0 or i == len(rows):
            logger.info("evaluated %d/%d rows (%.1f rows/s)", i, len(rows), i / max(1e-6, time.time() - t0))
    summary = summarize(results, [row_languages(tools, r.row)[0] for r in results])
    print(format_table(results, summary))
    for n in notes:
        print(f"note: {n}")
    meta = {"judge": getattr(tools.judge, "info", {}), "speaker_model": args.speaker_model if tools.embedder else None,
            "whisper": args.whisper_model if tools.asr else None, "codec": getattr(tools.codec, "name", None),
            "checkpoint": str(args.checkpoint) if args.checkpoint else None, "notes": notes}
    report = to_json(results, summary, meta)
    out_json = args.output_json or ((args.output_dir or args.tsv.parent) / "eval.json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"json: {out_json}")
    if args.exp_dir:
        logdir = write_tensorboard(args.exp_dir, summary, args.step if args.step is not None else step)
        print(f"tensorboard: {logdir}")
    return report


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    try:
        run(args)
    except (EvalInputError, FileNotFoundError, ValueError) as e:
        print(f"bin/evaluate.py: error: {e}", file=sys.stderr)
        return 2
    return 0

"""Synthesis from a checkpoint: text + prompt (audio, its text) -> 24 kHz wav.

Library entry behind ``bin/infer.py`` (every flag: docs/inference.md): arguments, items, checkpoints,
the run; texts and prompts are read by ``valle.synthesizer``, decoded by ``valle.engine``. The model's
hyper-parameters and the symbol table path come from the checkpoint: this project's
(``config``) or a lifeiteng/vall-e one (converted by ``valle.models.convert``). Heavy
dependencies (phonemizer, EnCodec, soundfile) are imported inside functions.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from valle.args import DTYPES, str2bool
from valle.codec.constants import SAMPLE_RATE
from valle.config_flags import add_flags
from valle.engine import (  # noqa: F401 (Prepared, PreparedBatch, collate_prepared: the frontend's API)
    Failure,
    Prepared,
    PreparedBatch,
    collate_prepared,
    decode_codes,
    decode_prepared,
)
from valle.models.generation import (
    DECODING_GROUP,
    DECODING_GROUP_DESCRIPTIONS,
    EXPERIMENTAL_DECODING_GROUP,
    DecodeOptions,
)
from valle.synthesizer import (  # noqa: F401 (re-exported: callers import them from valle.infer)
    PROMPT_FILE_SUFFIX,
    VALLEX_FRONTEND,
    InputError,
    Item,
    Synthesizer,
    TextError,
    is_prompt_file,
    read_prompt_file,
    split_sentences,
    too_long_early,
    vallex_language,
)

logger = logging.getLogger(__name__)

TSV_COLUMNS = ("prompt_text", "prompt_wav", "text", "out_wav")
BEST_CHECKPOINT = "best-valid-loss.pt"


@dataclass
class RunResult:
    written: list[Path] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)


# ------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Zero-shot TTS with a VALL-E/VALL-F checkpoint (ours or lifeiteng/vall-e's).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint of bin/trainer.py, lifeiteng/vall-e or Plachtaa/VALL-E-X; "
                        "hf:OWNER/REPO/FILE: from the Hugging Face hub's cache; an exp dir: its "
                        f"{BEST_CHECKPOINT}, else its newest epoch-*.pt")  # fmt: skip
    p.add_argument("--text-prompts", default="",
                   help="transcript of the prompt audio; several joined by '|' (see --prompt-join)")  # fmt: skip
    p.add_argument("--audio-prompts", default="",
                   help="prompt wav file(s), several joined by '|'; a VALL-E X checkpoint also "
                        "takes its .npz prompts (codes, text ids and language: no --text-prompts)")  # fmt: skip
    p.add_argument("--text", default="", help="text(s) to synthesise, several joined by '|'")
    p.add_argument("--prompt-join", default="concat", choices=["concat", "pair"],
                   help="several prompts: concat = one prompt made of all of them, used for every "
                        "text (lifeiteng); pair = the i-th prompt for the i-th text")  # fmt: skip
    p.add_argument(
        "--tsv", default=None, help="TSV with columns prompt_text, prompt_wav, text, out_wav"
    )
    p.add_argument("--output-dir", default="infer/demo", help="where wavs are written")
    add_flags(p, DecodeOptions, groups=[DECODING_GROUP])
    g = next(group for group in p._action_groups if group.title == DECODING_GROUP)
    g.add_argument("--split-sentences", action="store_true",
                   help="synthesise a long text sentence by sentence (same prompt) and join the audio")  # fmt: skip
    g.add_argument("--sentence-gap", type=float, default=0.15,
                   help="seconds of silence between joined sentences")  # fmt: skip
    g.add_argument("--batch-size", type=int, default=1,
                   help="texts decoded together (faster; each samples as it would alone, from --seed)")  # fmt: skip
    add_flags(p, DecodeOptions, DECODING_GROUP_DESCRIPTIONS, groups=[EXPERIMENTAL_DECODING_GROUP])
    p.add_argument("--continual", type=str2bool, nargs="?", const=True, default=False,
                   help="resynthesise the prompt audio: codebook 0 from it, the NAR predicts "
                        "the rest; --text-prompts is its whole transcript and --text is not used")  # fmt: skip
    p.add_argument(
        "--use-averaged-model", action="store_true",
        help="use the checkpoint's averaged weights (with --lora: the adapters' averaged copy)"
    )
    p.add_argument("--lora", default=None, metavar="ADAPTERS",
                   help="LoRA adapters of a fine-tuning run (bin/trainer.py --lora-rank) applied to "
                        "--checkpoint, their base (checked by hash); an adapters file given as "
                        "--checkpoint uses the base it recorded")  # fmt: skip
    p.add_argument("--merge-lora", default=None, metavar="OUT",
                   help="write the base with the adapters merged into its weights to OUT (a normal "
                        "checkpoint), then synthesise if there is text")  # fmt: skip
    p.add_argument("--text-tokens", default=None, help="symbol table; default: the checkpoint's")
    p.add_argument("--bpe-vocab", default=None,
                   help="Plachtaa/VALL-E-X checkpoints (text frontend vallex-bpe): its "
                        "utils/g2p/bpe_69.json; default: bpe_69.json next to the checkpoint")  # fmt: skip
    p.add_argument("--language", default="en-us",
                   help="espeak language of --text; auto: each sentence in the language of its "
                        "script that the checkpoint's symbol table covers (docs/inference.md)")  # fmt: skip
    p.add_argument("--prompt-language", default=None,
                   help="espeak language of --text-prompts (default: --language)")  # fmt: skip
    p.add_argument("--accent", default=None,
                   help="Plachtaa/VALL-E-X checkpoints: say the whole text with this language's "
                        "embedding (en, zh, ja), as VALL-E X's accent option; default: each token "
                        "its own language")  # fmt: skip
    p.add_argument("--languages", default=None,
                   help="VALL-E X models (--num-languages > 0): the languages in id order, comma "
                        "separated; default: the checkpoint config's 'languages'")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="inference precision of the model")  # fmt: skip
    p.add_argument("--encodec-checkpoint", default=None, help="EnCodec 24 kHz state dict")
    p.add_argument("--codec-dir", default=None,
                   help="directory holding the mel_rvq.pt (and audio_codec.json) the model was trained "
                        "with; default: the checkpoint's manifest dir")
    p.add_argument("--allow-random-encodec", action="store_true",
                   help="random EnCodec weights when none are found (tests only: the audio is noise)")  # fmt: skip
    p.add_argument("--text-extractor", default="espeak", choices=["espeak", "pypinyin"],
                   help="text front-end; pypinyin: Mandarin characters -> pinyin with tones")  # fmt: skip
    p.add_argument("--decoder", default="auto", choices=["auto", "encodec", "vocos"],
                   help="codes -> audio: EnCodec's decoder, or Vocos (EnCodec-coded corpora only); "
                        "auto: Vocos for a Plachtaa/VALL-E-X checkpoint (as it decodes) where its "
                        "weights are on disk, else EnCodec's")  # fmt: skip
    p.add_argument("--vocos-checkpoint", default=None,
                   help="Vocos pytorch_model.bin (charactr/vocos-encodec-24khz); default: hub cache")  # fmt: skip
    p.add_argument("--allow-random-vocos", action="store_true",
                   help="random Vocos weights when none are found (tests only: the audio is noise)")  # fmt: skip
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return p


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split("|")] if value else []


def read_items(args: argparse.Namespace) -> list[Item]:
    out_dir = Path(args.output_dir)
    if args.tsv:
        if args.text or args.audio_prompts or args.text_prompts:
            raise InputError(
                "--tsv names every item: leave out --text/--audio-prompts/--text-prompts"
            )
        return _read_tsv(Path(args.tsv), out_dir)
    prompts, wavs, texts = _split(args.text_prompts), _split(args.audio_prompts), _split(args.text)
    if not wavs:
        raise InputError("--audio-prompts is required (or --tsv)")
    if not prompts and all(is_prompt_file(w) for w in wavs):
        prompts = [""] * len(wavs)  # VALL-E X .npz prompts carry their text ids
    if not prompts:
        raise InputError(
            "--text-prompts is required: the transcript of --audio-prompts "
            f"({len(wavs)} file(s); several transcripts joined by '|')"
        )
    if len(prompts) != len(wavs) and args.prompt_join == "concat":
        raise InputError(
            f"--text-prompts has {len(prompts)} entries and --audio-prompts {len(wavs)}: "
            "one transcript per prompt file (separated by '|')"
        )
    if args.continual:
        if texts:
            raise InputError(
                "--continual resynthesises the prompt audio from its transcript "
                "(--text-prompts): leave out --text"
            )
        texts = [""]
    elif not texts:
        raise InputError("--text is required: what to synthesise (several joined by '|')")
    if args.prompt_join == "concat":
        # lifeiteng: every prompt joined into one (transcripts by spaces, codes in time).
        prompt_text = " ".join(prompts)
        return [Item(prompt_text, list(wavs), t, out_dir / f"{i}.wav", f"item {i}")
                for i, t in enumerate(texts)]  # fmt: skip
    n = max(len(prompts), len(wavs), len(texts))
    cols = {"--text-prompts": prompts, "--audio-prompts": wavs, "--text": texts}
    for flag, values in cols.items():
        if len(values) not in (1, n):
            raise InputError(
                f"--prompt-join pair: {flag} has {len(values)} entries; the others have up to "
                f"{n}: give 1 (used for every item) or {n}, separated by '|'"
            )
    pick = {flag: (v * n if len(v) == 1 else v) for flag, v in cols.items()}
    return [
        Item(
            pick["--text-prompts"][i],
            pick["--audio-prompts"][i],
            pick["--text"][i],
            out_dir / f"{i}.wav",
            f"item {i}",
        )  # fmt: skip
        for i in range(n)
    ]


def _read_tsv(path: Path, out_dir: Path) -> list[Item]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t"))
    except OSError as e:
        raise InputError(f"cannot read --tsv {path}: {e}") from e
    if rows and tuple(c.strip() for c in rows[0]) == TSV_COLUMNS:
        rows = rows[1:]
        start = 2
    else:
        start = 1
    items = []
    for lineno, row in enumerate(rows, start=start):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 4:
            raise InputError(
                f"{path}:{lineno}: expected 4 tab-separated columns {TSV_COLUMNS}, got {len(row)}"
            )
        prompt_text, prompt_wav, text, out_wav = (c.strip() for c in row)
        out = Path(out_wav)
        items.append(Item(prompt_text, prompt_wav, text, out if out.is_absolute() else out_dir / out,
                          f"{path}:{lineno}"))  # fmt: skip
    if not items:
        raise InputError(f"--tsv {path} holds no rows")
    return items


# ---------------------------------------------------------------------- model
def select_checkpoint(path: str | Path) -> Path:
    """``path`` itself, or in an exp dir the best validation checkpoint (else the newest epoch).

    The last epoch is not the best when validation loss rose (a tiny corpus overfits
    fast): ``best-valid-loss.pt`` is what the trainer keeps for synthesis.
    """
    from valle.models.convert import CheckpointError, resolve_checkpoint

    try:
        path = resolve_checkpoint(path)  # hf:OWNER/REPO/FILE: from the hub's cache
    except CheckpointError as e:
        raise InputError(f"--checkpoint: {e}") from e
    if not path.is_dir():
        return path
    best = path / BEST_CHECKPOINT
    if best.is_file():
        logger.info("--checkpoint %s: using %s (lowest validation loss)", path, best.name)
        return best
    epochs = sorted(path.glob("epoch-*.pt"), key=lambda p: p.stat().st_mtime)
    if not epochs:
        raise InputError(
            f"--checkpoint {path}: a directory without {BEST_CHECKPOINT} or epoch-*.pt"
        )
    logger.warning("--checkpoint %s: no %s, using the newest epoch %s", path, BEST_CHECKPOINT,
                   epochs[-1].name)  # fmt: skip
    return epochs[-1]


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    use_averaged_model: bool = False,
    dtype: torch.dtype = torch.float32,
    lora: str | Path | None = None,
):
    """(model in eval mode on ``device``, the checkpoint's config dict with the model's hparams).

    Our checkpoints and lifeiteng/vall-e's (converted) are both accepted. ``lora``: adapters
    of a LoRA run applied to it (``use_averaged_model`` then picks the adapters' average); a
    LoRA run's adapters file as ``path`` is applied to the base it recorded.
    """
    from valle.models import get_model
    from valle.models.convert import CheckpointError, from_payload, load_payload
    from valle.models.lora import is_adapters_payload

    path = select_checkpoint(path)
    try:
        payload = load_payload(path)
        if is_adapters_payload(payload):
            if lora is not None:
                raise InputError(f"--checkpoint {path}: LoRA adapters, not a base model")
            lora, path = path, Path(payload["lora"]["base"])
            logger.info("--checkpoint %s: LoRA adapters, applied to their base %s", lora, path)
            if not path.is_file():
                raise InputError(f"--checkpoint {lora}: LoRA adapters whose base {path} is not "
                                 f"there: pass --checkpoint BASE --lora {lora}")
            payload = load_payload(path)
        state, hp = from_payload(payload, str(path),
                                 use_averaged_model=use_averaged_model and lora is None)
    except CheckpointError as e:
        raise InputError(f"--checkpoint: {e}") from e
    config = {**dict(payload.get("config") or {}), **hp}
    if hp.get("source_format") == "lifeiteng":
        logger.info("--checkpoint %s: a lifeiteng/vall-e checkpoint, converted", path)
    elif hp.get("source_format") == "vallex":
        logger.info("--checkpoint %s: a Plachtaa/VALL-E-X checkpoint (languages %s), converted",
                    path, ", ".join(hp["languages"]))
    model = get_model(hp)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(
            f"--checkpoint {path}: its weights do not fit the model its hyper-parameters describe "
            f"({len(missing)} missing, e.g. {missing[:3]}; {len(unexpected)} unexpected, "
            f"e.g. {unexpected[:3]})"
        )
    if lora is not None:
        config = apply_adapters(model, config, hp, Path(lora), path, use_averaged_model)
    return model.to(device=device, dtype=dtype).eval(), config


def apply_adapters(model, config: dict[str, Any], hp: dict[str, Any], adapters: Path,
                   base: Path, use_averaged_model: bool) -> dict[str, Any]:
    """--lora: the adapters on the base model (in place); the config gains the fine-tuning
    run's (its symbol table and codec), the base's architecture kept."""
    from valle.models.convert import CheckpointError
    from valle.models.lora import LoraError, attach_adapters, read_adapters

    try:
        payload = read_adapters(adapters)
        attach_adapters(model, payload, f"--lora {adapters}", f"--checkpoint {base}",
                        use_averaged_model)
    except (LoraError, CheckpointError) as e:
        raise InputError(str(e)) from e
    logger.info("--lora %s: rank %d adapters on %s", adapters, payload["lora"]["config"]["lora_rank"], base)
    out = {**config, **dict(payload.get("config") or {}), **hp, "lora_adapters": str(adapters)}
    if payload["lora"].get("added_languages"):  # --add-language: the grown table, rows in order
        out.update(languages=list(payload["lora"]["languages"]), num_languages=model.num_languages)
        logger.info("--lora %s: adds language(s) %s (table %s)", adapters,
                    ", ".join(payload["lora"]["added_languages"]), ", ".join(out["languages"]))
    return out


def write_merged_lora(args: argparse.Namespace) -> Path:
    """--merge-lora OUT: the base with its adapters folded into the weights, a normal checkpoint."""
    from valle.models.lora import has_lora, merge_lora, merged_checkpoint, read_adapters

    model, config = load_model(args.checkpoint, "cpu", args.use_averaged_model, torch.float32,
                               lora=args.lora)
    if not has_lora(model):
        raise InputError(f"--merge-lora: {args.checkpoint} has no adapters to merge (pass --lora)")
    payload = merged_checkpoint(read_adapters(config["lora_adapters"]), merge_lora(model),
                                model.hparams)
    out = Path(args.merge_lora)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save(payload, tmp)
    tmp.replace(out)  # never half a file under the final name
    logger.info("--merge-lora: wrote %s (adapters %s merged)", out, config["lora_adapters"])
    return out


def write_wav(path: Path, wav: torch.Tensor) -> None:
    import soundfile as sf

    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), wav.clamp(-1.0, 1.0).numpy(), SAMPLE_RATE)


def decode_options(args: argparse.Namespace) -> DecodeOptions:
    """The decoding flags as ``DecodeOptions`` (a bad value is the user's: ``InputError``)."""
    try:
        return DecodeOptions.from_flags(args)
    except ValueError as e:
        raise InputError(str(e)) from e


def _units(items: list[Item], split: bool) -> list[tuple[int, Item]]:
    """(item index, what to decode): one per item, or one per sentence with --split-sentences."""
    units = []
    for i, item in enumerate(items):
        parts = split_sentences(item.text) if split and item.text else [item.text]
        for k, part in enumerate(parts):
            name = item.name if len(parts) == 1 else f"{item.name} sentence {k + 1}/{len(parts)}"
            units.append((i, Item(item.prompt_text, item.prompt_wav, part, item.out_wav, name)))
    return units


def unit_items(item: Item, args: argparse.Namespace) -> list[Item]:
    """What of ``item`` is decoded: itself, or each sentence with --split-sentences."""
    return [unit for _, unit in _units([item], args.split_sentences and not args.continual)]


def check_text(synth: Synthesizer, item: Item, args: argparse.Namespace) -> None:
    """Raise ``TextError`` when any piece of ``item`` would be refused (the page's check, made
    before it queues; ``synthesize_items`` makes the same per item of a file)."""
    split = args.split_sentences and not args.continual
    for unit in unit_items(item, args):
        problem = synth.text_problem(unit, split)
        if problem is not None:
            raise TextError(problem.field, f"{unit.name}: {problem.message}")


def _refuse_bad_texts(synth: Synthesizer, units: list[tuple[int, Item]], split: bool,
                      pieces: list[list[torch.Tensor | Failure]]) -> list[tuple[int, Item]]:
    """The units to decode; each refused one becomes its item's failure (the others go on)."""
    kept = []
    for i, unit in units:
        problem = synth.text_problem(unit, split)
        if problem is None:
            kept.append((i, unit))
        else:
            pieces[i].append(Failure(unit.name, problem.message))
    return kept


def synthesize_items(synth: Synthesizer, items: list[Item], args: argparse.Namespace) -> RunResult:
    """Decode every item in batches, write its wav, and report the items that failed."""
    options = decode_options(args)
    split = args.split_sentences and not args.continual
    pieces: list[list[torch.Tensor | Failure]] = [[] for _ in items]
    units = _refuse_bad_texts(synth, _units(items, split), split, pieces)
    bs = max(1, args.batch_size)
    started = time.monotonic()
    for start in range(0, len(units), bs):
        batch = units[start : start + bs]
        for (i, _), result in zip(batch, synth.synthesize([u for _, u in batch],
                                                          continual=args.continual,
                                                          options=options)):  # fmt: skip
            pieces[i].append(result)
        done = min(start + bs, len(units))
        if len(units) > bs:
            rate = done / max(time.monotonic() - started, 1e-9)
            logger.info("decoded %d/%d (%.2f/s, ETA %.0f s)", done, len(units), rate,
                        (len(units) - done) / rate)  # fmt: skip
    result = RunResult()
    gap = torch.zeros(int(args.sentence_gap * SAMPLE_RATE))
    for item, parts in zip(items, pieces):
        failed = [p for p in parts if isinstance(p, Failure)]
        if failed:
            result.failures.append(Failure(item.name, "; ".join(
                f.reason if f.name == item.name else f"{f.name}: {f.reason}" for f in failed)))  # fmt: skip
            logger.error("%s: no wav: %s", item.name, result.failures[-1].reason)
            continue
        joined = [x for k, w in enumerate(parts) for x in ((gap, w) if k else (w,))]
        wav = torch.cat(joined)
        write_wav(item.out_wav, wav)
        logger.info("%s: wrote %s (%.2f s)", item.name, item.out_wav, wav.numel() / SAMPLE_RATE)
        result.written.append(item.out_wav)
    return result


def load_for_synthesis(args: argparse.Namespace, device: torch.device):
    """(model, checkpoint config, symbol table path, audio tokenizer) of ``args.checkpoint``, loaded
    and checked as ``run`` does, for callers that keep them across requests (bin/serve.py) and build
    a ``Synthesizer`` per request language. Bad input raises ``InputError``."""
    model, config = load_model(args.checkpoint, device, args.use_averaged_model, DTYPES[args.dtype],
                               lora=getattr(args, "lora", None))
    if config.get("text_frontend") == VALLEX_FRONTEND:
        table = vallex_vocab(args)
    else:
        table = args.text_tokens or config.get("text_tokens")
    if not table:
        raise InputError("the checkpoint names no text_tokens symbol table: pass --text-tokens")
    if not Path(table).is_file():  # before the codec loads: a lifeiteng checkpoint names its recipe's path
        raise InputError(f"symbol table {table} not found (pass --text-tokens)")
    from valle.codec import CodecMismatchError, codec_for_checkpoint

    try:  # the codec the checkpoint's corpus was tokenized with (valle/codec: EnCodec or mel-rvq)
        audio_tokenizer = codec_for_checkpoint(
            config, device, args.encodec_checkpoint, args.allow_random_encodec,
            codec_dir=args.codec_dir,
        )  # fmt: skip
    except (FileNotFoundError, CodecMismatchError) as e:
        raise InputError(str(e)) from e
    return model, config, table, audio_tokenizer


def vallex_vocab(args: argparse.Namespace) -> str:
    """A vallex-bpe checkpoint's BPE vocabulary: --bpe-vocab, else bpe_69.json beside the file."""
    from valle.data.vallex_text import BPE_VOCAB

    given = getattr(args, "bpe_vocab", None)
    path = Path(given) if given else select_checkpoint(args.checkpoint).parent / BPE_VOCAB
    if not path.is_file():
        raise InputError(f"{'--bpe-vocab' if given else 'the VALL-E X vocabulary'} {path} not found: "
                         f"put Plachtaa/VALL-E-X's utils/g2p/{BPE_VOCAB} next to the checkpoint or "
                         "pass --bpe-vocab")  # fmt: skip
    return str(path)


def run(args: argparse.Namespace) -> RunResult:
    if args.merge_lora:
        write_merged_lora(args)
        if not (args.text or args.tsv or args.continual):
            return RunResult()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    items = read_items(args)
    decode_options(args)  # validate before loading anything
    if args.cuda_graphs and device.type != "cuda":
        raise InputError(f"--cuda-graphs needs a CUDA device, got --device {device}")
    vocos_weights = resolve_vocos(args)
    torch.manual_seed(args.seed)
    model, config, table, audio_tokenizer = load_for_synthesis(args, device)
    if args.decoder == "vocos":
        decoder = build_vocos(config, device, vocos_weights, args)
    else:
        decoder = auto_vocos(config, device, args) if args.decoder == "auto" else None
    synth = Synthesizer(model, table, audio_tokenizer, device, language=args.language,
                        prompt_language=args.prompt_language, checkpoint_config=config,
                        languages=args.languages, text_extractor=args.text_extractor,
                        decoder=decoder, accent=args.accent)  # fmt: skip
    return synthesize_items(synth, items, args)


def resolve_vocos(args: argparse.Namespace):
    """--decoder vocos: find the weights before any synthesis work (offline: a one-line error)."""
    if getattr(args, "decoder", "encodec") != "vocos":
        return None
    from valle.codec.vocos import VocosWeightsError, resolve_vocos_weights

    try:
        return resolve_vocos_weights(args.vocos_checkpoint, args.allow_random_vocos)
    except VocosWeightsError as e:
        raise InputError(str(e)) from e


def auto_vocos(config: dict[str, Any], device, args: argparse.Namespace):
    """--decoder auto: Vocos for a VALL-E X checkpoint (Plachtaa/VALL-E-X decodes with
    charactr/vocos-encodec-24khz) when its weights are on disk (--vocos-checkpoint or the hub
    cache; never a download); otherwise EnCodec's decoder, with a line saying why."""
    if config.get("text_frontend") != VALLEX_FRONTEND:
        return None
    from valle.codec.vocos import VocosWeightsError, resolve_vocos_weights

    try:
        weights = resolve_vocos_weights(args.vocos_checkpoint, False, download=False)
        return build_vocos(config, device, weights, args)
    except (ImportError, VocosWeightsError, InputError) as e:
        logger.info("decoding with EnCodec's decoder: Vocos, which VALL-E X decodes with, is not "
                    "usable here (%s); --decoder vocos makes it an error", str(e).splitlines()[0])
        return None


def build_vocos(config: dict[str, Any], device, weights, args: argparse.Namespace):
    """Vocos only for EnCodec-coded corpora (refused for mel-rvq)."""
    from valle.codec import find_codec_record
    from valle.codec.vocos import (
        VocosCodecError,
        VocosDecoder,
        VocosWeightsError,
        check_codec_for_vocos,
    )

    found = find_codec_record(config)
    try:
        check_codec_for_vocos(found[0].get("codec", "encodec") if found else "encodec")
        # a file that is not the EnCodec Vocos (or its config.yaml): one line naming it
        return VocosDecoder(device, weights, allow_random_weights=weights is None, download=False)
    except (VocosCodecError, VocosWeightsError) as e:
        raise InputError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a model problem, not a crash
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result.failures:
        print(f"error: {len(result.failures)} item(s) gave no audio ({len(result.written)} written):",
              file=sys.stderr)  # fmt: skip
        for f in result.failures:
            print(f"  {f.name}: {f.reason}", file=sys.stderr)
        return 1
    return 0

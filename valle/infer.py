"""Synthesis from a training checkpoint: text + prompt (audio, its text) -> 24 kHz wav.

Library entry behind ``bin/infer.py``. The model's hyper-parameters and the symbol
table path come from the checkpoint's ``config`` (docs/architecture.md). Heavy
dependencies (phonemizer, EnCodec, soundfile) are imported inside functions.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24000
TSV_COLUMNS = ("prompt_text", "prompt_wav", "text", "out_wav")


class InputError(ValueError):
    """Bad user input (missing file, unknown symbol, empty text): reported without a traceback."""


@dataclass
class Item:
    prompt_text: str
    prompt_wav: str
    text: str
    out_wav: Path
    name: str  # how messages refer to this item


# ------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Zero-shot TTS with a VALL-E/VALL-F checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by bin/trainer.py")
    p.add_argument(
        "--text-prompts", default="", help="text of the prompt audio; several joined by '|'"
    )
    p.add_argument("--audio-prompts", default="", help="prompt wav file(s), several joined by '|'")
    p.add_argument("--text", default="", help="text(s) to synthesise, several joined by '|'")
    p.add_argument(
        "--tsv", default=None, help="TSV with columns prompt_text, prompt_wav, text, out_wav"
    )
    p.add_argument("--output-dir", default="infer/demo", help="where wavs are written")
    p.add_argument("--top-k", type=int, default=-100, help="top-k sampling (<= 0: off, 1: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-len-ratio", type=float, default=16.0,
                   help="at most this many frames per text token (prompt text included)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=4, help="texts decoded together")
    p.add_argument("--continual", action="store_true",
                   help="codebook 0 from the prompt audio itself; the NAR predicts the rest (needs no --text)")  # fmt: skip
    p.add_argument(
        "--use-averaged-model", action="store_true", help="use the checkpoint's averaged weights"
    )
    p.add_argument(
        "--text-tokens", default=None, help="symbol table; default: the checkpoint config's"
    )
    p.add_argument("--language", default="en-us", help="espeak language of the texts")
    p.add_argument("--encodec-checkpoint", default=None, help="EnCodec 24 kHz state dict")
    p.add_argument("--allow-random-encodec", action="store_true",
                   help="random EnCodec weights when none are found (tests only: the audio is noise)")  # fmt: skip
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return p


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split("|")] if value else []


def read_items(args: argparse.Namespace) -> list[Item]:
    out_dir = Path(args.output_dir)
    if args.tsv:
        return _read_tsv(Path(args.tsv), out_dir)
    prompts, wavs, texts = _split(args.text_prompts), _split(args.audio_prompts), _split(args.text)
    if not wavs:
        raise InputError("--audio-prompts is required (or --tsv)")
    if args.continual:
        texts = texts or [""] * len(wavs)
    n = max(len(prompts), len(wavs), len(texts))
    cols = {"--text-prompts": prompts, "--audio-prompts": wavs, "--text": texts}
    for flag, values in cols.items():
        if len(values) not in (1, n):
            raise InputError(
                f"{flag} has {len(values)} entries; expected 1 or {n} (separated by '|')"
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
def _load_payload(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise InputError(f"--checkpoint {path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        # Trainer checkpoints also carry RNG states (numpy arrays) that the safe
        # unpickler refuses; only load checkpoints you trust.
        return torch.load(path, map_location="cpu", weights_only=False)


def load_model(
    path: str | Path, device: torch.device | str = "cpu", use_averaged_model: bool = False
):
    """(model in eval mode on ``device``, the checkpoint's config dict)."""
    from valle.models import get_model

    payload = _load_payload(Path(path))
    if not isinstance(payload, dict) or "model" not in payload:
        raise InputError(f"--checkpoint {path}: not a valle checkpoint (no 'model' entry)")
    config = dict(payload.get("config") or {})
    state = payload["model"]
    if use_averaged_model:
        state = payload.get("model_avg")
        if state is None:
            raise InputError(f"--use-averaged-model: checkpoint {path} holds no averaged model")
    # Tolerate wrappers' prefixes (DDP "module.", torch.compile "_orig_mod.").
    state = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in state.items()}
    model = get_model(config)
    model.load_state_dict(state)
    return model.to(device).eval(), config


# ------------------------------------------------------------------ synthesis
class Synthesizer:
    """Tokenises texts and prompts, runs the model, decodes codes to audio."""

    def __init__(
        self, model, symbol_table_path: str | Path, audio_tokenizer, device, language: str = "en-us"
    ):
        from valle.data.symbols import SymbolTable
        from valle.data.text import TextTokenCollater, TextTokenizer

        path = Path(symbol_table_path)
        if not path.is_file():
            raise InputError(f"symbol table {path} not found (pass --text-tokens)")
        table = SymbolTable.from_file(path)
        largest = max(table.ids)
        if largest >= model.num_text_tokens:
            raise InputError(
                f"symbol table {path} has ids up to {largest} but the model has "
                f"{model.num_text_tokens} text tokens: wrong table for this checkpoint"
            )
        self.model, self.device = model, torch.device(device)
        self.text_tokenizer = TextTokenizer(language=language)
        self.collater = TextTokenCollater(table, add_bos=True, add_eos=True)
        self.audio_tokenizer = audio_tokenizer

    def _text_tokens(self, items: list[Item], continual: bool):
        symbols = []
        for item in items:
            if not item.text.strip() and not continual:
                raise InputError(f"{item.name}: the text to synthesise is empty")
            text = f"{item.prompt_text} {item.text}".strip()
            if not text:
                raise InputError(f"{item.name}: empty text (and empty prompt text)")
            syms = self.text_tokenizer([text])[0]
            if not syms:
                raise InputError(f"{item.name}: text {text!r} gave no phonemes")
            symbols.append(syms)
        try:
            tokens, lens = self.collater(symbols, ids=[i.name for i in items])
        except KeyError as e:
            raise InputError(str(e)) from e
        return tokens.to(self.device), lens.to(self.device)

    def _prompt_codes(self, items: list[Item]):
        from valle.data.audio import load_audio_24k

        q = self.model.num_quantizers
        codes = []
        for item in items:
            if not item.prompt_wav:
                raise InputError(f"{item.name}: no prompt audio file")
            try:
                wav = load_audio_24k(item.prompt_wav)
            except Exception as e:  # unreadable, missing, empty: the message names the file
                raise InputError(
                    f"{item.name}: cannot read prompt audio {item.prompt_wav}: {e}"
                ) from e
            c = self.audio_tokenizer.encode(wav)[0].T  # (T, 8)
            if c.shape[1] < q:
                raise InputError(
                    f"the audio tokenizer gives {c.shape[1]} codebooks, the model needs {q}"
                )
            codes.append(c[:, :q].to(self.device))
        lens = torch.tensor([c.shape[0] for c in codes], device=self.device)
        out = torch.full(
            (len(codes), int(lens.max()), q), 1024, dtype=torch.long, device=self.device
        )
        for i, c in enumerate(codes):
            out[i, : c.shape[0]] = c
        return out, lens

    def synthesize(
        self, items: list[Item], *, continual: bool = False, **decode_kwargs
    ) -> list[torch.Tensor]:
        """One (N,) float waveform at 24 kHz per item."""
        text, text_lens = self._text_tokens(items, continual)
        prompt, prompt_lens = self._prompt_codes(items)
        if continual:
            codes, lens = self.model.continual(
                text, text_lens, prompt, prompt_lens, return_lens=True
            )
        else:
            codes, lens = self.model.inference(
                text, text_lens, prompt, prompt_lens, return_lens=True, **decode_kwargs
            )
        wavs = []
        for b in range(codes.shape[0]):
            row = codes[b, : int(lens[b])].T.unsqueeze(0)  # (1, Q, T)
            wavs.append(self.audio_tokenizer.decode(row).reshape(-1).float().cpu())
        return wavs


def write_wav(path: Path, wav: torch.Tensor) -> None:
    import soundfile as sf

    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), wav.clamp(-1.0, 1.0).numpy(), SAMPLE_RATE)


def run(args: argparse.Namespace) -> list[Path]:
    from valle.data.audio import AudioTokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    items = read_items(args)
    torch.manual_seed(args.seed)
    model, config = load_model(args.checkpoint, device, args.use_averaged_model)
    table = args.text_tokens or config.get("text_tokens")
    if not table:
        raise InputError(
            "the checkpoint config names no text_tokens symbol table: pass --text-tokens"
        )
    try:
        audio_tokenizer = AudioTokenizer(
            device,
            checkpoint=args.encodec_checkpoint,
            allow_random_weights=args.allow_random_encodec,
        )
    except FileNotFoundError as e:
        raise InputError(str(e)) from e
    synth = Synthesizer(model, table, audio_tokenizer, device, language=args.language)
    decode = dict(top_k=args.top_k, top_p=args.top_p, temperature=args.temperature,
                  max_len_ratio=args.max_len_ratio, seed=args.seed)  # fmt: skip
    written = []
    for start in range(0, len(items), max(1, args.batch_size)):
        batch = items[start : start + max(1, args.batch_size)]
        kwargs = {} if args.continual else decode
        for item, wav in zip(batch, synth.synthesize(batch, continual=args.continual, **kwargs)):
            write_wav(item.out_wav, wav)
            logger.info("%s: wrote %s (%.2f s)", item.name, item.out_wav, wav.numel() / SAMPLE_RATE)
            written.append(item.out_wav)
    return written


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # e.g. the AR emitted EOS at once: a model problem, not a crash
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0

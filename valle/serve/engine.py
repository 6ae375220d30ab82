"""Synthesis for the page through ``valle.infer``: one request at a time, models cached per checkpoint.

A GPU runs one synthesis well and several badly (memory, and no speed-up): every request that
touches a model (synthesis, or loading a checkpoint to list its languages) goes through one
worker thread, in arrival order (``WorkQueue``). What varies per request is written into a copy
of the server's ``bin/infer.py`` arguments, so every decoding flag keeps its meaning and its checks.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from valle.infer import (
    InputError,
    Item,
    RunResult,
    Synthesizer,
    build_vocos,
    check_text,
    decode_options,
    load_for_synthesis,
    resolve_vocos,
    synthesize_items,
)

logger = logging.getLogger(__name__)


class SynthesisFailed(RuntimeError):
    """The model produced no audio for a well-formed request (e.g. EOS first): said on the page."""


@dataclass
class SynthesisRequest:
    """One press of "synthesise"; ``None`` options keep the server's bin/infer.py defaults."""

    checkpoint: Path
    prompt_wav: Path
    prompt_text: str
    text: str
    language: str | None = None
    prompt_language: str | None = None
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    num_candidates: int | None = None
    seed: int | None = None

    def overrides(self) -> dict[str, Any]:
        names = ("language", "prompt_language", "top_k", "top_p", "temperature", "num_candidates", "seed")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@dataclass
class Result:
    id: str
    wav: Path
    spectrogram: Path
    seconds: float  # audio length
    waited: float  # seconds queued behind other requests
    elapsed: float  # seconds of synthesis


class Backend(Protocol):
    """What the page needs from a model; ``InferBackend`` is the real one, tests pass fakes."""

    def languages(self, args: argparse.Namespace) -> list[str]: ...

    def synthesize(self, args: argparse.Namespace, item: Item) -> RunResult: ...


@dataclass
class _Loaded:
    model: Any
    config: dict
    table: str
    audio_tokenizer: Any
    vocos: Any = None
    synthesizers: dict[tuple, Synthesizer] = field(default_factory=dict)  # per (language, prompt language)


class InferBackend:
    """valle.infer behind the page: the last ``max_models`` checkpoints stay loaded."""

    def __init__(self, device: torch.device, max_models: int = 2):
        self.device, self.max_models = device, max(1, max_models)
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()

    def _load(self, args: argparse.Namespace) -> _Loaded:
        key = str(Path(args.checkpoint).resolve())
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        while len(self._loaded) >= self.max_models:  # free memory before loading the next one
            self._loaded.popitem(last=False)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        started = time.monotonic()
        loaded = _Loaded(*load_for_synthesis(args, self.device))
        if args.decoder == "vocos":
            loaded.vocos = build_vocos(loaded.config, self.device, resolve_vocos(args), args)
        logger.info("loaded %s in %.1f s", args.checkpoint, time.monotonic() - started)
        self._loaded[key] = loaded
        return loaded

    def languages(self, args: argparse.Namespace) -> list[str]:
        """VALL-E X: the checkpoint's languages in id order; otherwise the server's --language."""
        from valle.data.languages import split_languages

        loaded = self._load(args)
        if getattr(loaded.model, "num_languages", 0):
            return split_languages(args.languages or loaded.config.get("languages")) or [args.language]
        return [args.language]

    def _synthesizer(self, loaded: _Loaded, args: argparse.Namespace) -> Synthesizer:
        key = (args.language, args.prompt_language or args.language, args.languages, args.text_extractor)
        if key not in loaded.synthesizers:
            synth = Synthesizer(loaded.model, loaded.table, loaded.audio_tokenizer, self.device,
                                language=args.language, prompt_language=args.prompt_language,
                                checkpoint_config=loaded.config, languages=args.languages,
                                text_extractor=args.text_extractor, decoder=loaded.vocos)  # fmt: skip
            loaded.synthesizers[key] = synth
        return loaded.synthesizers[key]

    def synthesize(self, args: argparse.Namespace, item: Item) -> RunResult:
        loaded = self._load(args)
        synth = self._synthesizer(loaded, args)
        check_text(synth, item, args)  # a refused text is a 400 on its field, not "no audio"
        return synthesize_items(synth, [item], args)


class WorkQueue:
    """One worker thread: jobs run one after another in arrival order; waiting costs no thread."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="synthesis")
        self._pending = 0
        self._count_lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        return self._pending

    def _submit(self, fn, *args) -> Future:
        with self._count_lock:
            self._pending += 1
        future = self._executor.submit(fn, *args)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: Future) -> None:
        with self._count_lock:
            self._pending -= 1

    async def run(self, fn, *args):
        return await asyncio.wrap_future(self._submit(fn, *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class ResultStore:
    """Wavs and spectrograms of the last ``keep`` results, under one directory."""

    def __init__(self, directory: Path, keep: int = 50):
        self.directory, self.keep = directory, max(1, keep)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._results: OrderedDict[str, Result] = OrderedDict()
        self._lock = threading.Lock()

    def new_dir(self) -> tuple[str, Path]:
        result_id = uuid.uuid4().hex
        path = self.directory / result_id
        path.mkdir()
        return result_id, path

    def add(self, result: Result) -> None:
        with self._lock:
            self._results[result.id] = result
            while len(self._results) > self.keep:
                _, old = self._results.popitem(last=False)
                shutil.rmtree(old.wav.parent, ignore_errors=True)

    def get(self, result_id: str) -> Result | None:
        with self._lock:
            return self._results.get(result_id)


def render_spectrogram(wav_path: Path, png_path: Path) -> None:
    """A log-magnitude spectrogram PNG of a wav (matplotlib's object API: no pyplot state, thread-safe)."""
    import soundfile as sf
    from matplotlib.figure import Figure

    wav, sr = sf.read(str(wav_path), dtype="float32", always_2d=True)
    wav = wav.mean(axis=1)
    n_fft, hop = 512, 128
    wav = np.pad(wav, (0, max(0, n_fft - len(wav))))
    frames = np.lib.stride_tricks.sliding_window_view(wav, n_fft)[::hop] * np.hanning(n_fft)
    db = 20 * np.log10(np.abs(np.fft.rfft(frames, axis=1)).T + 1e-5)
    fig = Figure(figsize=(8, 2.6), dpi=100)
    ax = fig.add_subplot()
    ax.imshow(db, origin="lower", aspect="auto", cmap="magma", vmin=db.max() - 80, vmax=db.max(),
              extent=(0, len(wav) / sr, 0, sr / 2000))  # fmt: skip
    ax.set_xlabel("time (s)")
    ax.set_ylabel("kHz")
    fig.tight_layout()
    fig.savefig(str(png_path))


class SynthesisService:
    """Checks a request, queues it, writes its wav and spectrogram."""

    def __init__(self, backend: Backend, base_args: argparse.Namespace, results: ResultStore,
                 queue: WorkQueue | None = None):  # fmt: skip
        self.backend, self.base_args, self.results = backend, base_args, results
        self.queue = queue or WorkQueue()

    def infer_args(self, checkpoint: Path, overrides: dict[str, Any] | None = None) -> argparse.Namespace:
        """The server's bin/infer.py arguments for this checkpoint and request, checked."""
        args = copy.copy(self.base_args)
        args.checkpoint = str(checkpoint)
        for name, value in (overrides or {}).items():
            setattr(args, name, value)
        decode_options(args)  # raises InputError for e.g. --num-candidates 0
        return args

    async def languages(self, checkpoint: Path) -> list[str]:
        return await self.queue.run(self.backend.languages, self.infer_args(checkpoint))

    async def synthesize(self, request: SynthesisRequest) -> Result:
        if not request.text.strip():
            raise InputError("the text to synthesise is empty")
        args = self.infer_args(request.checkpoint, request.overrides())
        result_id, out_dir = self.results.new_dir()
        wav = out_dir / "synthesis.wav"
        args.output_dir = str(out_dir)
        item = Item(request.prompt_text, str(request.prompt_wav), request.text, wav, "request")
        queued = time.monotonic()
        timing: dict[str, float] = {}

        def job() -> RunResult:
            timing["start"] = time.monotonic()
            return self.backend.synthesize(args, item)

        try:
            run = await self.queue.run(job)
            if run.failures:
                raise SynthesisFailed("; ".join(f.reason for f in run.failures))
            if not wav.is_file():
                raise SynthesisFailed("the model wrote no audio")
            elapsed = time.monotonic() - timing["start"]
            png = out_dir / "spectrogram.png"
            await asyncio.to_thread(render_spectrogram, wav, png)
        except BaseException:
            shutil.rmtree(out_dir, ignore_errors=True)
            raise
        import soundfile as sf

        result = Result(result_id, wav, png, sf.info(str(wav)).duration,
                        timing["start"] - queued, elapsed)  # fmt: skip
        self.results.add(result)
        return result

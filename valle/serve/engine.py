"""Synthesis for the page through ``valle.infer``: requests checked before they queue, decoded
in batches by one worker thread, models cached per checkpoint.

A request goes through two threads. The *admission* thread checks it (form values, text
script and length, prompt audio, checkpoint) and prepares it (text ids, prompt codes: the
frontend, ``Synthesizer.prepare``) while a slot of the bounded queue is held; a refusal never
waits for the model. The *synthesis* thread (``valle.serve.batcher``) decodes the queued jobs
that share a checkpoint, language and decoding options as one batch (``valle.engine``), each
row with its own seed. What varies per request is written into a copy of the server's
``bin/infer.py`` arguments, so every decoding flag keeps its meaning and its checks.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import hashlib
import itertools
import logging
import queue
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from valle.codec.constants import SAMPLE_RATE
from valle.engine import Failure, Prepared, codes_to_audio
from valle.infer import (
    build_vocos,
    check_text,
    decode_options,
    load_for_synthesis,
    resolve_vocos,
    unit_items,
    write_wav,
)
from valle.serve.batcher import Batcher, Cancelled, Job
from valle.serve.metrics import ServeMetrics
from valle.synthesizer import InputError, Item, Synthesizer

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
    spectrogram: Path  # drawn when first asked for (the page asks; API clients may not)
    seconds: float  # audio length
    waited: float  # seconds queued behind other requests
    elapsed: float  # seconds of synthesis
    batch_rows: int = 1  # rows of the batch it was decoded in


class ClientGone(RuntimeError):
    """The client disconnected before its result: the work was dropped."""


class RequestTimeout(RuntimeError):
    """The request ran past --request-timeout: the work was ended."""


@dataclass
class Admitted:
    """A checked, prepared request: what the synthesis thread decodes."""

    key: tuple  # requests with equal keys decode in one batch
    units: list[Prepared]  # one, or one per sentence (--split-sentences)
    seed: int | None
    context: Any = None  # the backend's (e.g. its Synthesizer and options)


class Backend(Protocol):
    """What the page needs from a model; ``InferBackend`` is the real one, tests pass fakes.

    ``languages``, ``check`` (refuse: raise ``InputError``) and ``admit`` (prepare) run on
    the admission thread, checks first; ``decode`` on the synthesis thread: one batch of
    admitted requests with equal keys, one list of outputs (a waveform or a ``Failure`` per
    unit) per request."""

    def languages(self, args: argparse.Namespace) -> list[str]: ...

    def check(self, args: argparse.Namespace, item: Item) -> None: ...

    def admit(self, args: argparse.Namespace, item: Item) -> Admitted: ...

    # optional: ``finish(batch, outputs)``, on a thread of its own while the next batch decodes

    def decode(self, batch: list[Admitted], should_stop) -> list[list[torch.Tensor | Failure]]: ...


@dataclass
class _Loaded:
    model: Any
    config: dict
    table: str
    audio_tokenizer: Any
    vocos: Any = None
    synthesizers: dict[tuple, Synthesizer] = field(default_factory=dict)  # per (language, prompt language)


class PromptCodeCache:
    """The codec with its ``encode`` remembered per waveform (by content): the page's example
    prompts, and a prompt uploaded again, are encoded once. Everything else is the codec's."""

    def __init__(self, codec, size: int = 64):
        self._codec, self._size = codec, size
        self._codes: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._codec, name)

    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        digest = hashlib.sha1(wav.detach().cpu().contiguous().numpy().tobytes())
        key = f"{tuple(wav.shape)}:{digest.hexdigest()}"
        with self._lock:
            if key in self._codes:
                self._codes.move_to_end(key)
                return self._codes[key]
        codes = self._codec.encode(wav)
        with self._lock:
            self._codes[key] = codes
            while len(self._codes) > self._size:
                self._codes.popitem(last=False)
        return codes


@dataclass
class _Context:
    synth: Synthesizer
    options: Any  # DecodeOptions
    continual: bool


class InferBackend:
    """valle.infer behind the page: the last ``max_models`` checkpoints stay loaded."""

    def __init__(self, device: torch.device, max_models: int = 2):
        self.device, self.max_models = device, max(1, max_models)
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()
        self._lock = threading.Lock()  # loading is the admission thread's; guard it anyway

    def _load(self, args: argparse.Namespace) -> _Loaded:
        key = str(Path(args.checkpoint).resolve())
        with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
                return self._loaded[key]
            while len(self._loaded) >= self.max_models:  # free memory before loading the next one
                self._loaded.popitem(last=False)  # a batch decoding with it keeps its reference
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            started = time.monotonic()
            model, config, table, codec = load_for_synthesis(args, self.device)
            loaded = _Loaded(model, config, table, PromptCodeCache(codec))
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

    def _synthesizer(self, loaded: _Loaded, args: argparse.Namespace) -> tuple[tuple, Synthesizer]:
        key = (args.language, args.prompt_language or args.language, args.languages, args.text_extractor)
        if key not in loaded.synthesizers:
            synth = Synthesizer(loaded.model, loaded.table, loaded.audio_tokenizer, self.device,
                                language=args.language, prompt_language=args.prompt_language,
                                checkpoint_config=loaded.config, languages=args.languages,
                                text_extractor=args.text_extractor, decoder=loaded.vocos)  # fmt: skip
            loaded.synthesizers[key] = synth
        return key, loaded.synthesizers[key]

    def check(self, args: argparse.Namespace, item: Item) -> None:
        """The checks ``bin/infer.py`` makes (a refused text is a 400 on its field): no model
        forward pass, only the checkpoint's config, symbol table and text frontend."""
        check_text(self._synthesizer(self._load(args), args)[1], item, args)

    def admit(self, args: argparse.Namespace, item: Item) -> Admitted:
        """A checked request prepared (text ids, prompt codes) and keyed for batching."""
        synth_key, synth = self._synthesizer(self._load(args), args)
        continual = bool(args.continual)
        units = [synth.prepare(unit, continual) for unit in unit_items(item, args)]
        options = decode_options(args)
        key = (str(Path(args.checkpoint).resolve()), synth_key, dataclasses.replace(options, seed=None),
               continual)  # fmt: skip
        return Admitted(key, units, options.seed, _Context(synth, options, continual))

    def decode(self, batch: list[Admitted], should_stop) -> list[list[torch.Tensor | Failure]]:
        ctx: _Context = batch[0].context
        units = [u for a in batch for u in a.units]
        seeds = [a.seed for a in batch for _ in a.units]
        outputs = ctx.synth.decode(units, continual=ctx.continual, options=ctx.options,
                                   row_seeds=seeds, should_stop=should_stop, to_audio=False)  # fmt: skip
        return _per_request(batch, outputs)

    def finish(self, batch: list[Admitted], outputs: list[list]) -> list[list[torch.Tensor | Failure]]:
        """Codes to audio for the requests still wanted, as one batch (valle.engine)."""
        synth = batch[0].context.synth
        flat = [o for per in outputs for o in per]
        codes = [o for o in flat if not isinstance(o, Failure)]
        wavs = iter(codes_to_audio(codes, synth.audio_tokenizer, synth.decoder))
        return _per_request(batch, [o if isinstance(o, Failure) else next(wavs) for o in flat])


def _per_request(batch: list[Admitted], flat: list) -> list[list]:
    """Outputs per unit, regrouped per request."""
    per_request, start = [], 0
    for a in batch:
        per_request.append(flat[start : start + len(a.units)])
        start += len(a.units)
    return per_request


def join_pieces(pieces: list[torch.Tensor | Failure], gap_seconds: float) -> torch.Tensor:
    """A request's sentences as one waveform, ``gap_seconds`` of silence between them; a failed
    piece is the request's ``SynthesisFailed``."""
    failed = [p for p in pieces if isinstance(p, Failure)]
    if failed:
        raise SynthesisFailed("; ".join(f.reason for f in failed))
    gap = torch.zeros(int(gap_seconds * SAMPLE_RATE))
    return torch.cat([x for k, w in enumerate(pieces) for x in ((gap, w) if k else (w,))])


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
    tmp = png_path.with_name(f".{png_path.name}.{threading.get_ident()}.tmp")
    fig.savefig(str(tmp), format="png")
    tmp.replace(png_path)  # drawn on first request: two at once never show half a file


class AdmissionThread:
    """One thread for the text frontend (espeak through phonemizer is not thread-safe), which
    runs every waiting check before any preparation: a bad request arriving behind good ones
    is refused without waiting for their prompts to be encoded."""

    CHECK, PREPARE = 0, 1

    def __init__(self):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="admission", daemon=True)
        self._thread.start()

    def submit(self, priority: int, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((priority, next(self._order), fn, args, future))
        return future

    def _loop(self) -> None:
        while True:
            _, _, fn, args, future = self._queue.get()
            if fn is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the request's own error, raised where it waits
                future.set_exception(e)

    def shutdown(self) -> None:
        self._queue.put((-1, -1, None, (), None))


class SynthesisService:
    """Checks a request, queues it, writes its wav (its spectrogram when first asked for).

    ``max_queue``: requests that may wait (None: about a minute of work, measured);
    ``request_timeout``: seconds after which a request is ended (None: never); ``window``
    and ``max_batch``: how long the synthesis thread gathers a batch, and its most rows.
    """

    def __init__(self, backend: Backend, base_args: argparse.Namespace, results: ResultStore, *,
                 max_queue: int | None = None, request_timeout: float | None = None,
                 window: float = 0.01, max_batch: int = 16):  # fmt: skip
        self.backend, self.base_args, self.results = backend, base_args, results
        self.request_timeout = request_timeout
        self.admission = AdmissionThread()
        self.metrics = ServeMetrics()
        finish = getattr(backend, "finish", None)
        self.batcher = Batcher(self._decode, max_queue=max_queue, window=window, max_batch=max_batch,
                               on_batch=self.metrics.observe_batch, finish=finish)  # fmt: skip
        self.metrics.watch(self.batcher)

    def _decode(self, batch: list[Admitted], should_stop):
        return self.backend.decode(batch, should_stop)

    def shutdown(self) -> None:
        self.batcher.shutdown()
        self.admission.shutdown()

    def infer_args(self, checkpoint: Path, overrides: dict[str, Any] | None = None) -> argparse.Namespace:
        """The server's bin/infer.py arguments for this checkpoint and request, checked."""
        args = copy.copy(self.base_args)
        args.checkpoint = str(checkpoint)
        for name, value in (overrides or {}).items():
            setattr(args, name, value)
        decode_options(args)  # raises InputError for e.g. --num-candidates 0
        return args

    async def _admit(self, priority: int, fn, *args):
        return await asyncio.wrap_future(self.admission.submit(priority, fn, *args))

    async def languages(self, checkpoint: Path) -> list[str]:
        return await self._admit(AdmissionThread.CHECK, self.backend.languages, self.infer_args(checkpoint))

    async def synthesize(self, request: SynthesisRequest, disconnected=None) -> Result:
        """``disconnected``: an async callable, true once the client has gone (its job is then
        dropped). Raises ``QueueFull``, ``InputError``, ``SynthesisFailed``, ``ClientGone``,
        ``RequestTimeout``."""
        if not request.text.strip():
            raise InputError("the text to synthesise is empty")
        arrived = time.monotonic()
        deadline = arrived + self.request_timeout if self.request_timeout else None
        ticket = self.batcher.reserve()  # a full queue refuses before any work
        try:
            args = self.infer_args(request.checkpoint, request.overrides())
            item = Item(request.prompt_text, str(request.prompt_wav), request.text, Path("-"), "request")
            await self._admit(AdmissionThread.CHECK, self.backend.check, args, item)
            admitted = await self._admit(AdmissionThread.PREPARE, self.backend.admit, args, item)
        except BaseException:
            ticket.release()
            raise
        job = Job(admitted.key, len(admitted.units), admitted, deadline, arrived=arrived)
        future = asyncio.wrap_future(self.batcher.submit(job, ticket))
        pieces = await self._collect(job, future, disconnected, deadline)
        elapsed = time.monotonic() - job.started
        result_id, out_dir = self.results.new_dir()
        wav_path = out_dir / "synthesis.wav"
        try:
            wav = join_pieces(pieces, args.sentence_gap)
            await asyncio.to_thread(write_wav, wav_path, wav)
        except BaseException:
            shutil.rmtree(out_dir, ignore_errors=True)
            raise
        result = Result(result_id, wav_path, out_dir / "spectrogram.png", wav.numel() / SAMPLE_RATE,
                        job.started - arrived, elapsed, job.batch_rows)  # fmt: skip
        self.results.add(result)
        return result

    async def _collect(self, job: Job, future, disconnected, deadline: float | None):
        """The job's outputs, or its end: the client left (dropped), or the deadline passed."""
        watcher = asyncio.ensure_future(_watch(disconnected)) if disconnected is not None else None
        try:
            waiting = {future} | ({watcher} if watcher is not None else set())
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if future in done:
                try:
                    return future.result()
                except Cancelled as e:
                    raise (RequestTimeout if e.reason == "timed_out" else ClientGone)(str(e)) from None
            if watcher is not None and watcher in done:
                self.batcher.cancel(job, "dropped")
                raise ClientGone("the client disconnected")
            self.batcher.cancel(job, "timed_out")
            raise RequestTimeout(f"no result within --request-timeout {self.request_timeout:g} s")
        finally:
            if watcher is not None:
                watcher.cancel()
            if not future.done():  # e.g. this task was cancelled: nobody will collect the job
                self.batcher.cancel(job, "dropped")
                future.cancel()


async def _watch(disconnected, every: float = 0.05) -> None:
    while not await disconnected():
        await asyncio.sleep(every)

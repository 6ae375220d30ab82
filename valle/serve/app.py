"""The FastAPI application: a static page (static/) and a small JSON API behind it.

Every error the page can cause comes back as JSON ``{"error": message, "field": name-or-null}``
with a 4xx status (503 with ``Retry-After`` when the queue is full), shown next to the form; a
traceback only reaches the server's log. ``/healthz`` and ``/metrics`` are for operators.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from valle.serve.batcher import QueueFull
from valle.serve.catalog import find_checkpoints, find_prompts, resolve_checkpoint, resolve_prompt
from valle.serve.engine import (
    ClientGone,
    RequestTimeout,
    SynthesisFailed,
    SynthesisRequest,
    SynthesisService,
    render_spectrogram,
)
from valle.synthesizer import InputError, is_prompt_file, read_prompt_file

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
MAX_UPLOAD_BYTES = 20 * 1024 * 1024  # a prompt is a few seconds; this is minutes of 24 kHz audio
TOP_K_OFF = -100  # what bin/infer.py (as lifeiteng's recipes) means by top-k off
TOP_K_OFF_WORDS = ("", "off")


class FieldError(InputError):
    """Bad input that belongs to one form field (the page shows it under that field)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass
class PageSettings:
    exp_dir: Path | None
    checkpoints: list[Path] = field(default_factory=list)  # --checkpoint: served beside exp-dir's
    prompt_dir: Path | None = None
    upload_dir: Path = Path("uploads")
    default_checkpoint: Path | None = None


CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the log and metrics do


def _error(status: int, message: str, field_name: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse({"error": message, "field": field_name}, status_code=status, headers=headers)


def outcome_of(exc: BaseException | None) -> str:
    """A synthesis request's outcome for the metrics and the log (docs/inference.md)."""
    if exc is None:
        return "ok"
    if isinstance(exc, (InputError, QueueFull, RequestValidationError)):
        return "refused"
    if isinstance(exc, (ClientGone, asyncio.CancelledError)):
        return "dropped"
    if isinstance(exc, RequestTimeout):
        return "timed_out"
    return "failed"


def status_of(exc: BaseException) -> int:
    """The status the error handlers below answer ``exc`` with (for the log line)."""
    for kind, status in ((InputError, 400), (QueueFull, 503), (ClientGone, CLIENT_GONE),
                         (RequestTimeout, 504), (SynthesisFailed, 422), (torch.OutOfMemoryError, 503)):  # fmt: skip
        if isinstance(exc, kind):
            return status
    return CLIENT_GONE if isinstance(exc, asyncio.CancelledError) else 500


def _install_error_handlers(app: FastAPI, service: SynthesisService) -> None:
    @app.exception_handler(InputError)
    async def input_error(_request: Request, exc: InputError):
        return _error(400, str(exc), getattr(exc, "field", None))

    @app.exception_handler(QueueFull)
    async def queue_full(_request: Request, exc: QueueFull):
        return _error(503, str(exc), headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(ClientGone)
    async def client_gone(_request: Request, exc: ClientGone):
        return _error(CLIENT_GONE, f"dropped: {exc}")

    @app.exception_handler(RequestTimeout)
    async def timed_out(_request: Request, exc: RequestTimeout):
        return _error(504, f"timed out: {exc}")

    @app.exception_handler(SynthesisFailed)
    async def no_audio(_request: Request, exc: SynthesisFailed):
        return _error(422, f"no audio: {exc}")

    @app.exception_handler(RequestValidationError)
    async def bad_form(request: Request, exc: RequestValidationError):
        if request.url.path == "/api/synthesize":  # refused before the route: counted here
            service.metrics.observe_request("refused", 0.0, status=400, error=str(exc.errors()[0]))
        first = exc.errors()[0]
        name = str(first.get("loc", ("", "?"))[-1])
        return _error(400, f"{name}: {first.get('msg', 'invalid value')}", name)

    @app.exception_handler(torch.OutOfMemoryError)
    async def out_of_memory(_request: Request, exc: torch.OutOfMemoryError):
        logger.warning("synthesis ran out of device memory: %s", str(exc).splitlines()[0])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next request starts from the cached models alone
        return _error(503, "out of GPU memory: try a shorter text or prompt, or fewer candidates")

    @app.exception_handler(Exception)
    async def crash(_request: Request, exc: Exception):
        logger.exception("synthesis page: unexpected error")
        return _error(500, f"internal error ({type(exc).__name__}: {exc}); the server log has details")


async def _save_upload(upload: UploadFile, upload_dir: Path) -> Path:
    """The uploaded prompt in a directory of its own (removed again when it is refused)."""
    path = upload_dir / uuid.uuid4().hex / Path(upload.filename or "prompt.wav").name
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        await _write_checked_upload(upload, path)
    except BaseException:
        shutil.rmtree(path.parent, ignore_errors=True)
        raise
    return path


async def _write_checked_upload(upload: UploadFile, path: Path) -> None:
    """Write the upload to ``path``; refuse it unless it is audio that soundfile can read."""
    import soundfile as sf

    name, size = path.name, 0
    with open(path, "wb") as out:
        while chunk := await upload.read(1 << 20):
            size += len(chunk)
            if size > MAX_UPLOAD_BYTES:
                raise FieldError("prompt", f"the prompt {name} is larger than "
                                           f"{MAX_UPLOAD_BYTES >> 20} MB: upload a few seconds of speech")  # fmt: skip
            out.write(chunk)
    if size == 0:
        raise FieldError("prompt", f"the prompt {name} is empty")
    if is_prompt_file(name):  # VALL-E X's codes + text ids: read as bin/infer.py reads it
        try:
            read_prompt_file(str(path), "the prompt")
        except InputError as e:
            raise FieldError("prompt", str(e)) from e
        return
    try:
        info = sf.info(str(path))
    except Exception as e:  # soundfile's message for "not audio" names its own reasons
        raise FieldError("prompt", f"the prompt {name} is not an audio file (wav, flac or ogg): "
                                   f"{str(e).split(': ', 1)[-1]}") from e  # fmt: skip
    if info.frames == 0:
        raise FieldError("prompt", f"the prompt {name} holds no samples")


def parse_top_k(value: str | None) -> int | None:
    """The page's top-k: "off" or empty is off (bin/infer.py's -100), a whole number is itself
    (<= 0 off as well, 1 greedy); None (not sent) keeps the server's default."""
    if value is None:
        return None
    if value.strip().lower() in TOP_K_OFF_WORDS:
        return TOP_K_OFF
    try:
        return int(value)
    except ValueError:
        raise FieldError("top_k", f"top_k: expected a whole number, 'off' or nothing, got {value!r}") from None


def shown_top_k(top_k: int) -> int | str:
    """How the page shows a top-k: "off" for every value that turns it off."""
    return "off" if top_k <= 0 else top_k


def create_app(service: SynthesisService, settings: PageSettings) -> FastAPI:
    app = FastAPI(title="VALL-E synthesis", docs_url="/api/docs", redoc_url=None)
    _install_error_handlers(app, service)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.router.add_event_handler("shutdown", service.shutdown)

    def checkpoints():
        return find_checkpoints(settings.exp_dir, settings.checkpoints)

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/api/options")
    async def options():
        entries = checkpoints()
        default = next((e.id for e in entries if e.path == settings.default_checkpoint),
                       entries[0].id if entries else None)  # fmt: skip
        args = service.base_args
        return {
            "checkpoints": [{"id": e.id} for e in entries],
            "default_checkpoint": default,
            # a VALL-E X .npz prompt has nothing to play (url null) and needs no transcript
            "prompts": [{"name": p.name, "transcript": p.transcript,
                         "url": f"/api/prompts/{p.name}" if p.is_audio else None}
                        for p in find_prompts(settings.prompt_dir)],  # fmt: skip
            "defaults": {"language": args.language, "top_k": shown_top_k(args.top_k), "top_p": args.top_p,
                         "temperature": args.temperature, "num_candidates": args.num_candidates,
                         "seed": args.seed},  # fmt: skip
            "queue": service.batcher.depth,
        }

    @app.get("/healthz")
    async def healthz():
        batcher = service.batcher
        body = {"status": "ok" if batcher.alive else "synthesis thread stopped", "queue": batcher.depth,
                "queue_limit": batcher.limit(), "running": batcher.running}  # fmt: skip
        return JSONResponse(body, status_code=200 if batcher.alive else 503)

    @app.get("/metrics")
    async def metrics():
        body, content_type = service.metrics.text()
        return Response(body, media_type=content_type)

    @app.get("/api/languages")
    async def languages(checkpoint: str):
        path = resolve_checkpoint(checkpoints(), checkpoint)
        found = await service.languages(path)
        return {"checkpoint": checkpoint, "languages": found}

    @app.get("/api/prompts/{name}")
    async def prompt_audio(name: str):
        return FileResponse(resolve_prompt(find_prompts(settings.prompt_dir), name).path)

    @app.post("/api/synthesize")
    async def synthesize(
        request: Request,
        checkpoint: str = Form(""),
        text: str = Form(""),
        prompt_text: str = Form(""),
        prompt: UploadFile | None = File(None),
        prompt_name: str = Form(""),
        language: str | None = Form(None),
        prompt_language: str | None = Form(None),
        top_k: str | None = Form(None),
        top_p: float | None = Form(None),
        temperature: float | None = Form(None),
        num_candidates: int | None = Form(None),
        seed: int | None = Form(None),
    ):
        """Every request counted by outcome and logged in one line (valle.serve.metrics)."""

        async def run():
            try:
                path = resolve_checkpoint(checkpoints(), checkpoint)
            except InputError as e:
                raise FieldError("checkpoint", str(e)) from e
            if not text.strip():
                raise FieldError("text", "type the text to synthesise")
            uploaded = prompt is not None and bool(prompt.filename)
            if not uploaded and not prompt_name:
                raise FieldError("prompt", "no prompt: upload a prompt wav or choose an example prompt")
            npz = is_prompt_file(prompt.filename if uploaded else prompt_name)
            if not prompt_text.strip() and not npz:  # a VALL-E X .npz carries its text ids
                raise FieldError("prompt_text", "type the transcript of the prompt audio")
            # FastAPI reads an empty field as not sent: the raw form tells "top_k=" (off) apart
            top_k_value = parse_top_k("" if top_k is None and "top_k" in await request.form() else top_k)
            if uploaded:
                prompt_wav = await _save_upload(prompt, settings.upload_dir)
            else:
                prompt_wav = resolve_prompt(find_prompts(settings.prompt_dir), prompt_name).path
            job = SynthesisRequest(path, prompt_wav, prompt_text, text, language or None,
                                   prompt_language or None, top_k_value, top_p, temperature,
                                   num_candidates, seed)  # fmt: skip
            try:
                result = await service.synthesize(job, request.is_disconnected)
            finally:
                if uploaded:
                    shutil.rmtree(prompt_wav.parent, ignore_errors=True)
            return {"id": result.id, "wav_url": f"/api/results/{result.id}/synthesis.wav",
                    "spectrogram_url": f"/api/results/{result.id}/spectrogram.png",
                    "duration": round(result.seconds, 3), "elapsed": round(result.elapsed, 3),
                    "waited": round(result.waited, 3), "batch_rows": result.batch_rows,
                    "checkpoint": checkpoint}  # fmt: skip

        started, fields = time.monotonic(), {"checkpoint": checkpoint, "text_chars": len(text)}
        try:
            body = await run()
        except BaseException as exc:
            service.metrics.observe_request(outcome_of(exc), time.monotonic() - started,
                                            status=status_of(exc), error=str(exc)[:200], **fields)  # fmt: skip
            raise
        service.metrics.observe_request("ok", time.monotonic() - started, status=200, id=body["id"],
                                        waited=body["waited"], elapsed=body["elapsed"],
                                        batch_rows=body["batch_rows"], **fields)  # fmt: skip
        return body

    @app.get("/api/results/{result_id}/{name}")
    async def result_file(result_id: str, name: str):
        result = service.results.get(result_id)
        files = {"synthesis.wav": result.wav, "spectrogram.png": result.spectrogram} if result else {}
        if name not in files:
            return _error(404, f"no result {result_id}/{name} (results are kept for the last requests only)")
        if name == "spectrogram.png" and not result.spectrogram.is_file():  # drawn when first asked for
            try:
                await asyncio.to_thread(render_spectrogram, result.wav, result.spectrogram)
            except FileNotFoundError:  # trimmed from the store meanwhile
                return _error(404, f"no result {result_id}/{name} (results are kept for the last requests only)")
        return FileResponse(files[name])

    return app

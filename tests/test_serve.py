"""bin/serve.py: the synthesis page's API on a tiny checkpoint, its batching queue, and the
page itself in a real headless Chromium (skipped, with the reason, where there is none).
The server under load, as a real process: tests/test_serve_load.py."""

from __future__ import annotations

import io
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")
pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx (the dev extra)")
sf = pytest.importorskip("soundfile")

from fastapi.testclient import TestClient  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "models"))
from models_testlib import tiny_model  # noqa: E402

from valle.infer import Failure  # noqa: E402
from valle.models import NUM_AUDIO_TOKENS  # noqa: E402
from valle.serve.app import PageSettings, create_app  # noqa: E402
from valle.serve.cli import create_app_from_args, parse_args  # noqa: E402
from valle.serve.engine import Admitted, ResultStore, SynthesisService  # noqa: E402

PROMPT_TEXT = "the quick brown fox"
TEXT = "jumps over the dog"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def _phonemes(text: str) -> list[str]:
    from valle.data.text import TextTokenizer

    return TextTokenizer(language="en-us")([text])[0]


def _save_checkpoint(model, config: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": "valle-checkpoint-1", "model": model.state_dict(), "model_avg": None,
                "step": 1, "epoch": 1, "batch_in_epoch": 1, "train_stage": 0, "config": config,
                "rng": {"numpy": np.random.get_state()}, "quarantine": []}, path)  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An exp dir with a tiny checkpoint (as tests/infer/test_cli.py makes it), a VALL-E X
    one, a file that is no checkpoint, and a prompt dir with one example prompt and its transcript."""
    from valle.data.symbols import SymbolTable

    tmp = tmp_path_factory.mktemp("serve")
    table = tmp / "unique_text_tokens.k2symbols"
    SymbolTable.from_symbols(sorted(set(_phonemes(f"{PROMPT_TEXT} {TEXT}")))).to_file(table)
    model = tiny_model("valle", 1, share_embedding=False)
    with torch.no_grad():  # EOS logit 0 against 1024 random ones: greedy decoding runs to the cap
        model.ar_predict_layer.weight[NUM_AUDIO_TOKENS] = 0.0
    config = dict(model.hparams, text_tokens=str(table), train_stage=0)
    exp = tmp / "exp"
    _save_checkpoint(model, config, exp / "best-valid-loss.pt")
    shutil.copy(exp / "best-valid-loss.pt", exp / "epoch-1.pt")
    multi = tiny_model("valle", 1, num_languages=2)
    _save_checkpoint(multi, dict(multi.hparams, text_tokens=str(table), languages=["en-us", "fr-fr"]),
                     exp / "x" / "epoch-2.pt")  # fmt: skip
    (exp / "broken.pt").write_bytes(b"not a checkpoint")
    prompts = tmp / "prompts"
    prompts.mkdir()
    prompt = prompts / "fox.wav"
    sf.write(str(prompt), np.random.default_rng(0).uniform(-0.3, 0.3, 24000).astype(np.float32), 24000)
    (prompts / "fox.txt").write_text(PROMPT_TEXT + "\n")
    return {"tmp": tmp, "exp": exp, "prompts": prompts, "prompt": prompt}


def _server_argv(served, **over) -> list[str]:
    flags = {"--exp-dir": served["exp"], "--prompt-dir": served["prompts"],
             "--results-dir": served["tmp"] / "results", "--top-k": 1, "--max-len-ratio": 1.0,
             "--device": "cpu"}  # fmt: skip
    flags.update(over)
    return [str(x) for kv in flags.items() for x in kv] + ["--allow-random-encodec"]


@pytest.fixture(scope="module")
def app(served):
    return create_app_from_args(*parse_args(_server_argv(served)))


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app, raise_server_exceptions=False)


def _post(client, prompt: Path | None = None, upload: tuple[str, bytes] | None = None, **fields):
    data = {"checkpoint": "best-valid-loss.pt", "text": TEXT, "prompt_text": PROMPT_TEXT}
    data.update({k: str(v) for k, v in fields.items()})
    files = None
    if prompt is not None:
        files = {"prompt": (prompt.name, prompt.read_bytes(), "audio/wav")}
    elif upload is not None:
        files = {"prompt": (upload[0], upload[1], "application/octet-stream")}
    return client.post("/api/synthesize", data=data, files=files)


def _check_wav(content: bytes) -> float:
    """A playable wav: RIFF/WAVE header, readable, non-empty; its duration in seconds."""
    assert content[:4] == b"RIFF" and content[8:12] == b"WAVE"
    wav, sr = sf.read(io.BytesIO(content))
    assert sr == 24000 and len(wav) > 0 and np.isfinite(wav).all()
    return len(wav) / sr


@pytest.mark.smoke
@pytest.mark.timeout(300)
def test_options_list_checkpoints_prompts_and_defaults(client):
    body = client.get("/api/options").json()
    ids = [c["id"] for c in body["checkpoints"]]
    assert ids == ["best-valid-loss.pt", "epoch-1.pt", "broken.pt", "x/epoch-2.pt"]
    assert body["default_checkpoint"] == "best-valid-loss.pt"
    assert body["prompts"] == [{"name": "fox.wav", "transcript": PROMPT_TEXT, "url": "/api/prompts/fox.wav"}]
    assert body["defaults"]["top_k"] == 1 and body["defaults"]["language"] == "en-us"
    assert client.get("/").text.count("<form") == 1
    _check_wav(client.get("/api/prompts/fox.wav").content)


@pytest.mark.timeout(300)
def test_languages_of_a_checkpoint(client):
    assert client.get("/api/languages", params={"checkpoint": "x/epoch-2.pt"}).json()["languages"] == [
        "en-us", "fr-fr"]  # fmt: skip
    assert client.get("/api/languages", params={"checkpoint": "epoch-1.pt"}).json()["languages"] == ["en-us"]


@pytest.mark.smoke
@pytest.mark.timeout(300)
def test_uploaded_prompt_gives_a_playable_wav_and_spectrogram(client, served):
    response = _post(client, prompt=served["prompt"], seed=3, num_candidates=2, temperature=0.9)
    assert response.status_code == 200, response.text
    body = response.json()
    seconds = _check_wav(client.get(body["wav_url"]).content)
    text_len = len(_phonemes(f"{PROMPT_TEXT} {TEXT}")) + 2  # + <bos>, <eos>; --max-len-ratio 1
    assert seconds == pytest.approx(text_len * 320 / 24000) == pytest.approx(body["duration"])
    png = client.get(body["spectrogram_url"])
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_language_auto_reads_each_sentence_by_its_script(client, served):
    response = _post(client, prompt=served["prompt"], language="auto", text=TEXT)
    assert response.status_code == 200, response.text
    assert _check_wav(client.get(response.json()["wav_url"]).content) > 0


@pytest.mark.timeout(300)
def test_example_prompt_by_name(client):
    response = _post(client, prompt_name="fox.wav", checkpoint="epoch-1.pt")
    assert response.status_code == 200, response.text
    assert _check_wav(client.get(response.json()["wav_url"]).content) > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fields, upload, field, message",
    [
        ({}, None, "prompt", "no prompt: upload a prompt wav or choose an example prompt"),
        ({}, ("notes.txt", b"these are words, not audio"), "prompt", "the prompt notes.txt is not an audio file"),
        ({}, ("empty.wav", b""), "prompt", "the prompt empty.wav is empty"),
        ({"text": "   "}, "ok", "text", "type the text to synthesise"),
        ({"prompt_text": ""}, "ok", "prompt_text", "type the transcript of the prompt audio"),
        ({"text": "zebra quartz"}, "ok", None, "unknown text symbol"),
        ({"checkpoint": "nope.pt"}, "ok", "checkpoint", "checkpoint nope.pt not found"),
        ({"checkpoint": "broken.pt"}, "ok", None, "broken.pt"),
        ({"prompt_name": "nobody.wav"}, None, None, "example prompt nobody.wav not found"),
        ({"num_candidates": 0}, "ok", None, "--num-candidates must be >= 1"),
        ({"top_k": "many"}, "ok", "top_k", "top_k: expected a whole number, 'off' or nothing, got 'many'"),
        ({"text": "你好世界，今天天气很好。"}, "ok", "text",
         "the text has Han letters ('你好世界今天气很') that the en-us voice cannot read as words"),
        ({"prompt_text": "Привет"}, "ok", "prompt_text", "the prompt's transcript has Cyrillic letters"),
        ({"text": "你好", "language": "auto"}, "ok", "text",
         "Han letters ('你好'): none of the languages that read it (cmn, yue"),
        ({"text": "jumps over the dog. " * 60}, "ok", "text",
         "more than this checkpoint takes in one piece (625: its longest training items"),
        ({"text": "jumps over the dog. " * 1250}, "ok", "text",  # counted until past the limit
         "the text is over 625 text tokens long (629 in its first 37 of 1250 sentences), more than"),
        ({"checkpoint": "x/epoch-2.pt", "language": "de"}, "ok", None,
         "--language de: not one of the model's languages"),
    ],
)
def test_bad_input_gets_its_message(client, served, fields, upload, field, message):
    prompt = served["prompt"] if upload == "ok" else None
    response = _post(client, prompt=prompt, upload=None if upload == "ok" else upload, **fields)
    assert response.status_code == 400, response.text
    body = response.json()
    assert message in body["error"] and "Traceback" not in body["error"]
    assert body["field"] == field
    uploads = served["tmp"] / "results" / "uploads"
    assert not uploads.exists() or not any(uploads.iterdir()), "a refused upload was left behind"


@pytest.mark.timeout(300)
def test_missing_result_is_a_json_404(client):
    response = client.get("/api/results/0123/synthesis.wav")
    assert response.status_code == 404 and "no result" in response.json()["error"]


def test_command_line_refuses_bad_flags_in_one_line(capsys):
    from valle.serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        parse_args([])
    assert exit_info.value.code == 2 and "give --exp-dir or --checkpoint" in capsys.readouterr().err
    assert main(["--exp-dir", "exp", "--num-candidates", "0"]) == 2
    assert "error: --num-candidates must be >= 1, got 0" in capsys.readouterr().err


class FakeBackend:
    """Admits every request (its arguments as the payload) and decodes each to a short wav."""

    def __init__(self):
        self.args, self.batches = [], []

    def languages(self, args):
        return [args.language]

    def check(self, args, item) -> None:
        pass

    def admit(self, args, item) -> Admitted:
        self.args.append(args)
        return Admitted(("fake",), [item], args.seed, args)

    def decode(self, batch, should_stop):
        self.batches.append(len(batch))
        return [[torch.full((2400,), 0.1)] for _ in batch]


class GatedFakeBackend(FakeBackend):
    """Holds the first batch until ``gate`` opens, so that the others queue behind it."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.gate, self.spans = seconds, threading.Event(), []

    def decode(self, batch, should_stop):
        assert self.gate.wait(60), "the test never opened the gate"
        start = time.monotonic()
        time.sleep(self.seconds)
        self.spans.append((start, time.monotonic()))
        return super().decode(batch, should_stop)


@pytest.mark.timeout(120)
def test_concurrent_requests_are_batched(served, tmp_path):
    backend = GatedFakeBackend(0.3)
    _, infer_args = parse_args(_server_argv(served))
    service = SynthesisService(backend, infer_args, ResultStore(tmp_path / "results"))
    app = create_app(service, PageSettings(exp_dir=served["exp"], prompt_dir=served["prompts"],
                                           upload_dir=tmp_path / "uploads"))  # fmt: skip
    client = TestClient(app, raise_server_exceptions=False)
    responses = [None] * 4

    def send(i: int) -> None:
        responses[i] = _post(client, prompt=served["prompt"], seed=i)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    threads[0].start()
    deadline = time.monotonic() + 60
    while service.batcher.running < 1:  # the first is decoding (held at the gate) ...
        assert time.monotonic() < deadline, "the first request never started"
        time.sleep(0.02)
    for t in threads[1:]:
        t.start()
    while service.batcher.depth < 3:  # ... while the other three queue behind it
        assert time.monotonic() < deadline, f"only {service.batcher.depth} requests reached the queue"
        time.sleep(0.02)
    backend.gate.set()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None and r.status_code == 200 for r in responses), responses
    assert backend.batches == [1, 3], "the three that came during the first batch form the next"
    spans = sorted(backend.spans)
    assert spans[1][0] >= spans[0][1], f"two batches overlapped: {spans}"
    bodies = [r.json() for r in responses]
    assert sorted(b["batch_rows"] for b in bodies) == [1, 3, 3, 3]
    waited = sorted(b["waited"] for b in bodies)
    assert waited[0] < 0.25 and waited[1] >= 0.25, waited  # the three waited for the first batch
    assert service.batcher.depth == 0 and service.batcher.running == 0
    metrics = client.get("/metrics").text
    assert 'valle_requests_total{outcome="ok"} 4.0' in metrics
    assert "valle_batch_rows_count 2.0" in metrics and "valle_batch_rows_sum 4.0" in metrics


class RecordingBackend(FakeBackend):
    """Keeps the arguments each synthesis ran with."""


@pytest.mark.timeout(120)
def test_top_k_off_or_empty_means_off(served, tmp_path):
    backend = RecordingBackend()
    _, infer_args = parse_args(_server_argv(served, **{"--top-k": -100}))
    service = SynthesisService(backend, infer_args, ResultStore(tmp_path / "results"))
    client = TestClient(create_app(service, PageSettings(exp_dir=served["exp"], upload_dir=tmp_path / "up")),
                        raise_server_exceptions=False)  # fmt: skip
    assert client.get("/api/options").json()["defaults"]["top_k"] == "off"  # not -100
    for sent, used in (("off", -100), ("", -100), ("OFF", -100), ("5", 5), ("0", 0)):
        response = _post(client, prompt=served["prompt"], top_k=sent)
        assert response.status_code == 200, response.text
        assert backend.args[-1].top_k == used, sent
    service.base_args.top_k = 3  # a field the client does not send keeps the server's value
    assert _post(client, prompt=served["prompt"]).status_code == 200 and backend.args[-1].top_k == 3


class BrokenBackend(FakeBackend):
    """Fails each synthesis the way a model can: no audio, out of memory, a bug."""

    def __init__(self, error):
        super().__init__()
        self.error = error

    def decode(self, batch, should_stop):
        if self.error is None:
            return [[Failure("request", "the AR model emitted EOS as its first token")] for _ in batch]
        raise self.error


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "error, status, message",
    [
        (None, 422, "no audio: the AR model emitted EOS as its first token"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 503, "out of GPU memory"),
        (RuntimeError("shape mismatch"), 500, "internal error (RuntimeError: shape mismatch)"),
    ],
)
def test_model_failures_are_messages(served, tmp_path, error, status, message):
    _, infer_args = parse_args(_server_argv(served))
    service = SynthesisService(BrokenBackend(error), infer_args, ResultStore(tmp_path / "results"))
    app = create_app(service, PageSettings(exp_dir=served["exp"], upload_dir=tmp_path / "uploads"))
    response = _post(TestClient(app, raise_server_exceptions=False), prompt=served["prompt"])
    assert response.status_code == status and message in response.json()["error"]
    assert not any((tmp_path / "results").iterdir()), "a failed result's directory was left behind"
    # the queue still serves the next request
    assert service.batcher.depth == 0 and service.batcher.alive
    outcome = "failed"
    assert f'valle_requests_total{{outcome="{outcome}"}} 1.0' in TestClient(app).get("/metrics").text


# ---------------------------------------------------------------- the page in a real browser
def _browser_or_skip():
    if not CHROMIUM.exists():
        pytest.skip(f"no browser: {CHROMIUM} is absent (.ci/run installs Debian's chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright for Python is not importable (the browser extra)")
    return sync_playwright


class LiveServer:
    """The app under uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start in 30 s"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.mark.timeout(300)
def test_page_in_headless_chromium(app, served, tmp_path):
    sync_playwright = _browser_or_skip()
    junk = tmp_path / "notes.txt"
    junk.write_text("these are words, not audio")
    with LiveServer(app) as live, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(120_000)
            page.goto(live.url + "/")
            page.wait_for_function("document.getElementById('checkpoint-status').textContent === 'loaded'")
            # the example prompt is chosen, its transcript filled in; top-k reads as a number or "off"
            assert page.input_value("#prompt-name") == "fox.wav"
            assert page.input_value("#prompt-text") == PROMPT_TEXT
            assert page.input_value("#top_k") == "1"
            page.fill("#text", "你好世界，今天天气很好。")
            page.click("#synthesize")
            page.wait_for_selector("#error:not([hidden])")
            assert "Han letters" in page.inner_text('.field-error[data-field="text"]')
            page.set_input_files("#prompt", str(served["prompt"]))
            page.fill("#prompt-text", PROMPT_TEXT)
            page.fill("#text", TEXT)
            page.click("#synthesize")
            page.wait_for_selector("#result:not([hidden])")
            # Chromium decoded the wav: its audio element knows the duration
            page.wait_for_function("document.getElementById('output').duration > 0")
            wav_url = page.get_attribute("#output", "src")
            fetched = page.request.get(live.url + wav_url if wav_url.startswith("/") else wav_url)
            assert fetched.ok
            assert _check_wav(fetched.body()) > 0
            page.wait_for_function("document.getElementById('spectrogram').naturalWidth > 0")
            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
            assert page.is_hidden("#error")

            page.set_input_files("#prompt", str(junk))
            page.click("#synthesize")
            page.wait_for_selector("#error:not([hidden])")
            assert "the prompt notes.txt is not an audio file" in page.inner_text("#error")
            assert "notes.txt" in page.inner_text('.field-error[data-field="prompt"]')
            page.screenshot(path=str(tmp_path / "page-error.png"), full_page=True)

            # a VALL-E X checkpoint offers its languages, for the text and for the prompt
            page.select_option("#checkpoint", "x/epoch-2.pt")
            page.wait_for_function(
                "document.getElementById('checkpoint-status').textContent.startsWith('multilingual')")
            assert page.is_visible("#prompt-language")
            assert page.eval_on_selector_all("#language option", "os => os.map(o => o.value)") == [
                "en-us", "fr-fr", "auto"]  # fmt: skip
        finally:
            browser.close()


@pytest.mark.timeout(300)
def test_lora_adapters_in_the_exp_dir_are_served_on_their_base(served, tmp_path):
    """A LoRA run's exp dir holds adapters alone: the page applies them to the base they
    recorded (bin/infer.py --lora semantics)."""
    from valle.models.lora import LoraConfig, apply_lora, base_fingerprint, lora_state_dict
    from valle.train.checkpoint import make_payload
    from valle.train.finetune import LoraRun

    model = tiny_model("valle", 1, share_embedding=False)
    with torch.no_grad():
        model.ar_predict_layer.weight[NUM_AUDIO_TOKENS] = 0.0
    config = dict(model.hparams, text_tokens=str(served["tmp"] / "unique_text_tokens.k2symbols"))
    base = tmp_path / "base" / "best-valid-loss.pt"
    _save_checkpoint(model, config, base)
    lora = LoraConfig(lora_rank=2)
    sha = base_fingerprint(model.state_dict())
    apply_lora(model, lora)
    exp = tmp_path / "exp-lora"
    exp.mkdir()
    torch.save(make_payload(model=lora_state_dict(model), step=2, epoch=1, train_stage=0,
                            config=config) | {"lora": LoraRun(lora, sha, str(base), None).entry()},
               exp / "best-valid-loss.pt")
    app = create_app_from_args(*parse_args(_server_argv(served, **{"--exp-dir": exp})))
    response = _post(TestClient(app, raise_server_exceptions=False), prompt_name="fox.wav")
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------- the batcher alone
def _batcher(decode, **kw):
    from valle.serve.batcher import Batcher

    return Batcher(decode, window=0.05, **kw)


@pytest.mark.timeout(60)
def test_batcher_groups_by_key_drops_cancelled_and_stops_running_rows():
    from valle.serve.batcher import Cancelled, Job

    started, release, seen, stops = threading.Event(), threading.Event(), [], []

    def decode(payloads, should_stop):
        seen.append(list(payloads))
        if payloads[0] == "hold":
            started.set()
            assert release.wait(30)
            stops.append(should_stop())  # a step after the client left: its rows read True
        return [f"{p}!" for p in payloads]

    batcher = _batcher(decode)
    try:
        held = Job("a", 2, "hold")
        batcher.submit(held, batcher.reserve())
        assert started.wait(30)
        queued = [Job("a", 1, "a1"), Job("b", 1, "b1"), Job("a", 1, "a2"), Job("a", 1, "gone")]
        for job in queued:
            batcher.submit(job, batcher.reserve())
        assert batcher.depth == 4 and batcher.running == 1
        assert batcher.cancel(queued[3], "dropped")  # queued: out at once, never decoded
        assert batcher.depth == 3
        with pytest.raises(Cancelled, match="dropped"):
            queued[3].future.result(timeout=1)
        assert batcher.cancel(held, "dropped")  # decoding: its rows are flagged for the next step
        release.set()
        with pytest.raises(Cancelled):
            held.future.result(timeout=30)
        assert stops[0].tolist() == [True, True]
        assert [j.future.result(timeout=30) for j in queued[:3]] == ["a1!", "b1!", "a2!"]
        # the same key together (oldest first), the other key in a batch of its own
        assert seen[1:] == [["a1", "a2"], ["b1"]]
    finally:
        batcher.shutdown()


@pytest.mark.timeout(60)
def test_batcher_bounds_its_queue_and_ends_work_past_its_deadline():
    from valle.serve.batcher import Cancelled, Job, QueueFull

    release = threading.Event()
    batcher = _batcher(lambda payloads, stop: [release.wait(30) and p for p in payloads], max_queue=2)
    try:
        first = Job("a", 1, "first")
        batcher.submit(first, batcher.reserve())
        deadline = time.monotonic() + 30
        while batcher.running < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        late = Job("a", 1, "late", deadline=time.monotonic() + 0.05)
        batcher.submit(late, batcher.reserve())
        ticket = batcher.reserve()  # a request being checked holds its slot too
        with pytest.raises(QueueFull) as full:
            batcher.reserve()
        assert full.value.retry_after >= 1 and "2 requests queued" in str(full.value)
        ticket.release()
        time.sleep(0.1)
        release.set()
        assert first.future.result(timeout=30) == "first"
        with pytest.raises(Cancelled, match="timed_out"):  # nobody waits for it any more
            late.future.result(timeout=30)
        assert batcher.depth == 0
    finally:
        batcher.shutdown()


@pytest.mark.timeout(60)
def test_batcher_skips_a_job_whose_waiter_went_away():
    from valle.serve.batcher import Job

    release, seen = threading.Event(), []

    def decode(payloads, stop):
        seen.append(list(payloads))
        assert release.wait(30)
        return payloads

    batcher = _batcher(decode)
    try:
        first = Job("a", 1, "first")
        batcher.submit(first, batcher.reserve())
        while batcher.running < 1:
            time.sleep(0.01)
        orphan, expired = Job("a", 1, "orphan"), Job("a", 1, "expired", deadline=time.monotonic())
        later = Job("a", 1, "later")
        for job in (orphan, expired, later):
            batcher.submit(job, batcher.reserve())
        orphan.future.cancel()  # its waiter was cancelled without telling the batcher
        expired.future.cancel()
        release.set()
        assert later.future.result(timeout=30) == "later" and batcher.alive
        assert seen == [["first"], ["later"]]
    finally:
        batcher.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sampling", [{}, {"top_k": "off", "temperature": 1.0}])
def test_a_request_batched_with_others_gives_what_it_gives_alone(served, sampling):
    """Greedy, and sampled with each request's seed: three requests decoded as one batch give the
    audio each gives alone (EnCodec decodes the padded batch: equal to float tolerance)."""
    argv = _server_argv(served, **{"--batch-window": 2.0})  # all three arrive within the window
    client = TestClient(create_app_from_args(*parse_args(argv)), raise_server_exceptions=False)
    texts = [TEXT, "the dog", "over the quick fox"]

    def send(i, out):
        out[i] = _post(client, prompt_name="fox.wav", text=texts[i], seed=10 + i, **sampling)

    together = [None] * 3
    threads = [threading.Thread(target=send, args=(i, together)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    alone = [None] * 3
    for i in range(3):
        send(i, alone)
    for a, b in zip(together, alone):
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["batch_rows"] == 3 and b.json()["batch_rows"] == 1
        wav_a, _ = sf.read(io.BytesIO(client.get(a.json()["wav_url"]).content))
        wav_b, _ = sf.read(io.BytesIO(client.get(b.json()["wav_url"]).content))
        assert wav_a.shape == wav_b.shape and np.allclose(wav_a, wav_b, atol=1e-3)
    assert not np.allclose(*(sf.read(io.BytesIO(client.get(r.json()["wav_url"]).content))[0][:2000]
                             for r in together[:2]))  # fmt: skip

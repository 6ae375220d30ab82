"""bin/serve.py under load: a real server process on a free port of 127.0.0.1, driven by httpx
clients, every step with a timeout. Impatient clients cost nothing once gone, bad input is
refused without waiting behind good work, a full queue answers 503 with Retry-After, memory
and the result store stay bounded over 500 requests, and the server is alive at the end."""

from __future__ import annotations

import importlib.util
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")
pytest.importorskip("prometheus_client", reason="the serve extra is not installed (pip install -e '.[serve]')")
httpx = pytest.importorskip("httpx", reason="the dev extra is not installed")

_spec = importlib.util.spec_from_file_location(
    "bench_serve", Path(__file__).resolve().parents[1] / "scripts" / "bench_serve.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_serve"] = bench
_spec.loader.exec_module(bench)

MAX_QUEUE, KEEP = 12, 20
LONG = " ".join([bench.TEXT] * 8)  # several times the work of one TEXT
WARM_UP, REQUESTS, RSS_MARGIN_MB = 200, 500, 48  # no growth past this after the warm-up

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    exp = bench.make_exp(tmp_path_factory.mktemp("load"))
    with bench.ServerProcess(exp, "--max-queue", str(MAX_QUEUE), "--keep-results", str(KEEP),
                             "--request-timeout", "30", "--max-len-ratio", "0.2") as live:  # fmt: skip
        live.exp = exp
        yield live


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(valle_[^ ]+) ([0-9.e+-]+)$", text, re.MULTILINE)}  # fmt: skip


def _outcome(metrics: dict[str, float], outcome: str) -> float:
    return metrics.get(f'valle_requests_total{{outcome="{outcome}"}}', 0.0)


def _post(url: str, timeout: float = 60.0, **kw):
    with httpx.Client(base_url=url) as client:
        try:
            return bench.post(client, timeout=timeout, **kw)
        except httpx.TimeoutException:
            return None  # the impatient client gave up


@pytest.mark.timeout(120)
def test_impatient_clients_cost_nothing_once_gone(server):
    assert _post(server.url).status_code == 200  # the model is loaded
    before = _metrics(server.url)
    burst = 24
    with ThreadPoolExecutor(burst) as pool:  # they give up after 0.3 s: a reloaded page, a script
        answers = list(pool.map(lambda _: _post(server.url, timeout=0.3, text=LONG), range(burst)))
    deadline = time.monotonic() + 30  # every one of them is accounted for (dropped, refused or served)
    while True:
        after = _metrics(server.url)
        counted = sum(_outcome(after, o) - _outcome(before, o) for o in ("ok", "dropped", "refused"))
        if counted >= burst:
            break
        assert time.monotonic() < deadline, f"{counted} of {burst} impatient requests accounted for"
        time.sleep(0.1)
    gave_up = sum(a is None for a in answers)
    assert gave_up > 0
    assert _outcome(after, "dropped") - _outcome(before, "dropped") >= 1
    rows = after["valle_batch_rows_sum"] - before["valle_batch_rows_sum"]
    assert rows < burst, "every abandoned request was decoded anyway"
    started = time.monotonic()
    patient = _post(server.url, timeout=30)
    assert patient.status_code == 200, patient.text
    assert time.monotonic() - started < 10 and patient.json()["waited"] < 2.0, patient.json()


@pytest.mark.timeout(120)
def test_bad_input_behind_good_work_is_refused_fast(server):
    good: list = []
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_post, server.url, 60.0, text=LONG) for _ in range(8)]
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/healthz", timeout=10).json()["queue"] + \
                httpx.get(server.url + "/healthz", timeout=10).json()["running"] < 4:  # fmt: skip
            assert time.monotonic() < deadline, "the good requests never queued"
            time.sleep(0.02)
        for fields, field, message in (
            ({"text": bench.HAN}, "text", "Han letters"),
            ({"text": "jumps over the dog. " * 1250}, "text", "over 625 text tokens long"),
            ({"checkpoint": "nope.pt"}, "checkpoint", "not found"),
            ({"prompt_name": "nobody.wav"}, None, "example prompt nobody.wav not found"),
        ):
            started = time.monotonic()
            response = _post(server.url, 10.0, **fields)
            took = time.monotonic() - started
            assert response.status_code == 400 and message in response.json()["error"], response.text
            assert response.json()["field"] == field
            assert took < 2.0, f"{fields}: refused after {took:.2f} s"
        good = [f.result(timeout=60) for f in futures]
    assert all(r.status_code == 200 for r in good), [r.text for r in good]


@pytest.mark.timeout(120)
def test_a_full_queue_answers_503_with_retry_after(server):
    n = MAX_QUEUE + 12
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda _: _post(server.url, 60.0, text=LONG), range(n)))
    full = [a for a in answers if a.status_code == 503]
    assert full and all(a.status_code in (200, 503) for a in answers), [a.text for a in answers]
    assert int(full[0].headers["Retry-After"]) >= 1
    assert "the server is busy" in full[0].json()["error"] and "try again in about" in full[0].json()["error"]
    assert sum(a.status_code == 200 for a in answers) >= MAX_QUEUE


@pytest.mark.timeout(240)
def test_500_requests_keep_memory_and_results_bounded(server):
    results = server.exp["tmp"] / f"results-{server.port}" / "results"
    sent, lock = {"n": 0, "rss": []}, threading.Lock()

    def client(_):
        with httpx.Client(base_url=server.url) as c:
            while True:
                with lock:
                    if sent["n"] >= REQUESTS:
                        return
                    sent["n"] += 1
                    if sent["n"] == WARM_UP:  # full batches seen: the allocator holds their peak
                        sent["rss"].append(server.rss_mb())
                response = bench.post(c, timeout=60)
                assert response.status_code in (200, 503), response.text
                if response.status_code == 503:
                    time.sleep(0.1)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(client, range(16)))
    rss_warm, rss_end = sent["rss"][0], server.rss_mb()
    assert rss_end - rss_warm < RSS_MARGIN_MB, f"RSS grew from {rss_warm:.0f} MB to {rss_end:.0f} MB after warm-up"
    kept = [p for p in results.iterdir() if p.is_dir()]
    assert len(kept) <= KEEP, f"{len(kept)} results kept, --keep-results {KEEP}"


@pytest.mark.timeout(60)
def test_the_server_is_alive_at_the_end(server):
    health = httpx.get(server.url + "/healthz", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert _post(server.url, 30.0).status_code == 200
    metrics = _metrics(server.url)
    assert metrics["valle_queue_depth"] == 0
    assert _outcome(metrics, "failed") == 0 and _outcome(metrics, "timed_out") == 0
    assert server.proc.poll() is None

#!/usr/bin/env python
"""The synthesis server under load (bin/serve.py as a real process on 127.0.0.1, httpx clients).

On a tiny checkpoint (the test suite's: 2 layers of 32, random weights, greedy, one frame per
text token) and the example prompt:

* one client, one request after another: requests/s and the median latency;
* 16 clients at once: requests/s, against one client (the batching gain);
* the same two with ``--max-batch 1`` (one request at a time, as before batching);
* refusals with a full queue: the 503 of a full queue, and a bad text (Han letters under
  en-us) behind good work, seconds from request to answer.

Beside requests/s (wall time: other work on the cores slows it), the server's own CPU time per
request, which the machine's load hardly changes.

``--repo DIR`` serves from another checkout (e.g. the main branch before this server) for the
first two rows. Helpers here (``make_exp``, ``ServerProcess``, ``post``) are shared with
tests/test_serve_load.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TEXT = "the quick brown fox"
TEXT = "jumps over the dog"
HAN = "你好世界，今天天气很好。"


def make_exp(tmp: Path) -> dict[str, Path]:
    """An exp dir with a tiny checkpoint whose AR never says EOS (every request decodes one frame
    per text token: equal work), a prompt dir with one example prompt and its transcript."""
    import numpy as np
    import soundfile as sf
    import torch

    from valle.data.symbols import SymbolTable
    from valle.data.text import TextTokenizer
    from valle.models import NUM_AUDIO_TOKENS, get_model

    tmp.mkdir(parents=True, exist_ok=True)
    table = tmp / "unique_text_tokens.k2symbols"
    symbols = TextTokenizer(language="en-us")([f"{PROMPT_TEXT} {TEXT}"])[0]
    SymbolTable.from_symbols(sorted(set(symbols))).to_file(table)
    torch.manual_seed(0)
    model = get_model(dict(model_name="valle", decoder_dim=32, nhead=4, num_decoder_layers=2,
                           scale_factor=1.0, norm_first=True, add_prenet=False, prefix_mode=1,
                           share_embedding=False, prepend_bos=False, num_quantizers=8,
                           num_text_tokens=40, dropout=0.0))  # fmt: skip
    with torch.no_grad():  # EOS logit 0 against 1024 random ones: greedy decoding runs to the cap
        model.ar_predict_layer.weight[NUM_AUDIO_TOKENS] = 0.0
    config = dict(model.hparams, text_tokens=str(table), train_stage=0)
    exp = tmp / "exp"
    exp.mkdir(exist_ok=True)
    torch.save({"format": "valle-checkpoint-1", "model": model.state_dict(), "model_avg": None,
                "step": 1, "epoch": 1, "batch_in_epoch": 1, "train_stage": 0, "config": config,
                "rng": {"numpy": np.random.get_state()}, "quarantine": []},
               exp / "best-valid-loss.pt")  # fmt: skip
    prompts = tmp / "prompts"
    prompts.mkdir(exist_ok=True)
    sf.write(str(prompts / "fox.wav"),
             np.random.default_rng(0).uniform(-0.3, 0.3, 24000).astype(np.float32), 24000)  # fmt: skip
    (prompts / "fox.txt").write_text(PROMPT_TEXT + "\n")
    return {"tmp": tmp, "exp": exp, "prompts": prompts}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``bin/serve.py`` of ``repo`` as a child process on a free port of 127.0.0.1; its log in
    ``log``. Started: /healthz (or, for an older server, /api/options) answers."""

    def __init__(self, exp: dict[str, Path], *flags: str, repo: Path = ROOT, log: Path | None = None,
                 start_timeout: float = 120.0):  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or exp["tmp"] / f"serve-{self.port}.log"
        argv = [sys.executable, str(repo / "bin" / "serve.py"), "--exp-dir", str(exp["exp"]),
                "--prompt-dir", str(exp["prompts"]), "--results-dir", str(exp["tmp"] / f"results-{self.port}"),
                "--port", str(self.port), "--device", "cpu", "--allow-random-encodec", "--top-k", "1",
                "--max-len-ratio", "1", *flags]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(repo))
        self.start_timeout = start_timeout
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env)

    def __enter__(self) -> ServerProcess:
        import httpx

        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/api/options", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer in {self.start_timeout:g} s")
            time.sleep(0.2)

    def cpu_seconds(self) -> float:
        """CPU time the server process has used (all its threads): what a request costs it,
        whatever else runs on the machine."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            line = next(ln for ln in f if ln.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._out.close()


def post(client, text: str = TEXT, timeout: float = 300.0, **fields):
    data = {"checkpoint": "best-valid-loss.pt", "text": text, "prompt_text": PROMPT_TEXT,
            "prompt_name": "fox.wav", **{k: str(v) for k, v in fields.items()}}  # fmt: skip
    return client.post("/api/synthesize", data=data, timeout=timeout)


def timed_post(client, **kw) -> tuple[float, int]:
    started = time.monotonic()
    response = post(client, **kw)
    return time.monotonic() - started, response.status_code


def sequential(url: str, n: int, server: ServerProcess) -> tuple[float, float, float]:
    """(requests/s, median seconds per request, server CPU seconds per request) of one client."""
    import httpx

    with httpx.Client(base_url=url) as client:
        assert post(client).status_code == 200  # warm-up: the model loads
        cpu = server.cpu_seconds()
        took = []
        for _ in range(n):
            seconds, status = timed_post(client)
            assert status == 200, status
            took.append(seconds)
    return n / sum(took), statistics.median(took), (server.cpu_seconds() - cpu) / n


def concurrent(url: str, clients: int, per_client: int, server: ServerProcess) -> tuple[float, float]:
    """(requests/s, server CPU seconds per request) of ``clients`` clients, each sending
    ``per_client`` requests one after another."""
    import httpx

    def one_client(_):
        with httpx.Client(base_url=url) as client:
            for _ in range(per_client):
                assert post(client).status_code == 200
    with httpx.Client(base_url=url) as client:
        assert post(client).status_code == 200
    started, cpu = time.monotonic(), server.cpu_seconds()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one_client, range(clients)))
    n = clients * per_client
    return n / (time.monotonic() - started), (server.cpu_seconds() - cpu) / n


def refusals(url: str, busy: int) -> dict[str, list[float]]:
    """Seconds to a 503 (queue full) and to a 400 (Han text) while ``busy`` clients keep the
    queue full."""
    import httpx

    out: dict[str, list[float]] = {"full": [], "bad": []}
    with httpx.Client(base_url=url) as client:
        assert post(client).status_code == 200
    stop = threading.Event()

    def keep_busy(_):
        with httpx.Client(base_url=url) as client:
            while not stop.is_set():
                post(client, text=" ".join([TEXT] * 6))

    with ThreadPoolExecutor(busy) as pool:
        for i in range(busy):
            pool.submit(keep_busy, i)
        with httpx.Client(base_url=url) as client:
            time.sleep(2.0)
            for _ in range(10):
                seconds, status = timed_post(client)
                if status == 503:
                    out["full"].append(seconds)
                seconds, status = timed_post(client, text=HAN)
                if status in (400, 503):
                    out["bad"].append(seconds)
                time.sleep(0.05)
        stop.set()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, default=None, help="also measure bin/serve.py of this checkout")
    p.add_argument("--requests", type=int, default=40, help="requests of the one-client runs")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--per-client", type=int, default=8)
    args = p.parse_args()
    load = os.getloadavg()[0]  # other work on the cores slows every row alike, not the ratios
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        exp = make_exp(tmp)
        rows = []
        setups = [("this checkout", ROOT, ()), ("this checkout, --max-batch 1", ROOT, ("--max-batch", "1"))]
        if args.repo is not None:
            setups.append((f"{args.repo} (before)", args.repo.resolve(), ()))
        for name, repo, flags in setups:
            with ServerProcess(exp, *flags, repo=repo) as server:
                rate1, median, cpu1 = sequential(server.url, args.requests, server)
                rate16, cpu16 = concurrent(server.url, args.clients, args.per_client, server)
            rows.append((name, rate1, median, cpu1, rate16, cpu16))
        print(f"tiny checkpoint, example prompt, {TEXT!r}; {os.cpu_count()} CPU cores, OMP_NUM_THREADS="
              f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, load average {load:.1f} at the start\n")  # fmt: skip
        n = args.clients
        print(f"| server | 1 client: requests/s | median latency | CPU per request | {n} clients: "
              f"requests/s | CPU per request | {n} clients / 1 client: requests/s | CPU per request |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, rate1, median, cpu1, rate16, cpu16 in rows:
            print(f"| {name} | {rate1:.1f} | {median * 1000:.0f} ms | {cpu1 * 1000:.0f} ms | {rate16:.1f} | "
                  f"{cpu16 * 1000:.0f} ms | {rate16 / rate1:.2f}x | {cpu1 / cpu16:.2f}x less |")  # fmt: skip
        with ServerProcess(exp, "--max-queue", "4", "--max-batch", "4") as server:
            found = refusals(server.url, 24)
        print()
        print("| refusal with a full queue (--max-queue 4 --max-batch 4, 24 clients keeping it full) "
              "| answers | median | max |")  # fmt: skip
        print("| --- | --- | --- | --- |")
        for what, label in (("full", "503 queue full"), ("bad", "Han text under en-us")):
            took = found[what]
            if took:
                print(f"| {label} | {len(took)} | {statistics.median(took) * 1000:.0f} ms | "
                      f"{max(took) * 1000:.0f} ms |")  # fmt: skip
            else:
                print(f"| {label} | 0 | - | - |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

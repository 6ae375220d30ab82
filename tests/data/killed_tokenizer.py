"""bin/tokenizer.py that SIGKILLs itself mid-chunk, for the kill-and-relaunch tests.

Run as ``python killed_tokenizer.py ARGS...`` (or as torchrun's entry point) instead of
bin/tokenizer.py. With ``KILL_CHUNK=N`` set, chunk N is killed this way:

* its audio DataLoader worker 1 is slow: it writes its pid to ``KILL_PIDS`` and sleeps
  (a long file being decoded when the parent dies: torch's own watchdog never runs);
* the parent, at the chunk's first ``store_codes`` (the chunk file open, one batch
  encoded), waits for that pid and SIGKILLs itself.

``KILL_RANK=R`` limits the kill to torchrun's rank R, and only the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) is killed: the restart runs clean. Without
``KILL_CHUNK`` this is bin/tokenizer.py. The hooks patch names that exist in old and new
code alike, so the tests also run against the code before the fix.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLEEP = 120.0  # the slow worker's sleep: far longer than a relaunch takes to reach the chunk


def _armed() -> bool:
    if "KILL_CHUNK" not in os.environ:
        return False
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    return os.environ.get("KILL_RANK") in (None, os.environ.get("RANK", "0"))


def install() -> None:
    import torch

    from valle.data import codes, pipeline

    target = f"chunk-{int(os.environ['KILL_CHUNK']):06d}"
    pids = Path(os.environ["KILL_PIDS"])
    state = {"chunk": ""}

    real_encode = pipeline.PartTokenizer.encode_chunk

    def encode_chunk(self, cuts, storage_path, *args, **kwargs):
        state["chunk"] = Path(storage_path).name  # forked workers inherit it
        return real_encode(self, cuts, storage_path, *args, **kwargs)

    real_getitem = pipeline.AudioLoadDataset.__getitem__

    def getitem(self, i):
        info = torch.utils.data.get_worker_info()
        if target in state["chunk"] and info is not None and info.id == 1:
            with open(pids, "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(SLEEP)
        return real_getitem(self, i)

    real_store = codes.store_codes

    def store_codes(*args, **kwargs):
        if target in state["chunk"]:
            deadline = time.monotonic() + 60
            while not (pids.is_file() and pids.read_text().strip()) and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_store(*args, **kwargs)

    pipeline.PartTokenizer.encode_chunk = encode_chunk
    pipeline.AudioLoadDataset.__getitem__ = getitem
    codes.store_codes = store_codes


def main() -> int:
    sys.path.insert(0, str(ROOT))
    if _armed():
        install()
    spec = importlib.util.spec_from_file_location("valle_bin_tokenizer", ROOT / "bin" / "tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

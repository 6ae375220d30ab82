"""Progress for long data jobs: a tqdm bar on a terminal, and log lines every ``interval``
seconds whatever the output is (a batch job's log file shows rate and ETA too)."""

from __future__ import annotations

import logging
import time


def _hms(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, desc: str, logger: logging.Logger, interval: float = 30.0,
                 done: int = 0) -> None:
        from tqdm import tqdm

        self.total, self.desc, self.logger, self.interval = total, desc, logger, interval
        self.start_done = self.done = done
        self.audio_s = 0.0
        self.t0 = self.last_log = time.monotonic()
        self.bar = tqdm(total=total, initial=done, desc=desc, unit="cut", disable=None)

    def update(self, items: int, audio_seconds: float = 0.0) -> None:
        self.done += items
        self.audio_s += audio_seconds
        self.bar.update(items)
        now = time.monotonic()
        if now - self.last_log >= self.interval:
            self.last_log = now
            self.logger.info("%s", self.line())

    def line(self) -> str:
        elapsed = max(1e-9, time.monotonic() - self.t0)
        rate = (self.done - self.start_done) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_s = _hms(eta) if eta != float("inf") else "?"
        return (f"{self.desc}: {self.done}/{self.total} cuts, {rate:.1f} items/s, "
                f"{self.audio_s / 3600 / elapsed:.4f} h audio/s ({self.audio_s / elapsed:.1f}x real time), "
                f"ETA {eta_s}")

    def close(self) -> None:
        self.bar.close()
        self.logger.info("%s (done)", self.line())

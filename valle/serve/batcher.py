"""The server's decoding queue: jobs wait in a bounded queue; one worker thread gathers those
that can be decoded together (same checkpoint, language and decoding options) into a batch.

* **Bounded.** A slot is reserved before a request is checked and prepared; when the queue is
  full ``reserve`` raises ``QueueFull`` with a retry delay (the server answers 503). ``auto``
  bounds it at about ``AUTO_QUEUE_SECONDS`` of work at the measured speed.
* **Gathering.** The worker waits up to ``window`` seconds after the oldest job was queued,
  while other requests are being checked (they may join; a lone request starts at once) and
  the batch is not full, then takes every queued job of that job's group, oldest first, up to
  ``max_batch`` rows. Jobs that arrive while a batch decodes join the next one.
* **Pipelined.** With a ``finish`` stage (codes to audio), a second thread runs it for one
  batch while the worker decodes the next: the model's steps (short ops, Python between them)
  and the codec's large convolutions share the cores instead of taking turns.
* **Abandoned work.** ``cancel`` removes a queued job at once; a job being decoded has its rows
  flagged in the batch's ``gone`` mask, which the decoder reads before every step (the rows then
  stop). A job past its deadline is treated the same way, by the worker itself.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

AUTO_QUEUE_SECONDS = 60.0  # --max-queue auto: about this much work may wait
AUTO_QUEUE_START = 64  # ... before a batch has been timed
AUTO_QUEUE_FLOOR = 8


class QueueFull(RuntimeError):
    """No room in the queue: try again in ``retry_after`` seconds."""

    def __init__(self, limit: int, retry_after: int):
        super().__init__(f"the server is busy ({limit} requests queued): try again in about "
                         f"{retry_after} s")  # fmt: skip
        self.limit, self.retry_after = limit, retry_after


class Cancelled(RuntimeError):
    """A job ended before its result: ``reason`` is ``dropped`` (its client left) or
    ``timed_out`` (past its deadline)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Job:
    key: Hashable  # jobs with equal keys may share a batch
    rows: int  # units it decodes (one, or one per sentence)
    payload: Any  # what the decode function takes
    deadline: float | None = None  # time.monotonic() after which nobody collects it
    arrived: float = field(default_factory=time.monotonic)  # the request's, for its waiting time
    queued: float = 0.0  # when it entered the queue: the gathering window counts from here
    future: Future = field(default_factory=Future)
    started: float | None = None
    batch_rows: int = 0  # rows of the batch it was decoded in
    cancelled: str | None = None
    _gone: torch.Tensor | None = None  # its rows of the running batch's stop mask


def _fail(job: Job, error: BaseException) -> None:
    """``job``'s future raises ``error``, unless it is done (or was cancelled by its waiter)."""
    if not job.future.done():
        job.future.set_exception(error)


class Ticket:
    """A reserved queue slot, turned into a queued job by ``Batcher.submit`` or given back."""

    def __init__(self, batcher: Batcher):
        self._batcher, self.open = batcher, True

    def release(self) -> None:
        if self.open:
            self.open = False
            self._batcher._release()


class Batcher:
    """One worker thread decoding batches of queued jobs (see the module's docstring).

    ``decode(payloads, should_stop) -> one output per payload`` runs on the worker thread;
    ``should_stop()`` gives the (rows,) mask of abandoned rows or None. ``finish(payloads,
    outputs) -> results`` (optional) runs on the finishing thread for the jobs still wanted.
    """

    def __init__(self, decode: Callable[[list[Any], Callable[[], torch.Tensor | None]], list[Any]],
                 max_queue: int | None = None, window: float = 0.01, max_batch: int = 16,
                 on_batch: Callable[[list[Job], float], None] | None = None,
                 finish: Callable[[list[Any], list[Any]], list[Any]] | None = None):  # fmt: skip
        self.decode, self.max_queue, self.window = decode, max_queue, window
        self.max_batch, self.on_batch, self.finish = max(1, max_batch), on_batch, finish
        self._queue: list[Job] = []
        self._reserved = 0
        self._running: list[Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self._seconds_per_job: dict[str, float] = {}  # per stage, moving averages: auto, Retry-After
        self._threads = [threading.Thread(target=self._loop, name="synthesis", daemon=True)]
        if finish is not None:  # one batch finishing, the next one waiting for it at most
            self._handoff: queue.Queue = queue.Queue(maxsize=1)
            self._threads.append(threading.Thread(target=self._finish_loop, name="codes-to-audio", daemon=True))
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ the request side
    @property
    def depth(self) -> int:
        """Requests waiting: queued, or reserved while they are checked and prepared."""
        return len(self._queue) + self._reserved

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    @property
    def seconds_per_job(self) -> float | None:
        """The slowest stage's recent seconds per job: the rate the queue drains at."""
        return max(self._seconds_per_job.values(), default=None)

    def limit(self) -> int:
        if self.max_queue is not None:
            return self.max_queue
        if self.seconds_per_job is None:
            return AUTO_QUEUE_START
        return max(AUTO_QUEUE_FLOOR, int(AUTO_QUEUE_SECONDS / max(self.seconds_per_job, 1e-3)))

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved on (at least 1)."""
        per_job = self.seconds_per_job or 1.0
        return max(1, min(int(AUTO_QUEUE_SECONDS), math.ceil(self.depth * per_job)))

    def reserve(self) -> Ticket:
        with self._cond:
            limit = self.limit()
            if self.depth >= limit:
                raise QueueFull(limit, self.retry_after())
            self._reserved += 1
        return Ticket(self)

    def _release(self) -> None:
        with self._cond:
            self._reserved -= 1
            self._cond.notify_all()

    def submit(self, job: Job, ticket: Ticket) -> Future:
        with self._cond:
            if ticket.open:
                ticket.open = False
                self._reserved -= 1
            job.queued = time.monotonic()
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    def cancel(self, job: Job, reason: str) -> bool:
        """End ``job`` (``dropped`` or ``timed_out``): out of the queue, or its rows stopped at
        the next decoding step. False when it had finished already."""
        with self._cond:
            if job in self._queue:  # its future may be cancelled already (the waiter is gone)
                self._queue.remove(job)
                job.cancelled = job.cancelled or reason
                _fail(job, Cancelled(reason))
                return True
            if job.future.done() or job.cancelled:
                return False
            job.cancelled = reason
            if job._gone is not None:
                job._gone.fill_(True)
            return True

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._cond.notify_all()
        if self.finish is not None:
            try:
                self._handoff.put_nowait(None)
            except queue.Full:  # the finishing thread is busy: it is a daemon, let it be
                pass

    # ------------------------------------------------------------------ the worker
    def _loop(self) -> None:
        while True:
            gathered = self._gather()
            if gathered is None:
                return
            batch, gone = gathered
            if not batch:  # every queued job left during the window
                continue
            try:
                self._run(batch, gone)
            except BaseException as e:  # every job of the batch hears of it
                logger.exception("synthesis batch of %d job(s) failed", len(batch))
                with self._cond:
                    for job in batch:
                        _fail(job, e)
            finally:
                with self._cond:
                    self._running = []

    def _gather(self) -> tuple[list[Job], torch.Tensor] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            first = self._queue[0]
            until = first.queued + self.window
            # only while requests are being checked (they may join): a lone one starts at once
            while not self._closed and (wait := until - time.monotonic()) > 0 and self._reserved \
                    and self._rows_like(first) < self.max_batch:  # fmt: skip
                self._cond.wait(wait)
            if self._closed:
                return None
            self._expire(time.monotonic())
            batch, rows = [], 0
            for job in list(self._queue):
                if job.key != first.key and batch:
                    continue
                if batch and rows + job.rows > self.max_batch:
                    break
                if not batch and job.key != first.key:  # ``first`` expired: lead with this one
                    first = job
                batch.append(job)
                rows += job.rows
                self._queue.remove(job)
            self._running = batch
            gone = torch.zeros(rows, dtype=torch.bool)
            start = time.monotonic()
            offset = 0
            for job in batch:
                job._gone, job.started, job.batch_rows = gone[offset : offset + job.rows], start, rows
                offset += job.rows
            return batch, gone

    def _rows_like(self, first: Job) -> int:
        return sum(job.rows for job in self._queue if job.key == first.key)

    def _expire(self, now: float) -> None:
        """Queued jobs past their deadline end as ``timed_out`` (called with the lock held)."""
        for job in [j for j in self._queue if j.future.done()]:  # nobody waits for it
            self._queue.remove(job)
            job.cancelled = job.cancelled or "dropped"
        for job in [j for j in self._queue if j.deadline is not None and j.deadline < now]:
            self._queue.remove(job)
            job.cancelled = "timed_out"
            _fail(job, Cancelled("timed_out"))

    def _run(self, batch: list[Job], gone: torch.Tensor) -> None:
        """Decode ``batch``; ``gone`` is the stop mask whose slices the jobs' ``_gone`` view."""
        deadlines = [(job.deadline, job) for job in batch if job.deadline is not None]
        next_deadline = min((d for d, _ in deadlines), default=math.inf)

        def should_stop() -> torch.Tensor | None:
            nonlocal next_deadline
            if time.monotonic() > next_deadline:  # only then a look at each job
                now = time.monotonic()
                for deadline, job in deadlines:
                    if deadline < now:
                        self.cancel(job, "timed_out")
                next_deadline = min((d for d, j in deadlines if not j.cancelled), default=math.inf)
            return gone if bool(gone.any()) else None

        started = time.monotonic()
        outputs = self.decode([job.payload for job in batch], should_stop)
        elapsed = time.monotonic() - started
        self._timed("decode", elapsed, len(batch))
        if self.on_batch is not None:
            self.on_batch(batch, elapsed)
        with self._cond:
            for job in batch:
                job._gone = None
        if self.finish is None:
            self._deliver(batch, outputs)
        else:
            self._handoff.put((batch, outputs))

    def _timed(self, stage: str, seconds: float, jobs: int) -> None:
        per_job, old = seconds / max(1, jobs), self._seconds_per_job.get(stage)
        self._seconds_per_job[stage] = per_job if old is None else 0.8 * old + 0.2 * per_job

    def _deliver(self, batch: list[Job], outputs: list[Any]) -> None:
        with self._cond:
            for job, output in zip(batch, outputs):
                if job.cancelled:
                    _fail(job, Cancelled(job.cancelled))
                elif not job.future.done():
                    job.future.set_result(output)

    def _finish_loop(self) -> None:
        while (handed := self._handoff.get()) is not None:
            batch, outputs = handed
            wanted = [k for k, job in enumerate(batch) if not job.cancelled]
            started = time.monotonic()
            try:
                done = self.finish([batch[k].payload for k in wanted], [outputs[k] for k in wanted])
            except BaseException as e:  # every job of the batch hears of it
                logger.exception("finishing a batch of %d job(s) failed", len(batch))
                with self._cond:
                    for job in batch:
                        _fail(job, e)
                continue
            self._timed("finish", time.monotonic() - started, len(wanted))
            finished = dict(zip(wanted, done))
            self._deliver(batch, [finished.get(k) for k in range(len(batch))])

"""Reading ahead of the step: this rank's micro-batches pulled from the data loader by a
background thread into a bounded queue, so that a step does not wait on slow reads (a token
folder in object storage: one ranged GET per sample that misses the block cache).

The thread pulls the one loader iterator in its own order and the step takes its items in that
order, so the samples and their order are those of reading in the step (``data/sample_digest``
is the same): only the time of the reads moves. The seconds the step waits for an item are
counted (:meth:`Feed.take_wait`, ``time/data_wait_s`` in the metrics). The thread is stopped by
:meth:`Feed.close` on every ending of a run (normal, error, Ctrl-C); it is a daemon as well, so a
process that dies without closing it is not kept alive by it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator

THREAD_NAME = "llmtrain-prefetch"
_POLL_S = 0.1  # how often a blocked put or get looks whether the other side has stopped, seconds
_JOIN_S = 30.0  # how long close() waits for a read in flight (one request's read timeout), seconds


class DataWaitInterrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM) came while the step waited for its data (a store that does
    not answer): the run ends at once, without the end-of-step save it could not reach; its last
    checkpoint stands. A KeyboardInterrupt: ``python -m llmtrain`` prints it as one line and exits
    with status 130."""

    def __init__(self, signal_name: str):
        super().__init__(f"{signal_name} while the step waited for its data (the data source did not answer): "
                         "stopped without saving this step; the run folder keeps its last checkpoint, and the same "
                         "command continues from it")


class Feed:
    """The micro-batches of ``source`` (an iterator), read up to ``depth`` ahead by a background
    thread started at the first ``next()``; ``depth=0`` reads each in the caller's thread.

    An exception the reads raise (a :class:`~llmtrain.common.errors.DataError` of a store that
    stays down) is raised by the ``next()`` that would have returned the item, not earlier: the
    steps before it train as without prefetch.
    """

    def __init__(self, source: Iterator[Any], depth: int, stop_when: Callable[[], str | None] | None = None,
                 work: Callable[[], dict[str, float]] | None = None):
        self.source, self.depth = source, depth
        # What the reads cost, taken once a step (ImageCollator.take_metrics: image preparation).
        self.work = work
        # Asked while the step waits for an item: a signal's name (SIGINT, SIGTERM) when the run
        # was asked to stop. The loop's handler only sets a flag and saves at the step's end, which
        # a step waiting on a store that hangs never reaches: the wait itself gives up.
        self.stop_when = stop_when
        self._abandoned = False
        self.waited_s = 0.0  # seconds next() has waited since the last take_wait()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ended = False

    def __iter__(self) -> "Feed":
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            if self.depth == 0:
                return next(self.source)
            return self._get()
        finally:
            self.waited_s += time.perf_counter() - started

    def take_wait(self) -> float:
        """Seconds ``next()`` waited for items since the previous call (a step's data wait)."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def take_work(self) -> dict[str, float]:
        """The source's own cost metrics since the previous call (``work``), or none."""
        return self.work() if self.work is not None else {}

    def _get(self) -> Any:
        if self._ended:
            raise StopIteration
        if self._thread is None:
            self._thread = threading.Thread(target=self._read, name=THREAD_NAME, daemon=True)
            self._thread.start()
        while True:
            try:
                kind, item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():  # closed under us
                    self._ended = True
                    raise StopIteration from None
                signal_name = self.stop_when() if self.stop_when is not None else None
                if signal_name is not None:
                    self._ended = self._abandoned = True  # close() does not wait for the hung read
                    raise DataWaitInterrupted(signal_name)
        if kind == "item":
            return item
        self._ended = True
        if kind == "error":
            raise item
        raise StopIteration

    def _read(self) -> None:
        """The thread: every item of the source, then an end or the error that stopped it."""
        try:
            for item in self.source:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(("error", err))

    def _put(self, entry: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the thread and drop what it read ahead; idempotent. Waits for a read in flight
        (up to 30 s, one request's read timeout) so that no thread of the run outlives it; a read
        stuck longer is left to the daemon thread, which ends with the process."""
        self._stop.set()
        self._ended = True
        thread, self._thread = self._thread, None
        if thread is None:
            return
        deadline = time.monotonic() + (_POLL_S if self._abandoned else _JOIN_S)
        while thread.is_alive() and time.monotonic() < deadline:
            try:  # what was read ahead is dropped: a put blocked on the full queue returns
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(_POLL_S)
        self._queue = queue.Queue(maxsize=max(self.depth, 1))

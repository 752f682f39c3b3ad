"""Reading ahead of the step (``data.prefetch``, :mod:`llmtrain.data.prefetch`): the items and
their order are those of reading in the step, a read's error is raised at its item, the wait is
counted, and the thread is gone after every ending of a run (normal, error, Ctrl-C)."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import FAST, make_cfg
from llmtrain.common.errors import DataError
from llmtrain.data.prefetch import THREAD_NAME, Feed


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _slow(items, delay_s: float = 0.0, fail_at: int | None = None):
    for i, item in enumerate(items):
        if i == fail_at:
            raise DataError(f"read {i} failed")
        time.sleep(delay_s)
        yield item


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_items_in_order_and_an_error_at_its_item(depth):
    feed = Feed(_slow(range(6), fail_at=4), depth)
    assert [next(feed) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(DataError, match="read 4 failed"):
        next(feed)
    with pytest.raises(StopIteration):
        next(feed)
    feed.close()
    assert not _prefetch_threads()


def test_reads_overlap_the_step_and_the_wait_is_counted():
    """5 reads of 100 ms: read in the step they are waited for in full (0.5 s); read ahead during
    120 ms of 'step' work each, only the first is (0.1 s; the bound leaves a loaded machine's
    thread switches 0.2 s, and stays below half the wait without read-ahead)."""
    for depth, low, high in ((0, 0.48, 2.0), (2, 0.09, 0.3)):
        feed = Feed(_slow(range(5), delay_s=0.1), depth)
        for _ in range(5):
            next(feed)
            time.sleep(0.12)
        assert low <= feed.take_wait() <= high, depth
        assert feed.take_wait() == 0.0
        feed.close()


def test_close_stops_a_thread_blocked_on_a_full_queue():
    feed = Feed(iter(range(10**9)), 2)
    next(feed)
    time.sleep(0.05)  # the thread fills the queue and blocks on put
    feed.close()
    feed.close()  # idempotent
    assert not _prefetch_threads()
    with pytest.raises(StopIteration):
        next(feed)


@pytest.mark.parametrize("ending", ["data error", "ctrl-c"])
def test_no_prefetch_thread_outlives_a_run(tmp_path, monkeypatch, ending):
    """A 3-step run in this process ends with a read's error in step 1, or with Ctrl-C in step 2's
    forward: the read-ahead thread is gone (a run that finishes: tests/test_object_storage.py)."""
    from llmtrain import trainer as trainer_module
    from llmtrain.data.tokens import TokenBlocks

    calls = {"n": 0}
    if ending == "data error":
        read = TokenBlocks.__getitem__

        def failing(self, k):
            calls["n"] += 1
            if calls["n"] > 12:  # the 8 held-out samples, then step 1's first micro-batch
                raise DataError("the store is down")
            return read(self, k)

        monkeypatch.setattr(TokenBlocks, "__getitem__", failing)
    if ending == "ctrl-c":
        step = trainer_module.forward_backward

        def interrupted(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
            return step(*args, **kwargs)

        monkeypatch.setattr(trainer_module, "forward_backward", interrupted)
    cfg = make_cfg(FAST + ["trainer.max_steps=3", "trainer.global_batch_size=8",
                           "trainer.micro_batch_size=4", "trainer.export_hf=false", "data.prefetch=2",
                           f"run_dir={tmp_path}"])
    with pytest.raises(DataError if ending == "data error" else KeyboardInterrupt):
        trainer_module.train(cfg)
    assert not _prefetch_threads()

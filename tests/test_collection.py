"""Python's garbage collector on the training loop's schedule (``trainer.gc_every``,
:mod:`llmtrain.common.collection`): what is frozen, when cycles are collected, and that a process
that goes on after a run (a sweep, this test session) gets its collector back as it was."""

import gc
import json
import weakref

import pytest

from conftest import FAST, make_cfg


class Cycle:
    """A reference cycle: freed only by the cyclic collector, never by reference counting."""

    def __init__(self):
        self.me = self


def collector() -> tuple[bool, bool]:
    """(automatic collection on, any object frozen): frozen objects that reference counting
    frees leave the freeze count, so the count itself is not compared."""
    return gc.isenabled(), gc.get_freeze_count() > 0


@pytest.fixture
def collector_state():
    """The collector as the test found it; asserts the test left it so."""
    before = collector()
    yield before
    from llmtrain.common import collection

    collection.restore()
    assert collector() == before


def test_cycles_wait_for_the_scheduled_step_and_the_collector_comes_back(collector_state):
    from llmtrain.common import collection
    from llmtrain.common.collection import CollectionSchedule

    assert collector_state == (True, False)  # the session's own state: the test below starts from it
    imported = Cycle()
    schedule = CollectionSchedule(3)
    schedule.set_up()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert not any(o is imported for o in gc.get_objects())  # frozen: full collections skip it
    built = Cycle()
    left_by_set_up = Cycle()
    set_up_garbage = weakref.ref(left_by_set_up)
    del left_by_set_up
    gc.disable()  # so that only start() can collect it
    assert set_up_garbage() is not None
    schedule.start()
    assert set_up_garbage() is None  # collected, not frozen for the whole run
    assert not gc.isenabled()
    assert not any(o is built for o in gc.get_objects())  # what set-up built is frozen too
    garbage = Cycle()
    alive = weakref.ref(garbage)
    del garbage
    for _ in range(1000):  # far past generation 0's threshold: no automatic collection runs
        Cycle()
    assert alive() is not None
    assert [schedule.collect_if_due(done) for done in (0, 1, 2)] == [0.0, 0.0, 0.0]
    assert alive() is not None
    assert schedule.collect_if_due(3) > 0 and alive() is None  # after step 3, on every rank
    assert schedule.collect_if_due(4) == 0.0 and schedule.collect_if_due(6) > 0
    collection.restore()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    collection.restore()  # idempotent
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_run_after_another_in_the_same_process_does_not_freeze_the_first_ones_garbage(collector_state):
    """A Hydra sweep's in-process jobs: the Trainer that ended is garbage in reference cycles, and
    the next run's freeze would keep its model and optimizer state through the whole run."""
    from llmtrain.common import collection
    from llmtrain.common.collection import CollectionSchedule

    first = CollectionSchedule(5)
    first.set_up()
    first.start()
    ended_run = Cycle()
    alive = weakref.ref(ended_run)
    del ended_run
    collection.restore()
    gc.disable()  # so that only the next set-up can collect it
    CollectionSchedule(5).set_up()
    assert alive() is None
    collection.restore()
    gc.enable()


def test_zero_leaves_pythons_collector_alone_and_a_host_freeze_is_kept(collector_state):
    from llmtrain.common import collection
    from llmtrain.common.collection import CollectionSchedule

    off = CollectionSchedule(0)
    off.set_up()
    off.start()
    assert gc.isenabled() and gc.get_freeze_count() == 0 and off.collect_if_due(50) == 0.0
    collection.restore()
    hosts = Cycle()
    gc.freeze()  # a host application's own freeze
    try:
        ours = Cycle()
        schedule = CollectionSchedule(2)
        schedule.set_up()
        schedule.start()
        assert not gc.isenabled()
        assert any(o is ours for o in gc.get_objects())  # nothing frozen on top of the host's freeze
        collection.restore()
        assert gc.isenabled() and not any(o is hosts for o in gc.get_objects())  # not ours to unfreeze
    finally:
        gc.unfreeze()


def test_a_run_collects_on_schedule_reports_it_and_gives_the_collector_back(tmp_path, collector_state):
    from llmtrain.common.errors import ConfigError
    from llmtrain.trainer import train

    run_dir = tmp_path / "run"
    train(make_cfg(FAST + ["trainer.max_steps=7", "trainer.gc_every=2", "trainer.log_every=3",
                           "trainer.export_hf=false", f"run_dir={run_dir}"]))
    assert collector() == collector_state
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if "train/loss" in r]
    assert logged[:2] == [3, 6]
    collected = {r["step"]: r["perf/gc_s"] for r in rows if "perf/gc_s" in r}
    # Collections end steps 2, 4 and 6; the records of steps 3 and 6 carry them (log_every=3).
    assert sorted(collected) == [3, 6]
    assert all(seconds > 0 for seconds in collected.values())
    # A run that fails at set-up gives the collector back too, and names the field.
    with pytest.raises(ConfigError, match=r"trainer.gc_every=-1 must be >= 0"):
        train(make_cfg(FAST + ["trainer.gc_every=-1", f"run_dir={tmp_path / 'bad'}"]))
    assert collector() == collector_state

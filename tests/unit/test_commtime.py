"""The exposed-communication ledger (trainer/parallel/commtime.py) on real sleeps and real computation: a region
counts the time the training thread slept in it, less nested regions'; computing is not sleeping; other threads'
regions are not counted."""

import threading
import time

import pytest

from trainer.parallel.commtime import CommLedger


@pytest.fixture
def ledger():
    ledger = CommLedger()
    if not ledger.enable("tp"):
        pytest.skip("no /proc/<pid>/task/<tid>/schedstat on this kernel")
    yield ledger
    ledger.clock.close()


def test_nested_regions_count_their_own_sleep(ledger):
    start = ledger.clock.now()
    with ledger.region("pp"):  # a schedule: its own wait 0.05 s, a stage chunk inside
        time.sleep(0.05)
        with ledger.region(None):  # the chunk: 0.1 s of its own sleep counts for nobody here
            time.sleep(0.1)
            with ledger.region("dp_shard"):  # an all-gather inside the chunk
                time.sleep(0.05)
    dims = ledger.take()
    slept = ledger.clock.now() - start
    assert 0.045 < dims["pp"] < 0.09 and 0.045 < dims["dp_shard"] < 0.09, dims
    assert 0.19 < slept < 0.3  # the rest (0.1 s) is the caller's to name (trainer/observe/timing.py)
    assert ledger.take() == {}


def test_computing_is_not_sleeping(ledger):
    with ledger.region("tp"):
        end = time.perf_counter() + 0.15
        while time.perf_counter() < end:
            pass
    assert ledger.take().get("tp", 0.0) < 0.03


def test_only_the_training_thread_counts(ledger):
    def elsewhere():
        with ledger.region("pp"):
            time.sleep(0.05)

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert ledger.take() == {}


def test_a_disabled_ledger_counts_nothing():
    ledger = CommLedger()
    with ledger.region("pp"):
        time.sleep(0.02)
    assert ledger.take() == {} and not ledger.enabled

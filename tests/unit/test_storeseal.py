"""trainer/parallel/storeseal.py: a value in the rendezvous store is opened only when this launch sealed it under
that key and it is not older than the last one opened there; anything else reads as nothing and is counted."""

from __future__ import annotations

import json

from trainer.parallel.storeseal import Seal, new_secret


def test_only_the_launchs_own_new_values_open():
    secret = new_secret()
    writer, reader = Seal(secret, rank=3), Seal(secret, rank=0)
    first = writer.seal("hpc/watchdog/beat/3", '{"seq": 1}')
    second = writer.seal("hpc/watchdog/beat/3", '{"seq": 2}')
    assert reader.open("hpc/watchdog/beat/3", first) == '{"seq": 1}'
    assert reader.open("hpc/watchdog/beat/3", second.encode()) == '{"seq": 2}'
    assert reader.open("hpc/watchdog/beat/3", second) == '{"seq": 2}'  # read again while polling: still good
    assert reader.open("hpc/watchdog/beat/3", first) is None  # replayed: older than one already opened
    assert reader.open("hpc/watchdog/beat/2", second) is None  # moved to another rank's key
    assert Seal(new_secret(), rank=0).open("hpc/watchdog/beat/3", second) is None  # another launch's secret
    tampered = json.loads(second) | {"v": '{"seq": 99}'}
    assert reader.open("hpc/watchdog/beat/3", json.dumps(tampered)) is None
    for garbage in (b"\xff", "{}", "[1]", '{"v": 1, "r": 0, "n": 1, "m": "x"}', ""):
        assert reader.open("hpc/watchdog/hang", garbage) is None
    assert reader.open("hpc/watchdog/hang", None) is None  # nothing there: not counted
    assert reader.rejected == {"forged": 2, "stale": 1, "garbage": 5, "deleted": 0}
    assert reader.counts() == "2 forged, 1 stale, 5 garbage"


def test_a_key_with_a_refused_value_is_contested_for_a_while():
    reader = Seal(new_secret(), rank=0)
    assert not reader.recently_contested("hpc/watchdog/beat/1", since=0.0)
    reader.open("hpc/watchdog/beat/1", "garbage", now=100.0)
    reader.note_deleted("hpc/watchdog/beat/2", now=101.0)
    assert reader.recently_contested("hpc/watchdog/beat/1", since=97.0)
    assert not reader.recently_contested("hpc/watchdog/beat/1", since=100.5)
    assert reader.recently_contested("hpc/watchdog/beat/2", since=100.5) and reader.rejected["deleted"] == 1

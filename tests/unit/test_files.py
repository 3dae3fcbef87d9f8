"""The one atomic write and the one JSON-lines append (storage/files.py)."""

from __future__ import annotations

import json
import threading

import pytest

from storage.files import append_jsonl, write_atomic, write_json_atomic


@pytest.mark.parametrize("fsync", [True, False])
def test_a_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path, fsync):
    path = tmp_path / "state.json"
    path.write_text("old\n")
    write_json_atomic(path, {"step": 3}, fsync=fsync, indent=1)
    assert json.loads(path.read_text()) == {"step": 3} and path.read_text().endswith("}\n")
    write_atomic(path, b"\x00bytes", fsync=fsync)
    assert path.read_bytes() == b"\x00bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_write_that_fails_keeps_the_old_file_and_removes_its_temporary_file(tmp_path):
    path = tmp_path / "state.json"
    path.write_text('{"step": 1}\n')
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_appends_from_many_threads_never_interleave(tmp_path):
    path = tmp_path / "history.jsonl"

    def writer(n: int) -> None:
        for i in range(200):
            append_jsonl(path, {"writer": n, "i": i, "pad": "x" * 500})

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 800 and {(r["writer"], r["i"]) for r in lines} == {
        (n, i) for n in range(4) for i in range(200)
    }

"""Retrying transient storage errors (storage/ioretry.py): which errors are transient, the back-off, giving up,
and the two readers that use it (a data window, a checkpoint generation's manifest).

Real errors from the kernel where one can be had: reading /proc/self/mem at an unmapped address (offset 0) fails
with EIO, writing /dev/full with ENOSPC; an h5py file whose descriptor is swapped for /proc/self/mem fails its
next read inside HDF5 with a real EIO, as a file system that lost its server would.
"""

import errno
import json
import logging
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from runconfig import ConfigError, load_config
from rundir.checkpoints import CheckpointInvalid, commit, latest_committed, newest_valid, read_latest, validate
from storage.ioretry import RetryPolicy, io_errno, is_transient, retry
from trainer.data.dataset import TokenShards
from trainer.errors import UserError
from trainer.observe.inject import Injector, parse

LOG = logging.getLogger("test.ioretry")


def real_eio() -> OSError:
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        os.pread(fd, 16, 0)
    except OSError as exc:
        return exc
    finally:
        os.close(fd)
    pytest.skip("reading /proc/self/mem at offset 0 did not fail here")


def real_enospc() -> OSError:
    try:
        with open("/dev/full", "wb") as f:
            f.write(b"x")
            f.flush()
    except OSError as exc:
        return exc
    pytest.skip("/dev/full did not fail here")


def break_h5_handle(ds: h5py.Dataset) -> None:
    """Swap the open HDF5 file's descriptor for /proc/self/mem: its next uncached read fails with EIO."""
    mem = os.open("/proc/self/mem", os.O_RDONLY)
    os.dup2(mem, ds.file.id.get_vfd_handle())
    os.close(mem)


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "train_00000.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.arange(200_000, dtype=np.uint16) % 250)
    return path


# -- which errors are transient -------------------------------------------------------------------------------------
def test_transient_and_permanent_errors_from_real_calls(tmp_path, token_file):
    assert real_eio().errno == errno.EIO and is_transient(real_eio())
    assert real_enospc().errno == errno.ENOSPC and not is_transient(real_enospc())
    with pytest.raises(FileNotFoundError) as missing:
        (tmp_path / "nope").read_bytes()
    assert not is_transient(missing.value)
    with h5py.File(token_file, "r") as f:
        ds = f["tokens"]
        break_h5_handle(ds)
        with pytest.raises(OSError) as h5err:
            ds[150_000:150_010]
    assert "file read failed" in str(h5err.value) and is_transient(h5err.value)  # what h5py raises for a bad read


@pytest.mark.parametrize(
    "code, transient",
    [(errno.EIO, True), (errno.ESTALE, True), (errno.ETIMEDOUT, True), (errno.EAGAIN, True),
     (errno.ECONNRESET, True), (errno.ENOLCK, True), (errno.EREMOTEIO, True), (errno.EBUSY, True),
     (errno.ENOSPC, False), (errno.EACCES, False), (errno.ENOENT, False), (errno.EROFS, False),
     (errno.EDQUOT, False), (errno.EISDIR, False)],
)  # fmt: skip
def test_classification_by_errno(code, transient):
    assert is_transient(OSError(code, os.strerror(code), "/lustre/x")) is transient


def test_h5py_messages_without_errno_are_read():
    """h5py before 3.16 leaves OSError.errno unset; HDF5's message carries the system errno."""
    msg = (
        "Can't synchronously read data (file read failed: time = Mon Nov 23 19:25:52 2026\n, filename = "
        "'/gpfs/d/train_00000.h5', file descriptor = 3, errno = {}, error message = 'x', buf = 0x5, total read "
        "size = 65536, bytes this sub-read = 65536, offset = 1002048)"
    )
    assert io_errno(OSError(msg.format(116))) == errno.ESTALE and is_transient(OSError(msg.format(116)))
    assert not is_transient(OSError(msg.format(errno.ENOSPC)))
    assert not is_transient(OSError("Can't synchronously read data (wrong B-tree signature)"))  # corrupt, not I/O
    assert not is_transient(RuntimeError("[Errno 5] Input/output error")) and not is_transient(ValueError())


# -- back-off -------------------------------------------------------------------------------------------------------
def test_backoff_doubles_up_to_its_cap_with_jitter_and_stops_at_attempts_or_budget():
    p = RetryPolicy(8, 1.0, "checkpoint.io_retries", max_delay_s=30, budget_s=120)
    assert [p.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert p.attempts == 9
    for n in range(1, 8):
        assert all(p.delay(n) / 2 <= p.jittered(n) <= p.delay(n) for _ in range(50))
    assert len({p.jittered(3) for _ in range(20)}) > 1  # ranks that failed together spread out
    assert p.allows(1, 0.0) and p.allows(8, 0.0) and not p.allows(9, 0.0)  # 1 + 8 attempts
    assert p.allows(3, 115.0) and not p.allows(3, 117.0)  # no retry would start after 120 s
    assert not RetryPolicy(0, 1.0, "x").allows(1, 0.0)


def test_jitter_leaves_the_global_random_streams_alone():
    import random

    random.seed(7)
    before = random.getstate()
    RetryPolicy(3, 1.0, "x").jittered(2)
    assert random.getstate() == before


# -- retry ----------------------------------------------------------------------------------------------------------
def flaky_read(path: Path, failures: int):
    """Reads ``path``; the first ``failures`` calls read /proc/self/mem instead (a real EIO)."""
    calls = []

    def read() -> bytes:
        calls.append(1)
        if len(calls) <= failures:
            with open("/proc/self/mem", "rb") as f:
                return f.read(16)
        return path.read_bytes()

    return read, calls


def test_retry_succeeds_after_transient_errors_and_logs_each(tmp_path, caplog):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"tokens")
    read, calls = flaky_read(path, 2)
    sleeps: list[float] = []
    policy = RetryPolicy(3, 0.1, "data.read_retries")
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert retry(read, policy, what="data read of", path=path, log=LOG, sleep=sleeps.append) == b"tokens"
    assert len(calls) == 3
    assert 0.05 <= sleeps[0] <= 0.1 and 0.1 <= sleeps[1] <= 0.2
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        f"data read of {path} failed with EIO (Input/output error), attempt 1/4; retrying in {sleeps[0]:.2f} s"
    )
    assert "attempt 2/4" in lines[1] and len(lines) == 2 and all(r.levelname == "WARNING" for r in caplog.records)


def test_retry_gives_up_with_the_original_error_and_a_note(tmp_path, caplog):
    read, calls = flaky_read(tmp_path / "never", 100)
    sleeps: list[float] = []
    policy = RetryPolicy(2, 0.01, "data.read_retries")
    with pytest.raises(OSError) as info, caplog.at_level(logging.WARNING, logger=LOG.name):
        retry(read, policy, what="data read of", path=tmp_path / "never", log=LOG, sleep=sleeps.append)
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "ERROR"]
    assert caplog.records[-1].getMessage().endswith("failed with EIO (Input/output error), attempt 3/3; giving up")
    assert info.value.errno == errno.EIO and type(info.value) is OSError
    assert len(calls) == 3 and len(sleeps) == 2
    assert info.value.__notes__[0].startswith("gave up after 3 attempt(s) over ")
    assert "(data.read_retries=2, at most 120 s of retries)" in info.value.__notes__[0]


def test_permanent_errors_fail_at_once():
    calls = []

    def write() -> None:
        calls.append(1)
        with open("/dev/full", "wb") as f:
            f.write(b"x")

    with pytest.raises(OSError) as info:
        retry(write, RetryPolicy(5, 0.01, "checkpoint.io_retries"), what="write", log=LOG, sleep=pytest.fail)
    assert info.value.errno == errno.ENOSPC and len(calls) == 1 and not getattr(info.value, "__notes__", None)


# -- config ---------------------------------------------------------------------------------------------------------
def test_config_keys_defaults_and_ranges():
    cfg = load_config("tiny")
    assert (cfg.checkpoint.io_retries, cfg.checkpoint.io_retry_backoff_s) == (5, 1.0)
    assert (cfg.data.read_retries, cfg.data.read_retry_backoff_s) == (5, 0.5)
    assert load_config("tiny", ["checkpoint.io_retries=0", "data.read_retries=0"]).checkpoint.io_retries == 0
    for bad, key in [
        ("checkpoint.io_retries=-1", "checkpoint.io_retries"),
        ("checkpoint.io_retry_backoff_s=0", "checkpoint.io_retry_backoff_s"),
        ("checkpoint.io_retry_backoff_s=600", "checkpoint.io_retry_backoff_s"),
        ("data.read_retries=-2", "data.read_retries"),
        ("data.read_retry_backoff_s=-1", "data.read_retry_backoff_s"),
    ]:
        with pytest.raises(ConfigError, match=f"key '{key}'"):
            load_config("tiny", [bad])


# -- a data window ----------------------------------------------------------------------------------------------------
def shards(token_file: Path, **kw) -> TokenShards:
    manifest = {"splits": {"train": [{"file": token_file.name, "tokens": 200_000}]}, "vocab_size": 257}
    return TokenShards(token_file.parent, manifest, "train", seq_len=63, rank=1, **kw)


def test_a_window_read_that_hits_a_real_eio_reopens_the_shard(token_file, caplog):
    """The handle is closed and the shard opened afresh: HDF5 shares one open file among its handles, and after a
    failed read its sieve buffer claims another region's bytes, which a read through it returns without an error."""
    fresh = shards(token_file)
    want = fresh[2000]
    fresh.close()
    data = shards(token_file, retry=RetryPolicy(3, 0.01, "data.read_retries"))
    data[10]  # the shard is open, its sieve buffer filled
    break_h5_handle(data._dataset(0))  # the open handle now fails like a stale NFS handle
    with caplog.at_level(logging.WARNING, logger="trainer.data.dataset"):
        assert (data[2000] == want).all()
    assert (data[3000] == shards(token_file)[3000]).all()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"data read of {token_file} failed with EIO (") and "attempt 1/4; retrying in" in line
    data.close()


def test_injected_read_faults_then_give_up_as_a_crash_not_a_user_error(token_file):
    injector = Injector(parse("eio_read:1:2"), rank=1)
    data = shards(token_file, retry=RetryPolicy(2, 0.01, "data.read_retries"), before_read=injector.data_read)
    assert len(data[5]) == 64  # two injected failures, the third attempt reads
    data.before_read = Injector(parse("eio_read:1:10"), rank=1).data_read
    with pytest.raises(OSError) as info:
        data[6]
    assert not isinstance(info.value, UserError) and info.value.errno == errno.EIO
    assert "gave up after 3 attempt(s)" in info.value.__notes__[0]
    data.close()


def test_a_permanent_read_error_is_still_a_user_error(token_file):
    def denied(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    data = shards(token_file, retry=RetryPolicy(3, 0.01, "data.read_retries"), before_read=denied)
    with pytest.raises(UserError, match=f"rank 1: data shard {token_file} cannot be read"):
        data[0]


# -- a checkpoint generation ------------------------------------------------------------------------------------------
def generation(root: Path, step: int) -> Path:
    tmp = root / f".tmp-step_{step:08d}"
    tmp.mkdir(parents=True)
    (tmp / "train_state.json").write_text("{}")
    files = {"train_state.json": {"size": 2, "sha256": __import__("hashlib").sha256(b"{}").hexdigest()}}
    commit(tmp, root / f"step_{step:08d}", {"step": step, "files": files})
    return root / f"step_{step:08d}"


def test_a_transient_manifest_read_error_is_not_corruption(tmp_path):
    root = tmp_path / "checkpoints"
    generation(root, 4)
    newest = generation(root, 8)
    manifest = newest / "manifest.json"
    saved = manifest.read_text()
    manifest.unlink()
    manifest.symlink_to("/proc/self/mem")  # reading it fails with a real EIO
    with pytest.raises(OSError) as info:
        newest_valid(root, pytest.fail)  # not skipped as invalid: raised, for the caller to retry
    assert info.value.errno == errno.EIO and not isinstance(info.value, CheckpointInvalid)
    assert info.value.filename == str(manifest)  # read() names no file: validate adds it, for the retry's log
    assert latest_committed(root)["step"] == 4  # status readers still see the older one
    manifest.unlink()
    manifest.write_text(saved)
    assert newest_valid(root, pytest.fail)[0] == newest


def test_commit_is_reentrant_after_its_rename(tmp_path):
    root = tmp_path / "checkpoints"
    final = generation(root, 4)
    manifest = validate(final)
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    (root / "latest").unlink()
    commit(root / ".tmp-step_00000004", final, body)  # a retry after the rename: only latest is left to do
    assert read_latest(root) == "step_00000004" and validate(final) == manifest
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004"]  # nothing set aside
    other = json.loads(json.dumps(body)) | {"step": 5}
    with pytest.raises(FileNotFoundError):  # another manifest: a genuine error, not a silent success
        commit(root / ".tmp-step_00000004", final, other)

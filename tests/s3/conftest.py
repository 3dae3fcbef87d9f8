"""The session's real S3-compatible server (envs/s3/server.sh: s3rver, objects on disk, so a restart keeps them), and
helpers to put a prepared dataset in it. Every test here runs on one pytest-xdist worker (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

# Off s3rver's default 4568 and a developer's own server (19000); HPC_TEST_S3_PORT moves it.
PORT = os.environ.get("HPC_TEST_S3_PORT", "19100")
BUCKET = "hpc-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class S3Server:
    state: Path
    endpoint: str

    def script(self, verb: str) -> None:
        env = {**os.environ, "HPC_S3_PORT": PORT, "HPC_S3_BUCKETS": BUCKET}
        subprocess.run(["bash", "envs/s3/server.sh", verb, str(self.state)], check=True, cwd=ROOT, env=env)

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, use_listings_cache=False, skip_instance_cache=True)

    def upload(self, folder: Path, prefix: str) -> str:
        """Copy a local folder's files to s3://BUCKET/prefix; the URL."""
        fs = self.fs()
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                fs.put_file(str(path), f"{BUCKET}/{prefix}/{path.name}")
        return f"s3://{BUCKET}/{prefix}"


@pytest.fixture(scope="session")
def s3():
    state = Path(tempfile.mkdtemp(prefix="hpc-s3-test-", dir="/tmp"))
    server = S3Server(state, f"http://127.0.0.1:{PORT}")
    server.script("install")
    server.script("start")
    old = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_ENDPOINT_URL"]}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=server.endpoint)
    try:
        yield server
    finally:
        server.script("wipe")
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_small(s3, small_dataset) -> str:
    """tests/conftest.py's small dataset, uploaded once: its URL."""
    return s3.upload(small_dataset, "small")


def sets(data: str, cache: Path, ranks_per_node: int = 1) -> list[str]:
    """2 simulated nodes x 1 rank: what a bucket holds and how a run resumes from it does not depend on the ranks of
    a node, and a launch of 2 ranks costs under half the CPU of 4 on the test machine's 2 cores. The node cache's
    sharing between the ranks of a node is pinned at 2 x 2 (tests/s3/test_stream.py, ``ranks_per_node=2``)."""
    return [
        f"job.ranks_per_node={ranks_per_node}",
        f"data.path={data}", f"data.cache_dir={cache}", "train.steps=16", "train.warmup_steps=2",
        "train.eval_every=8", "model.d_model=64", "model.n_layers=2", "model.seq_len=64",
        "checkpoint.every_steps=4", "model.dropout=0.1", "comm.allreduce=flat", "data.shuffle_window=2",
    ]  # fmt: skip


def disk_run(tmp_path_factory, small_dataset, ranks_per_node: int) -> Path:
    from tests.mp.test_checkpoint import run

    run_dir = tmp_path_factory.mktemp("disk") / "run"
    proc = run(run_dir, sets(str(small_dataset), tmp_path_factory.mktemp("unused-cache"), ranks_per_node))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


@pytest.fixture(scope="session")
def disk_reference(tmp_path_factory, small_dataset):
    """The run of ``sets`` from the small dataset on disk: what every run from the bucket must end as."""
    return disk_run(tmp_path_factory, small_dataset, 1)


@pytest.fixture(scope="session")
def disk_reference_2x2(tmp_path_factory, small_dataset):
    """The same on 2 simulated nodes x 2 ranks."""
    return disk_run(tmp_path_factory, small_dataset, 2)

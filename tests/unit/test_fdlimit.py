"""A rank's soft limit on open files raised to the hard one at start, and a hard limit too low for the world named
(trainer/parallel/fdlimit.py), in child processes started under the limits a cluster's shell may hand a job."""

import json
import resource
import subprocess

from tests.conftest import PY, ROOT

CHILD = (
    "import json, sys; from trainer.parallel.fdlimit import raise_open_files; "
    "print(json.dumps(raise_open_files(int(sys.argv[1]), int(sys.argv[2]), 'node7', gloo=sys.argv[3] == 'gloo', "
    "ranks_per_node=int(sys.argv[4]))))"
)


def run(soft: int, hard: int, rank: int, world: int, backend: str, per_node: int = 1) -> tuple[int, int, str | None]:
    limits = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # noqa: E731
    out = subprocess.run([PY, "-c", CHILD, str(rank), str(world), backend, str(per_node)], cwd=ROOT,
                         preexec_fn=limits, capture_output=True, text=True, check=True).stdout  # fmt: skip
    return tuple(json.loads(out))


def test_the_soft_limit_is_raised_to_the_hard_one():
    assert run(512, 4096, 0, 64, "gloo") == (512, 4096, None)  # rank 0 needs 1024 + 3 x 64 + 3 x 64
    assert run(4096, 4096, 3, 64, "nccl") == (4096, 4096, None)  # nothing to raise


def test_a_hard_limit_too_low_for_the_world_is_named_with_the_rank_and_what_it_needs():
    before, now, error = run(512, 2048, 0, 4096, "nccl")
    assert (before, now) == (512, 2048)
    assert error.startswith("rank 0 on node7 may open 2048 files") and "ulimit -Hn" in error, error
    assert "about 17408 at 4096 ranks" in error and "rendezvous-store connections" in error, error
    _, _, error = run(512, 2048, 5, 4096, "gloo")  # any rank: gloo's full mesh
    assert error.startswith("rank 5 on node7") and "about 13312" in error and "gloo connects" in error, error
    assert run(512, 2048, 5, 256, "gloo")[2] is None


def test_rank_0_of_nodes_of_8_ranks_needs_a_store_connection_a_rank_and_two_a_node():
    # 1,024 + 4,096 (the process groups') + 2 x (512 nodes + 64 spare, for nodes whose relay fails) + 4,096 (NCCL's
    # one gloo group): 10,368, where one rank a node needs 17,408
    _, _, error = run(512, 10000, 0, 4096, "nccl", per_node=8)
    assert "about 10368 at 4096 ranks" in error and "5248 rendezvous-store connections" in error, error
    assert run(512, 10368, 0, 4096, "nccl", per_node=8)[2] is None

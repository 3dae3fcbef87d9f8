"""The one restart loop of both launchers (hpc/restarts.py): launch, decide, restart in place while the decision
says so, on the nodes it names; every decision recorded in the run's history."""

import dataclasses

from hpc.policy.decide import Situation
from hpc.policy.outcome import Ended
from hpc.restarts import until_settled
from runconfig import dump_yaml, load_config
from rundir import RunDir
from rundir.contract import EVENT_RESTART, FAILURE_CRASH
from rundir.paths import read_jsonl


@dataclasses.dataclass
class Launch:
    ended: Ended
    launch_id: str
    nodes: tuple[str, ...]
    first_ended: int | None = None

    @property
    def status(self) -> int:
        return self.ended.status


def test_a_failed_launch_restarts_without_the_node_it_names_until_done(tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    cfg = load_config("tiny", ["job.min_nodes=1", "job.restart_backoff_s=0"])
    rundir.config.write_text(dump_yaml(cfg))
    allocation, calls = ("node0", "node1"), []

    def launch(nodes, attempt):
        calls.append((nodes, attempt))
        if attempt == 0:  # rank 2 (node1's first) went away: the trainer's diagnosis names it
            suspect = {"rank": 2, "node": "node1", "node_index": 1, "why": "gone"}
            rundir.write_failure(0, "rank 2 went away", FAILURE_CRASH, [suspect])
            return Launch(Ended("failed", 1), "L0", nodes)
        rundir.clear_failure()
        return Launch(Ended("done", 0), "L1", nodes)

    def situation(launched):
        return Situation(slurm=False, nodes=allocation, launch_nodes=launched.nodes, ranks_per_node=2)

    decision, last = until_settled(rundir, cfg.job, allocation, launch, situation)
    assert decision.action == "done" and last.launch_id == "L1"
    assert calls == [(allocation, 0), (("node0",), 1)]  # the second launch without the node named bad
    restarts = [e for e in read_jsonl(rundir.history) if e["event"] == EVENT_RESTART]
    assert [(e["launch"], e["nodes"], e["how"]) for e in restarts] == [("L0", ["node0"], "in-job")]
    assert [e["node"] for e in read_jsonl(rundir.history) if e["event"] == "bad_node"] == ["node1"]

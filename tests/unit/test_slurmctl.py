"""The one door to Slurm's commands (hpc/slurmctl.py): its parser, and what it says with no Slurm. Against a real
cluster: tests/slurm/test_slurmctl.py."""

from __future__ import annotations

from hpc import slurmctl

NODE_LINE = (
    "NodeName=n3 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 State=DOWN+DRAIN+NOT_RESPONDING ThreadsPerCore=1 "
    "TmpDisk=0 Weight=1 Reason=Not responding [slurm@2026-12-05T04:00:00] TRES=cpu=1,mem=1M,billing=1"
)


def test_a_record_s_values_run_to_the_next_key_so_they_may_hold_spaces_and_equals_signs():
    fields = slurmctl.parse_record(NODE_LINE)
    assert fields["NodeName"] == "n3"
    assert fields["State"] == "DOWN+DRAIN+NOT_RESPONDING"
    assert fields["Reason"] == "Not responding [slurm@2026-12-05T04:00:00]"
    assert fields["TRES"] == "cpu=1,mem=1M,billing=1"
    assert slurmctl.parse_record("") == {}


def test_a_query_without_slurm_says_unknown_and_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue, no sacct
    state = slurmctl.job_state("12")
    assert state.state == "UNKNOWN" and state.finished and state.source == ""
    assert "squeue" in state.reason and "sacct (accounting) is not installed" in state.reason
    assert slurmctl.hostnames("n[1-2]") == ()
    assert slurmctl.node_states(["n1"]) == {}

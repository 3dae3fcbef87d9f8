"""The replicas' verdict (monitor.replica_check_every): who differs from the majority of the replicas of the same
part of the model, and when no node can be named; the digest sees one flipped bit. A real bit flip in a real run is
tests/mp/test_replicas.py."""

from pathlib import Path

import torch

from runconfig.layout import Layout
from trainer.env import RuntimeEnv
from trainer.observe.replicas import ReplicaCheck, digest, verdict
from trainer.parallel.topology import Topology


def env_of(world: int, per_node: int) -> RuntimeEnv:
    return RuntimeEnv(
        rank=0, world_size=world, host_local_rank=0, host_local_size=per_node, hostname="h", slurm_node=None,
        hosts=("h",) * world, one_network=True, node_names=tuple(f"n{r // per_node}" for r in range(world)),
        topology=Topology(world, per_node), simulated_nodes=True, cpus=1, slurm_job_id=None,
        slurm_restart_count=None, data_cache=Path("/tmp"),
    )  # fmt: skip


def test_the_replica_that_differs_from_the_majority_is_named_with_its_node():
    env = env_of(4, 2)
    ddp = Layout(dp_replicate=4)
    assert verdict(["a", "a", "a", "a"], ddp, env, 6) is None
    found = verdict(["a", "a", "a", "b"], ddp, env, 6)
    assert found["ranks"] == [3] and not found["unresolved"]
    assert "rank 3 (n1)" in found["message"] and "step 6" in found["message"]


def test_hsdp_compares_each_shard_with_its_own_replicas_only():
    env = env_of(4, 2)
    hsdp = Layout(dp_replicate=2, dp_shard=2)  # ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1
    assert verdict(["a", "b", "a", "b"], hsdp, env, 4) is None  # different shards differ: as they should
    found = verdict(["a", "b", "c", "b"], hsdp, env, 4)  # two replicas of shard 0 disagree: no majority
    assert found["ranks"] == [] and found["unresolved"] == [[0, 2]] and "no node is named" in found["message"]


def test_nothing_to_compare_without_replicas():
    assert not ReplicaCheck(10, Layout(dp_shard=4), env_of(4, 2)).enabled  # FSDP: every shard held once
    assert ReplicaCheck(10, Layout(dp_replicate=2, dp_shard=2), env_of(4, 2)).enabled
    assert not ReplicaCheck(0, Layout(dp_replicate=4), env_of(4, 2)).enabled


def test_the_digest_sees_one_flipped_bit():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = digest(model)
    with torch.no_grad():
        model[1].weight.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
    assert digest(model) != before
    with torch.no_grad():
        model[1].weight.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
    assert digest(model) == before


def test_a_spike_is_judged_against_the_recent_median_and_stop_names_the_step(tmp_path):
    import pytest

    from runconfig.load import load_config
    from rundir import RunDir
    from trainer.errors import UserError
    from trainer.loop.spikes import LossSpike, SpikeWatch, apply_skips, record_skip

    cfg = load_config("tiny", ["train.spike_factor=3", "train.spike_window=8"]).train
    watch = SpikeWatch(cfg)
    for step in range(1, 8):  # fewer than 8 seen: nothing is judged yet, however large
        watch.see(step, 50.0 if step == 1 else 2.0, 1.0, step * 32, lambda: None)
    watch.see(8, 2.0, 1.0, 8 * 32, lambda: None)
    watch.see(9, 5.9, 100.0, 9 * 32, lambda: None)  # below 3x the median of 2.0 (norms not judged)
    with pytest.raises(LossSpike) as spike:
        watch.see(10, 6.5, 1.0, 10 * 32, lambda: "step_00000008")
    assert spike.value.info["skip_to_position"] == 320 and "step_00000008" in spike.value.info["message"]
    stop = SpikeWatch(load_config("tiny", ["train.spike_factor=3", "train.spike_action=stop"]).train)
    for step in range(1, 9):
        stop.see(step, 2.0, 1.0, step * 32, lambda: None)
    with pytest.raises(UserError, match="loss spike at step 9.*step_00000004, is intact"):
        stop.see(9, 9.0, 1.0, 9 * 32, lambda: "step_00000004")
    norms = SpikeWatch(load_config("tiny", ["train.spike_grad_factor=4", "train.spike_window=8"]).train)
    for step in range(1, 10):  # the loss is not judged with spike_factor 0, however it grows
        norms.see(step, 2.0 * step, 0.5, step * 32, lambda: None)
    norms.see(10, 2.0, 1.9, 10 * 32, lambda: None)  # 3.8x the median norm 0.5
    with pytest.raises(LossSpike) as grad:
        norms.see(11, 2.0, 2.5, 11 * 32, lambda: "step_00000010")
    info = grad.value.info
    assert info["measure"] == "grad_norm" and info["value"] == 2.5 and info["median"] == 0.5 and info["loss"] == 2.0
    assert "gradient norm spike at step 11" in info["message"] and info["skip_to_position"] == 352
    rundir = RunDir(tmp_path / "run")
    rundir.root.mkdir()
    assert apply_skips(rundir, 8, 256) == (256, [])
    record_skip(rundir, spike.value.info)
    assert apply_skips(rundir, 8, 256)[0] == 320  # a checkpoint before the spike: its window is skipped
    assert apply_skips(rundir, 12, 384)[0] == 384  # after it: nothing to skip

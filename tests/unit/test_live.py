"""Live metrics (live.*): the config's checks, what a node's collector renders from a record and the ranks'
heartbeats, a port that is taken and a gateway that is down (warnings, never the run). A real Prometheus scraping
real runs is tests/mp/test_live.py."""

import logging
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runconfig.load import ConfigError, load_config
from rundir import RunDir
from rundir.contract import append_event
from trainer.env import RuntimeEnv
from trainer.observe.live import LiveMetrics
from trainer.parallel.topology import Topology


def node1_env(rank: int = 2) -> RuntimeEnv:
    """Rank ``rank`` of 2 nodes x 2 ranks."""
    return RuntimeEnv(
        rank=rank, world_size=4, host_local_rank=rank % 2, host_local_size=2, hostname="h", slurm_node=None,
        hosts=("h",) * 4, one_network=True, node_names=("n0", "n0", "n1", "n1"), topology=Topology(4, 2),
        simulated_nodes=True, cpus=1, slurm_job_id="77", slurm_restart_count=2, data_cache=Path("/tmp"),
    )  # fmt: skip


class Beats:
    def __init__(self, beats):
        self.beats, self.asked = beats, []

    def read(self, ranks):
        self.asked.append(list(ranks))
        return {r: b for r, b in self.beats.items() if r in ranks}


def samples(live: LiveMetrics) -> dict[tuple, float]:
    from prometheus_client import generate_latest

    out = {}
    for family in text_string_to_metric_families(generate_latest(live.registry).decode()):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("live.pushgateway", "gateway:9091", "http(s)://host:port"),
        ("live.pushgateway", "http://gw:9091/a b", "http(s)://host:port"),
        ("live.job", "a b", "label value"),
        ("live.port", "9400", "live.serve is false"),
        ("live.push_every_s", "0", "push_every_s"),
    ],
)
def test_bad_live_settings_are_named(key, value, says):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [f"{key}={value}"])
    assert key in str(err.value) and says in str(err.value)


def test_a_gateway_url_with_credentials_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["live.pushgateway=http://user:secret@gw:9091"])
    assert "live.pushgateway" in str(err.value) and "secret" not in str(err.value)


def test_a_node_shows_its_first_ranks_record_and_its_own_ranks_heartbeats(tmp_path):
    run = RunDir(tmp_path / "myrun")
    run.root.mkdir()
    append_event(run.history, "start", step=0)
    append_event(run.history, "restart", step=4)
    append_event(run.history, "resume", step=4)
    now = time.time()
    beats = Beats({
        2: {"seq": 9, "phase": "forward/backward", "step": 12, "since": now - 1.5, "beat": now - 0.5,
            "rss_mb": 100.0, "peak_mb": 120.0},
        3: {"seq": 8, "phase": "waiting for the gradient all-reduce", "step": 12, "since": now - 30, "beat": now - 9,
            "rss_mb": 50.0, "peak_mb": 60.0},
    })  # fmt: skip
    cfg = load_config("tiny", ["live.serve=true"]).live
    live = LiveMetrics(cfg, node1_env(), run, beats)
    before = samples(live)
    assert before[("hpc_running", ("node", "n1"), ("run", "myrun"))] == 1
    assert not any(k[0] == "hpc_step" for k in before)  # no record yet: no step shown
    live.update({"step": 12, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 1234.0, "unit": "tokens",
                 "step_time_s": 0.2, "time_data_s": 0.01, "time_compute_s": 0.15, "time_eval_s": 3.0,
                 "eval_loss": 2.75, "tokens_seen": 4096})  # fmt: skip
    got = samples(live)
    base = (("node", "n1"), ("run", "myrun"))
    assert got[("hpc_step", *base)] == 12 and got[("hpc_loss", *base)] == 2.5 and got[("hpc_eval_loss", *base)] == 2.75
    assert ("hpc_grad_norm", *base) not in got  # not agreed yet: not shown as 0
    assert got[("hpc_tokens_per_second", ("node", "n1"), ("run", "myrun"), ("unit", "tokens"))] == 1234.0
    parts = {dict(k[1:])["part"]: v for k, v in got.items() if k[0] == "hpc_step_part_seconds"}
    assert parts == {"data": 0.01, "compute": 0.15}  # eval time is not a part of a step
    assert got[("hpc_launches", *base)] == 3 and got[("hpc_restarts", *base)] == 1
    assert got[("hpc_slurm_restart_count", *base)] == 2 and got[("hpc_world_size", *base)] == 4
    assert beats.asked[-1] == [2, 3]  # its own node's ranks only
    rank3 = (("node", "n1"), ("rank", "3"), ("run", "myrun"))
    assert 8.5 < got[("hpc_heartbeat_age_seconds", *rank3)] < 30
    phase = ("hpc_phase_seconds", ("node", "n1"), ("phase", "waiting for the gradient all-reduce"), ("rank", "3"))
    assert 29 < got[(*phase, ("run", "myrun"))] < 60
    assert got[("hpc_memory_rss_bytes", *rank3)] == 50 * 2**20 and got[("hpc_rank_step", *rank3)] == 12
    assert not any(k[0] == "hpc_memory_device_bytes" for k in got)  # CPU ranks: no device memory
    live.update({"step": 13, "loss": 2.4, "lr": 1e-3, "eval_top-1@5": 0.5})
    got = samples(live)
    assert got[("hpc_eval_loss", *base)] == 2.75  # the newest evaluation stays shown between evaluations
    assert got[("hpc_eval_top_1_5", *base)] == 0.5  # a recipe's metric name, made a valid Prometheus name


def test_the_endpoint_serves_and_a_taken_port_costs_a_warning(tmp_path, caplog):
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    live = LiveMetrics(load_config("tiny", ["live.serve=true", "live.bind=127.0.0.1"]).live, node1_env(), run, None)
    address = live.serve()
    try:
        body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
        assert 'hpc_running{node="n1",run="r"} 1.0' in body
        port = int(address.rsplit(":", 1)[1])
        taken = LiveMetrics(
            load_config("tiny", ["live.serve=true", f"live.port={port}", "live.bind=127.0.0.1"]).live,
            node1_env(),
            run,
            None,
        )
        with caplog.at_level(logging.WARNING):
            assert taken.serve() is None
        assert f"cannot listen on port {port}" in caplog.text and "node n1" in caplog.text
    finally:
        live.close()


def test_a_gateway_that_is_down_warns_once_and_is_retried(tmp_path, caplog):
    # A port nothing listens on, held bound (never listening: connections are refused) for the whole test, so that
    # no other process can take it meanwhile.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        run = RunDir(tmp_path / "r")
        run.root.mkdir()
        cfg = load_config("tiny", [f"live.pushgateway=http://127.0.0.1:{port}", "live.push_every_s=0.05"]).live
        live = LiveMetrics(cfg, node1_env(), run, None)
        with caplog.at_level(logging.WARNING):
            live.start_pushing()
            time.sleep(0.3)
            live.close()
    warnings = [r for r in caplog.records if "cannot push" in r.getMessage()]
    assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0].getMessage() and live.pushes == 0


def test_the_endpoint_listens_on_the_nodes_address_not_every_interface(tmp_path):
    """live.bind unset: the address the node's hostname resolves to (here, as on many hosts, a loopback one), not
    0.0.0.0; the listening socket's local address in /proc/net/tcp says which."""
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    live = LiveMetrics(load_config("tiny", ["live.serve=true"]).live, node1_env(), run, None)
    address = live.serve()
    try:
        port = int(address.rsplit(":", 1)[1])
        rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        local = {r[1].split(":")[0] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port}
        node = socket.gethostbyname(socket.gethostname())
        assert local == {socket.inet_aton(node)[::-1].hex().upper()} and "00000000" not in local, local
    finally:
        live.close()

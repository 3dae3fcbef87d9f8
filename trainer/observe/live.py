"""Live metrics for Prometheus (``live.*``): the first rank of every node serves its node's metrics over HTTP, or
pushes them to a Pushgateway, or both.

What a node shows, labelled ``run`` and ``node``: its first rank's newest step record (step, loss, eval loss, lr,
tokens/s, step time and its parts, tokens seen, MFU), the run's launches, in-job restarts and Slurm requeues, and,
labelled ``rank`` too, each of its ranks' heartbeat (its age, the phase it is in and for how long, its memory), read
from the rendezvous store at each scrape or push. The loop only hands over the record (``update``: one assignment);
metrics are rendered in the server's or the pusher's thread. A port that is taken or a gateway that is down costs a
warning, never the run.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
from pathlib import Path

from runconfig.schema.live import LiveConfig
from rundir import RunDir
from rundir.contract import launches_and_restarts
from rundir.paths import read_jsonl
from storage.files import write_json_atomic
from storage.private import UnsafeFolder, private_dir
from trainer.env import RuntimeEnv, agree, patient_allgather
from trainer.observe.beats import BeatReader

log = logging.getLogger("trainer.live")
PUSH_TIMEOUT_S = 5.0
# record fields shown as they are: (record key, metric name, help)
RECORD_GAUGES = (
    ("step", "hpc_step", "The newest optimizer step this node's first rank recorded."),
    ("loss", "hpc_loss", "Training loss of that step."),
    ("lr", "hpc_lr", "Learning rate of that step."),
    ("grad_norm", "hpc_grad_norm", "Gradient norm of that step."),
    ("step_time_s", "hpc_step_seconds", "Seconds per step over the newest record's interval."),
    ("tokens_seen", "hpc_tokens_seen", "Training units (tokens) seen by the whole run."),
    ("samples_per_s", "hpc_samples_per_second", "Samples per second, whole run."),
    ("mfu", "hpc_mfu", "Model FLOPs utilization (GPU)."),
    ("time", "hpc_last_record_timestamp_seconds", "Unix time of the newest record."),
)


def target_file(rundir: RunDir) -> Path:
    """The Prometheus file_sd target file of a run: beside the run directory, one per run."""
    return rundir.root.parent / "prometheus" / f"{rundir.root.name}.json"


class LiveMetrics:
    """One node's live metrics (a prometheus_client collector), served and/or pushed."""

    def __init__(self, cfg: LiveConfig, env: RuntimeEnv, rundir: RunDir, beats: BeatReader | None) -> None:
        from prometheus_client import CollectorRegistry

        self.cfg = cfg
        self.labels = {"run": rundir.root.name, "node": env.node_names[env.rank]}
        self.ranks = env.topology.node_ranks(env.node)
        self._beats = beats
        self._record: dict | None = None
        self._evals: dict[str, float] = {}
        self._running = 1
        launches, restarts = launches_and_restarts(read_jsonl(rundir.history) if rundir.history.exists() else [])
        self._run_counts = {
            "hpc_launches": launches + 1,  # with this one (its start event comes later)
            "hpc_restarts": restarts,
            "hpc_slurm_restart_count": env.slurm_restart_count or 0,
            "hpc_world_size": env.world_size,
        }
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server = None
        self._stop = threading.Event()
        self._pusher: threading.Thread | None = None
        self._push_failing = False
        self.pushes = 0
        self.announced: Path | None = None  # rank 0's target file, removed at close

    # -- the loop's side -----------------------------------------------------------------------------------------
    def update(self, record: dict) -> None:
        """The newest step record (main thread: no I/O, no locks). Its evaluation's metrics are kept for the records
        after it (a new dict: the server's thread may be reading the old one)."""
        self._record = record
        evals = {k: v for k, v in record.items() if k.startswith("eval_") and isinstance(v, int | float)}
        if evals:
            self._evals = {**self._evals, **evals}

    # -- collector ------------------------------------------------------------------------------------------------
    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float, extra: dict | None = None) -> GaugeMetricFamily:
            extra = extra or {}
            family = GaugeMetricFamily(name, doc, labels=[*names, *extra])
            family.add_metric([*values, *extra.values()], value)
            return family

        yield gauge("hpc_running", "1 while the launch trains; 0 in the last push of a launch that ended.",
                    self._running)  # fmt: skip
        for name, value in self._run_counts.items():
            yield gauge(name, _RUN_HELP[name], value)
        record = self._record
        if record is not None:
            for key, name, doc in RECORD_GAUGES:
                if isinstance(record.get(key), int | float):
                    yield gauge(name, doc, record[key])
            if isinstance(record.get("tokens_per_s"), int | float):
                unit = str(record.get("unit") or "tokens")
                yield gauge("hpc_tokens_per_second", "The recipe's units (tokens) per second, whole run.",
                            record["tokens_per_s"], {"unit": unit})  # fmt: skip
            parts = GaugeMetricFamily("hpc_step_part_seconds", "Seconds per step in each part of the step (this "
                                      "node's first rank).", labels=[*names, "part"])  # fmt: skip
            for key, value in sorted(record.items()):
                if key.startswith("time_") and key.endswith("_s") and key != "time_eval_s" and value is not None:
                    parts.add_metric([*values, key[5:-2]], value)
            yield parts
        for key, value in sorted(self._evals.items()):  # a recipe's own names: made valid metric names
            yield gauge("hpc_" + re.sub(r"[^A-Za-z0-9_]", "_", key), f"The newest {key} (evaluation).", value)
        yield from self._rank_families(names, values)

    def _rank_families(self, names: list[str], values: list[str]):
        from prometheus_client.core import GaugeMetricFamily

        beats = self._beats.read(self.ranks) if self._beats is not None else {}
        if not beats:
            return
        now = time.time()
        rank_labels = [*names, "rank"]
        age = GaugeMetricFamily(
            "hpc_heartbeat_age_seconds", "Seconds since the rank's last heartbeat.", labels=rank_labels
        )
        step = GaugeMetricFamily("hpc_rank_step", "The step the rank is in.", labels=rank_labels)
        phase = GaugeMetricFamily("hpc_phase_seconds", "Seconds the rank has been in its current phase.",
                                  labels=[*rank_labels, "phase"])  # fmt: skip
        memory = {
            "rss_mb": GaugeMetricFamily(
                "hpc_memory_rss_bytes", "Resident host memory of the rank.", labels=rank_labels
            ),
            "peak_mb": GaugeMetricFamily(
                "hpc_memory_peak_bytes", "Peak memory of the rank (device on GPUs, host on CPU).", labels=rank_labels
            ),  # fmt: skip
            "device_mb": GaugeMetricFamily(
                "hpc_memory_device_bytes", "Device memory allocated by torch (GPU).", labels=rank_labels
            ),  # fmt: skip
        }
        for rank, beat in sorted(beats.items()):
            labels = [*values, str(rank)]
            age.add_metric(labels, max(0.0, now - float(beat["beat"])))
            step.add_metric(labels, beat["step"])
            phase.add_metric([*labels, str(beat["phase"])], max(0.0, now - float(beat["since"])))
            for key, family in memory.items():
                if isinstance(beat.get(key), int | float):
                    family.add_metric(labels, beat[key] * 2**20)
        yield from (age, step, phase, *(f for f in memory.values() if f.samples))

    # -- serving and pushing --------------------------------------------------------------------------------------
    def serve(self) -> str | None:
        """Start the HTTP endpoint; its address ('host:port'), or None (and a warning) when it cannot listen."""
        from prometheus_client import start_http_server

        try:
            addr = self.cfg.bind or socket.gethostbyname(socket.gethostname())  # the node's address, not every one
            self._server, _ = start_http_server(self.cfg.port, addr=addr, registry=self.registry)
        except OSError as exc:
            log.warning("live.serve: node %s cannot listen on port %d (%s): its metrics are not served; the run goes "
                        "on", self.labels["node"], self.cfg.port, exc)  # fmt: skip
            return None
        port = self._server.server_port
        host = self.cfg.bind if self.cfg.bind not in ("", "0.0.0.0", "::") else socket.gethostname()
        log.info("live.serve: Prometheus metrics of node %s on http://%s:%d/metrics", self.labels["node"], host, port)
        return f"{host}:{port}"

    def start_pushing(self) -> None:
        self._push()  # at once: the run shows on the gateway before the first interval ends
        self._pusher = threading.Thread(target=self._push_loop, name="hpc-live-push", daemon=True)
        self._pusher.start()

    def _push_loop(self) -> None:
        while not self._stop.wait(self.cfg.push_every_s):
            self._push()

    def _push(self) -> None:
        from prometheus_client import push_to_gateway

        try:
            push_to_gateway(self.cfg.pushgateway, job=self.cfg.job, registry=self.registry,
                            grouping_key=self.labels, timeout=PUSH_TIMEOUT_S)  # fmt: skip
        except Exception as exc:
            if not self._push_failing:
                log.warning("live.pushgateway: cannot push to %s (%s); training goes on, pushes are retried every "
                            "%g s", self.cfg.pushgateway, exc, self.cfg.push_every_s)  # fmt: skip
            self._push_failing = True
            return
        if self._push_failing:
            log.info("live.pushgateway: %s is reachable again", self.cfg.pushgateway)
        self._push_failing = False
        self.pushes += 1

    def close(self) -> None:
        """Stop serving; push once more with hpc_running 0 (the gateway keeps a finished launch's last values)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._pusher is not None:
            self._pusher.join(timeout=PUSH_TIMEOUT_S + 1)
            self._running = 0
            self._push()
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
                self._server.server_close()
        if self.announced is not None:  # the endpoints are gone, so is their target file
            with contextlib.suppress(OSError):
                self.announced.unlink()


_RUN_HELP = {
    "hpc_launches": "Launches of the run so far, this one included (starts and resumes).",
    "hpc_restarts": "In-job restarts of the run so far.",
    "hpc_slurm_restart_count": "Slurm requeues of this job (SLURM_RESTART_COUNT).",
    "hpc_world_size": "Ranks in this launch.",
}


def open_live(cfg: LiveConfig, env: RuntimeEnv, rundir: RunDir, beats: BeatReader | None, comm) -> LiveMetrics | None:
    """Every node's first rank: its live metrics, served and/or pushed (None elsewhere, or with live.* off). With
    live.serve, rank 0 writes the endpoints into the run's Prometheus target file. Collective when live.* is on."""
    if not cfg.enabled:
        return None
    live, problem = None, None
    if env.local_rank == 0:
        try:
            live = LiveMetrics(cfg, env, rundir, beats)
        except ImportError as exc:  # every rank stops (not one rank alone while the others wait below)
            problem = f"live.* needs the prometheus_client package ({exc}): pip install prometheus-client"
    agree(comm, problem)
    if cfg.serve:
        address = live.serve() if live is not None else None
        addresses = [a for a in patient_allgather(comm, address) if a]
        if env.rank == 0:
            live.announced = _announce(rundir, addresses)
    if live is not None and cfg.pushgateway:
        live.start_pushing()
    return live


def _announce(rundir: RunDir, addresses: list[str]) -> Path | None:
    """Write the file_sd target file (readable by a Prometheus running as another user: it holds no secret)."""
    path = target_file(rundir)
    try:  # a folder of this user's that others may read, never one they may write (links, replaced files)
        private_dir(path.parent, what="the Prometheus target folder", readable=True)
        write_json_atomic(path, [{"targets": addresses, "labels": {}}])
        path.chmod(0o644)  # no one else may write in the folder: this is the file just written
    except (OSError, UnsafeFolder) as exc:
        log.warning("live.serve: could not write the Prometheus target file %s: %s", path, exc)
        return None
    return path

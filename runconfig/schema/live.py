"""Live metrics for Prometheus: an endpoint per node for scraping, or pushes to a Pushgateway (batch jobs)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from runconfig.schema.fields import Problems, Range, Section, doc

GATEWAY_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[^\s@]*)?$")
JOB_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True, kw_only=True)
class LiveConfig(Section):
    serve: bool = doc(
        "Serve live metrics over HTTP for Prometheus to scrape: the first rank of every node serves its node's "
        "(step, loss, tokens/s, step-time parts, restarts; heartbeat age, phase and memory of each of its ranks), "
        "labelled run and node. The addresses are announced in RUN_DIR/../prometheus/RUN.json, a file_sd_configs "
        "target file (docs/observability.md).",
        False,
    )
    port: int = doc(
        "Port of each node's endpoint; 0 = a free port chosen at start (announced in the target file). A fixed port "
        "taken on a node (another job's) costs that node's endpoint and a warning, never the run.",
        0,
        bounds=Range(ge=0, le=65535),
    )
    bind: str = doc(
        "Address the endpoints listen on; empty = the node's own address (what its hostname resolves to: the "
        "cluster network, not every interface); 0.0.0.0 = every interface.",
        "",
    )
    pushgateway: str = doc(
        "http(s)://host:port of a Prometheus Pushgateway: the first rank of every node pushes the same metrics "
        "every live.push_every_s and once at the end (grouped by job, run and node). Empty = no pushes. A gateway "
        "that is down costs a warning, never the run.",
        "",
    )
    push_every_s: float = doc("Seconds between pushes to the Pushgateway.", 15.0, bounds=Range(gt=0))
    job: str = doc("The job label of pushes to the Pushgateway.", "hpc-trainer")

    @property
    def enabled(self) -> bool:
        return self.serve or bool(self.pushgateway)

    def relations(self) -> Problems:
        out: Problems = []
        gateway = self.pushgateway
        if gateway:
            if "@" in gateway.split("//", 1)[-1].split("/", 1)[0]:
                out.append(("pushgateway", "holds credentials (user:password@): put an authenticating proxy in front"))
            elif not GATEWAY_RE.fullmatch(gateway):
                out.append(("pushgateway", f"must be an http(s)://host:port URL of a Pushgateway, got {gateway!r}"))
        if not JOB_RE.fullmatch(self.job):
            out.append(("job", f"must be a Prometheus label value of letters, digits, '_', '.', '-', got {self.job!r}"))
        if self.port and not self.serve:
            out.append(("port", "is set but live.serve is false: nothing would listen on it"))
        return out

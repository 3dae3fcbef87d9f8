"""Sits between one task and slurmstepd's PMI socket and records the length of every PMI-1 request the task makes.

    srun --mpi=pmi2 python pmi_tap.py OUT_DIR -- COMMAND...

The task gets one end of a socket pair as its PMI_FD; this process forwards bytes both ways and, when the task
ends, writes OUT_DIR/rank<SLURM_PROCID>.json: the number of requests and the longest one (bytes, newline included).
"""

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

out_dir, command = Path(sys.argv[1]), sys.argv[3:]
assert sys.argv[2] == "--", "usage: pmi_tap.py OUT_DIR -- COMMAND..."
server = socket.socket(fileno=int(os.environ["PMI_FD"]))
ours, theirs = socket.socketpair()
lengths: list[int] = []
longest = {"bytes": 0, "start": ""}


def requests() -> None:
    pending = b""
    while data := ours.recv(65536):
        server.sendall(data)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            lengths.append(len(line) + 1)
            if len(line) + 1 > longest["bytes"]:
                longest.update(bytes=len(line) + 1, start=line[:60].decode(errors="replace"))


def responses() -> None:
    while data := server.recv(65536):
        ours.sendall(data)


for target in (requests, responses):
    threading.Thread(target=target, daemon=True).start()
proc = subprocess.Popen(command, env={**os.environ, "PMI_FD": str(theirs.fileno())}, pass_fds=(theirs.fileno(),))
theirs.close()
status = proc.wait()
record = {"requests": len(lengths), "longest": longest["bytes"], "longest_starts": longest["start"]}
(out_dir / f"rank{os.environ['SLURM_PROCID']}.json").write_text(json.dumps(record))
sys.exit(status)

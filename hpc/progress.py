"""Following a run's ``metrics.jsonl`` from the launcher: a progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import json
from pathlib import Path

from runconfig.progress import Progress

__all__ = ["MetricsFollower", "Progress"]


class MetricsFollower:
    """Reads the complete lines appended to metrics.jsonl since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

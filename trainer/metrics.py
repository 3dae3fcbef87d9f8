"""Rank 0's metrics stream (``metrics.jsonl``) and the end-of-run summary."""

from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsWriter:
    """Appends one JSON object per logged step and flushes it, so a launcher can follow the file live."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self._file = open(path, "a", buffering=1) if enabled else None  # noqa: SIM115 (closed in close())

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

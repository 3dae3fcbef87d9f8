"""Rank 0's metrics stream (``metrics.jsonl``) and the end-of-run summary."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from storage.files import write_atomic
from trainer.errors import UserError


class MetricsWriter:
    """Appends one JSON object per logged step and flushes it, so a launcher can follow the file live. The file is
    opened at the first record, after a resume has moved recomputed records out of it (truncate_metrics replaces
    the file: a writer opened before would append to the replaced one)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = Path(path), enabled
        self._file = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            if self._file is None:
                self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in close())
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        except OSError as exc:
            raise UserError(f"rank 0: cannot append to {self.path}: {exc.strerror or exc}", collective=False) from None

    def close(self) -> None:
        self.enabled = False
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):  # a full disk already reported where it happened
                file.close()


def truncate_metrics(path: Path, step: int, discarded: Path) -> int:
    """Move records of steps after ``step`` (recomputed after a resume) to ``discarded``; return how many.

    The discarded records are appended first and fsynced, then metrics.jsonl is replaced atomically: a kill in
    between leaves a record in both files (counted twice by a report), never in neither."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    keep, drop = [], []
    for line in lines:
        try:
            (keep if json.loads(line)["step"] <= step else drop).append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a killed run
    if drop:
        with open(discarded, "a") as f:
            f.write("".join(x + "\n" for x in drop))
            f.flush()
            os.fsync(f.fileno())
    if len(keep) != len(lines):
        write_atomic(path, "".join(k + "\n" for k in keep), fsync=False)
    return len(drop)

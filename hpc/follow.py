"""Following a launch's records from the launcher: its metrics (a progress bar on a terminal, plain lines otherwise)
and its history events."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rundir.progress import Progress

__all__ = ["JsonlFollower", "Progress", "resume_notes"]


class JsonlFollower:
    """Reads the complete lines appended to a JSON-lines file since the last call, only those of ``launch`` (their
    "launch" field) when given. A file replaced under it (a resume moves recomputed records out of metrics.jsonl by
    an atomic rename) is read again from its start."""

    def __init__(self, path: Path, launch: str | None = None) -> None:
        self.path, self.launch = path, launch
        self.offset, self.inode = 0, None
        self.partial = b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self.inode:
                    self.inode, self.offset, self.partial = inode, 0, b""
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
                record = json.loads(line)
            except ValueError:
                continue
            if self.launch is None or record.get("launch") == self.launch:
                out.append(record)
        return out


def resume_notes(event: dict) -> list[str]:
    """What a resume event tells the user beyond the step: the damaged checkpoints it passed over, and the steps
    trained again."""
    skipped = event.get("skipped_checkpoints") or []
    if not skipped:
        return []
    again = event.get("discarded_records", 0)
    notes = [f"warning: {message}" for message in skipped]
    notes.append(
        f"warning: resumed from step {event.get('step')}, the newest checkpoint that verifies; "
        f"{again} logged step(s) after it are trained again (their old records: metrics.discarded.jsonl)"
    )
    return notes

"""A run's progress as text: a redrawn bar on a terminal, plain periodic lines in a log file (no carriage
returns). Shared by the launcher (hpc/, following metrics.jsonl) and rank 0 of the trainer (on a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Renders step progress: a redrawn bar on a terminal, or a line per ~5% of the run in a log file."""

    def __init__(self, total_steps: int, stream: TextIO = sys.stdout, width: int = 30) -> None:
        self.total = total_steps
        self.stream = stream
        self.tty = stream.isatty()
        self.width = width
        self.start = time.monotonic()
        self.first_step_at: tuple[float, int] | None = None
        self.loss: float | None = None
        self.eval_loss: float | None = None
        self.tok_s: float | None = None
        self.step = 0
        self.next_line_step = 0

    def update(self, record: dict) -> None:
        now = time.monotonic()
        self.step = max(self.step, int(record.get("step", 0)))
        self.loss = record.get("loss", self.loss)
        self.eval_loss = record.get("eval_loss", self.eval_loss)
        self.tok_s = record.get("tokens_per_s", self.tok_s)
        if self.first_step_at is None:
            self.first_step_at = (now, self.step)
        if self.tty:
            self._draw(now)
        elif self.step >= self.next_line_step or self.step == self.total:
            self.stream.write(self._text(now) + "\n")
            self.stream.flush()
            self.next_line_step = self.step + max(1, self.total // 20)

    def tick(self) -> None:
        """Before the first record, on a terminal: show that start-up is under way (it can take a while the first
        time, when the dataset is prepared)."""
        if self.tty and self.first_step_at is None:
            elapsed = int(time.monotonic() - self.start)
            self.stream.write(
                f"\r[{'.' * self.width}] starting ranks: {elapsed}s (imports, MPI, data; a first run also "
                "prepares the dataset)\x1b[K"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _eta(self, now: float) -> str:
        if not self.first_step_at or self.step <= self.first_step_at[1]:
            return "?"
        t0, s0 = self.first_step_at
        rate = (self.step - s0) / (now - t0)
        secs = int((self.total - self.step) / rate) if rate > 0 else 0
        return f"{secs // 60}:{secs % 60:02d}"

    def _text(self, now: float) -> str:
        parts = [f"step {self.step}/{self.total}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval {self.eval_loss:.4f}")
        if self.tok_s is not None:
            parts.append(f"{self.tok_s:,.0f} tok/s")
        parts.append(f"elapsed {int(now - self.start)}s ETA {self._eta(now)}")
        return "  ".join(parts)

    def _draw(self, now: float) -> None:
        filled = int(self.width * self.step / max(1, self.total))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self._text(now)}\x1b[K")
        self.stream.flush()

"""A run's progress as text: a tqdm bar on a terminal, plain periodic lines in a log file (no carriage returns).
Shared by the launcher (hpc/, following metrics.jsonl) and rank 0 of the trainer (on a terminal)."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from tqdm import tqdm

#: The terminal bar: tqdm's percentage, bar, elapsed time and ETA; the postfix is loss, eval loss and throughput.
BAR_FORMAT = "{percentage:3.0f}%|{bar}| step {n}/{total} [{elapsed}, ETA {remaining}{postfix}]"
#: The start-up line on a terminal, until the first record arrives (hpc/local.py calls tick()).
STARTING_FORMAT = "starting ranks: {elapsed_s:.0f}s (imports, MPI, data; a first run also prepares the dataset)"


class Progress:
    """Step progress from metrics records: a tqdm bar on a terminal, or a line per ~5% of the run in a log file.

    ``update(record)`` takes a metrics record (``step``, and optionally ``loss``, ``eval_loss``, ``tokens_per_s``
    and ``unit``, what the throughput counts: "tok" unless given); ``tick()`` shows the start-up time on a
    terminal until the first record; ``close()`` ends the bar's line."""

    def __init__(self, total_steps: int, stream: TextIO | None = None) -> None:
        self.total = total_steps
        self.stream = sys.stdout if stream is None else stream
        self.tty = self.stream.isatty()
        self.start = time.monotonic()
        self.step = 0
        self.loss: float | None = None
        self.eval_loss: float | None = None
        self.tok_s: float | None = None
        self.unit = "tok"
        self.bar: tqdm | None = None  # terminal: from the first record
        self.starting: tqdm | None = None  # terminal: the start-up line, from the first tick to the first record
        self.first: tuple[float, int] | None = None  # (time, step) of the first record: the plain lines' ETA
        self.next_line_step = 0

    def update(self, record: dict) -> None:
        self.step = max(self.step, int(record.get("step", 0)))
        self.loss = record.get("loss", self.loss)
        self.eval_loss = record.get("eval_loss", self.eval_loss)
        self.tok_s = record.get("tokens_per_s", self.tok_s)
        self.unit = record.get("unit", self.unit)
        if self.tty:
            self._draw()
            return
        now = time.monotonic()
        if self.first is None:
            self.first = (now, self.step)
        if self.step >= self.next_line_step or self.step == self.total:
            self.stream.write(self._line(now) + "\n")
            self.stream.flush()
            self.next_line_step = self.step + max(1, self.total // 20)

    def tick(self) -> None:
        """Before the first record, on a terminal: show that start-up is under way (it can take a while the first
        time, when the dataset is prepared)."""
        if not self.tty or self.bar is not None:
            return
        if self.starting is None:
            self.starting = tqdm(file=self.stream, bar_format=STARTING_FORMAT, leave=False, **_shape(self.stream))
        self.starting.refresh()

    def close(self) -> None:
        if self.starting is not None:
            self.starting.leave = True  # no record came: the start-up line stays, above whatever is printed next
            self.starting.close()
            self.starting = None
        if self.bar is not None:
            self.bar.close()

    def _postfix(self) -> list[str]:
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval {self.eval_loss:.4f}")
        if self.tok_s is not None:
            parts.append(f"{self.tok_s:,.0f} {self.unit}/s")
        return parts

    def _draw(self) -> None:
        if self.bar is None:
            if self.starting is not None:
                self.starting.close()  # leave=False: its line is cleared for the bar
                self.starting = None
            self.bar = tqdm(
                total=self.total,
                initial=self.step,  # a resumed run: the rate counts only the steps of this launch
                file=self.stream,
                bar_format=BAR_FORMAT,
                postfix=", ".join(self._postfix()),
                **_shape(self.stream),
            )
            return
        self.bar.set_postfix_str(", ".join(self._postfix()), refresh=False)
        self.bar.update(self.step - self.bar.n)  # redrawn at most every 0.1 s (tqdm's mininterval)

    def _line(self, now: float) -> str:
        t0, s0 = self.first
        eta = tqdm.format_meter(self.step, self.total, now - t0, initial=s0, bar_format="{remaining}")
        parts = [f"step {self.step}/{self.total}", *self._postfix(), f"elapsed {int(now - self.start)}s ETA {eta}"]
        return "  ".join(parts)


def _shape(stream: TextIO) -> dict:
    """tqdm's size arguments: the terminal's size, followed as it changes; a fixed 100 x 24 for a terminal that
    reports no size (a pty nobody sized: tqdm would draw nothing there); tqdm's defaults for a stream without a
    file descriptor."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return {}
    if size.columns > 0 and size.lines > 0:
        return {"dynamic_ncols": True}
    return {"ncols": 100, "nrows": 24}

"""The progress text of the launcher and rank 0: a tqdm bar on a terminal, plain lines in a log file."""

import io
import types

import pytest

import rundir.progress
from rundir.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """One fake clock for the plain lines (time.monotonic) and for tqdm (tqdm.std's time)."""
    fake = Clock(1000.0)
    monkeypatch.setattr(rundir.progress, "time", types.SimpleNamespace(monotonic=fake))
    monkeypatch.setattr("tqdm.std.time", fake)
    return fake


def test_terminal_shows_start_up_then_the_bar(clock):
    out = Terminal()
    progress = Progress(10, stream=out)
    progress.tick()
    clock.now += 3
    progress.tick()
    assert "starting ranks: 3s" in out.getvalue() and "\n" not in out.getvalue()
    progress.update({"step": 5, "loss": 2.5, "tokens_per_s": 1000.0})
    drawn = out.getvalue()
    progress.tick()  # once steps arrive, tick draws nothing more
    assert out.getvalue() == drawn
    progress.close()
    text = out.getvalue()
    bar = text.rsplit("\r", 1)[-1]
    assert bar.startswith(" 50%|#####     | step 5/10 [00:00, ETA ?, loss 2.5000, 1,000 tok/s]"), bar
    assert text.endswith("\n") and text.count("\n") == 1 and "eval" not in text
    # the start-up line was cleared before the bar was drawn over it
    assert text.index("starting ranks: 3s") < text.index("\r" + " " * 20) < text.index("step 5/10")


def test_terminal_eta_counts_only_the_steps_of_this_launch(clock):
    out = Terminal()
    progress = Progress(200, stream=out)
    progress.update({"step": 100, "loss": 3.0, "tokens_per_s": 500.0, "unit": "images"})  # resumed at step 100
    clock.now += 10
    progress.update({"step": 110, "loss": 2.9, "eval_loss": 3.1, "tokens_per_s": 600.0, "unit": "images"})
    last = out.getvalue().rsplit("\r", 1)[-1]
    assert "step 110/200 [00:10, ETA 01:30, loss 2.9000, eval 3.1000, 600 images/s]" in last, last
    progress.close()


def test_close_without_a_record_keeps_the_start_up_line(clock):
    out = Terminal()
    progress = Progress(10, stream=out)
    progress.tick()
    clock.now += 2
    progress.tick()
    progress.close()  # the ranks failed before their first step: the error is printed below this line
    text = out.getvalue()
    assert text.endswith("starting ranks: 2s (imports, MPI, data; a first run also prepares the dataset)\n"), text


def test_log_file_gets_plain_lines_and_no_start_up_redraws(clock):
    out = io.StringIO()
    progress = Progress(40, stream=out)  # created at 1000; record n arrives at 1010 + n
    progress.tick()
    for step in range(1, 41):
        clock.now = 1010.0 + step
        record = {"step": step, "loss": 3.0, "tokens_per_s": 2048.0}
        progress.update(record | ({"eval_loss": 2.75} if step == 40 else {}))
    progress.close()
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and "\x1b" not in text and "starting" not in text and "|" not in text
    assert len(lines) == 21  # a line per 5% of the run, and the last step
    assert lines[0] == "step 1/40  loss 3.0000  2,048 tok/s  elapsed 11s ETA ?"
    assert lines[10] == "step 21/40  loss 3.0000  2,048 tok/s  elapsed 31s ETA 00:19"
    assert lines[-1] == "step 40/40  loss 3.0000  eval 2.7500  2,048 tok/s  elapsed 50s ETA 00:00"

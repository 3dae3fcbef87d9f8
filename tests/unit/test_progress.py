"""The launcher's progress text: a redrawn bar on a terminal, plain lines in a log file."""

import io

from runconfig.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_shows_start_up_then_the_bar():
    out = Terminal()
    progress = Progress(10, stream=out)
    progress.tick()
    assert "starting ranks: 0s" in out.getvalue() and "\n" not in out.getvalue()
    progress.update({"step": 5, "loss": 2.5, "tokens_per_s": 1000.0})
    progress.tick()  # once steps arrive, tick draws nothing more
    progress.close()
    text = out.getvalue()
    assert text.count("starting ranks") == 1 and "step 5/10" in text and "loss 2.5000" in text
    assert text.endswith("\n")


def test_log_file_gets_plain_lines_and_no_start_up_redraws():
    out = io.StringIO()
    progress = Progress(40, stream=out)
    progress.tick()
    for step in range(1, 41):
        progress.update({"step": step, "loss": 3.0})
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "starting" not in out.getvalue()
    assert lines[0].startswith("step 1/40") and lines[-1].startswith("step 40/40") and len(lines) == 21

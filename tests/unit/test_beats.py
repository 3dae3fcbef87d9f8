"""trainer/observe/beats.py's ``listening``: the roll call's first question when a collective fails (is rank 0's
store still there?), answered by a refused connection at once instead of a store client's retries for seconds."""

import socket
import time

from trainer.observe.beats import listening


def test_a_listening_port_is_found_and_a_closed_one_is_refused_at_once():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert listening("127.0.0.1", port, timeout_s=2.0)
    start = time.monotonic()
    assert not listening("127.0.0.1", port, timeout_s=5.0)  # the process that held it is gone
    assert time.monotonic() - start < 1.0

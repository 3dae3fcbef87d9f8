"""A launch wrapper that swallows a stop signal, for tests/slurm/test_selftest.py (as job.launch_prefix):

    python tests/slurm/workers/swallow_signal.py SIGNAL COMMAND [ARGS...]

blocks SIGNAL, runs COMMAND as its child and exits with the child's status. Slurm delivers a step's signal to every
process of the step, so a wrapper that merely traps the signal cannot keep it from the rank; one that blocks it
does, because a child inherits its parent's blocked mask across fork and exec: the rank's handler never runs, and
the signal stays pending until the step ends. (Launchers and runtimes that block signals in the thread that starts
their children leak them this way.)
"""

import signal
import subprocess
import sys


def main() -> int:
    name, command = sys.argv[1], sys.argv[2:]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.Signals[name]})
    # The child inherits the blocked mask, and every file descriptor (srun's PMI socket among them).
    child = subprocess.Popen(command, close_fds=False)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())

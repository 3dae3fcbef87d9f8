"""The run directory's contract, shared by the launchers (which write it) and the trainer (which fills it):
its layout, exit statuses and events, the code snapshot, checkpoint generations, the record, the stop signal's
rules (torch-free)."""

from rundir.paths import RunDir

__all__ = ["RunDir"]

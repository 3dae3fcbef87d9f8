"""The launchers' policy: how a launch ended, what follows it, the nodes left out (torch-free, login side)."""

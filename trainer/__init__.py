"""MPI-bootstrapped torch.distributed trainer. Never imports ``hpc`` or submitit."""

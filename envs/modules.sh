# shellcheck shell=bash
# Site environment for jobs: module loads (and the like) that must run before the ranks start. A template: the
# module names are examples, uncomment and adapt what your site has (`module avail`, `module spider cuda`).
#
# Use it in one of two ways:
#   - sourced by the plain sbatch scripts:   HPC_SETUP=envs/modules.sh RUN_DIR=... sbatch ... sbatch/train.sbatch
#     (relative to the submit directory; an absolute path is safer)
#   - or as the config's job.setup (one shell line each; words are re-quoted, nothing is expanded), which
#     python -m hpc.submit writes into its batch script and sbatch/*.sbatch runs before srun:
#       job:
#         setup:
#           - module load cuda/12.4 nccl
#           - source /shared/venvs/hpc-trainer/bin/activate
#
# Fabric settings (InfiniBand, NCCL, UCX) are NOT set here: they belong in the config's job.env, the one place
# that reaches every rank, is recorded in RUN_DIR/config.yaml with the run, and is applied by both hpc.submit and
# sbatch/*.sbatch. Examples of what goes there (values depend on the nodes: `ibv_devinfo`, `ip -br link`):
#       job:
#         env:
#           NCCL_IB_HCA: mlx5_0            # which HCA(s) NCCL uses for inter-node traffic
#           NCCL_SOCKET_IFNAME: ib0        # interface for NCCL's bootstrap and socket fallback
#           UCX_NET_DEVICES: mlx5_0:1      # device:port for UCX (used by Open MPI / UCX-based MPI)
# The same as exports, only for trying something out by hand (commented out on purpose; prefer job.env):
#   export NCCL_IB_HCA=mlx5_0
#   export NCCL_SOCKET_IFNAME=ib0
#   export UCX_NET_DEVICES=mlx5_0:1
#   export NCCL_DEBUG=INFO                 # one-off debugging: NCCL's choice of transport and interfaces

# `module` is a shell function defined by Lmod/Environment Modules; batch shells that are not login shells may
# lack it. Load the site's init script when needed (path varies: /etc/profile.d/lmod.sh, modules.sh, ...).
if ! command -v module > /dev/null 2>&1; then
  for init in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh /usr/share/lmod/lmod/init/bash; do
    if [ -f "$init" ]; then
      # shellcheck source=/dev/null
      source "$init"
      break
    fi
  done
fi

# Examples (uncomment what applies):
# module purge
# module load cuda/12.4 nccl            # CUDA runtime and NCCL matching the torch wheel (see requirements-cuda.txt)
# module load openmpi/4.1               # only when mpi4py is built against the site MPI instead of a wheel
# source /shared/venvs/hpc-trainer/bin/activate   # or set PYTHON=/shared/venvs/hpc-trainer/bin/python

# shellcheck shell=bash
# Site environment for jobs: the module loads that must run before the ranks start. As shipped it loads the
# environment envs/site/build.sh builds (Debian's Lmod, Open MPI with PMIx, mpi4py built against it; tested in
# tests/slurm/test_site.py); a site points it at its own modules with two variables, or edits the last lines:
#   HPC_MODULEPATH   folders `module use` adds (default: /opt/hpc-site/modulefiles, the build's)
#   HPC_MODULES      modules to load, space-separated (default: hpc-trainer, which loads openmpi/4.1)
#
# Use it in one of two ways:
#   - sourced by the plain sbatch scripts:   HPC_SETUP=envs/modules.sh RUN_DIR=... sbatch ... sbatch/train.sbatch
#     (relative to the submit directory; an absolute path is safer). PYTHON may then stay unset: the module puts
#     its venv's python first on PATH.
#   - or as the config's job.setup (one shell line each; words are re-quoted, nothing is expanded), which
#     python -m hpc.submit writes into its batch script and sbatch/*.sbatch runs before srun:
#       job:
#         setup:
#           - module use /opt/hpc-site/modulefiles
#           - module load hpc-trainer
#     Submit from a shell with the same module loaded, so that the job's python is the module's.
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
  for init in /usr/share/lmod/lmod/init/bash /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do
    if [ -f "$init" ]; then
      # shellcheck source=/dev/null
      source "$init"
      break
    fi
  done
fi
command -v module > /dev/null 2>&1 || { echo "envs/modules.sh: no module command (Lmod or Environment Modules)" >&2; return 2; }

for hpc_modulepath in ${HPC_MODULEPATH:-/opt/hpc-site/modulefiles}; do
  module use "$hpc_modulepath"
done
# shellcheck disable=SC2086  # the list is split into module names on purpose
module load ${HPC_MODULES:-hpc-trainer} || { echo "envs/modules.sh: module load ${HPC_MODULES:-hpc-trainer} failed" >&2; return 2; }
unset hpc_modulepath
# A GPU site adds its own, e.g.: module load cuda/12.4 nccl   (matching the torch wheel: requirements-cuda.txt)

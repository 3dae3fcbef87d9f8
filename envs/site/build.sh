#!/usr/bin/env bash
# The way most sites start a job, built on this machine from Debian's packages: Lmod, Open MPI 4.1 with PMIx, and
# the project's environment in a venv whose mpi4py is compiled against that Open MPI, behind two modulefiles.
#
#   bash envs/site/build.sh install          # Debian's lmod, openmpi-bin, libopenmpi-dev (root; idempotent)
#   bash envs/site/build.sh packages         # print those Debian packages
#   bash envs/site/build.sh build [PREFIX]   # PREFIX/venv and PREFIX/modulefiles (idempotent; ~3 min the first
#                                            # time, mostly mpi4py's compile; pip caches the wheel after that)
#   bash envs/site/build.sh check [PREFIX]   # module load hpc-trainer, then say which MPI mpi4py uses
#
# PREFIX defaults to $HPC_SITE_PREFIX, else /opt/hpc-site. Then, in a job script or a config's job.setup:
#   module use PREFIX/modulefiles
#   module load hpc-trainer              # loads openmpi/4.1 too; PATH gets the venv's python (and $PYTHON)
# and the ranks start under `srun --mpi=pmix` (job.mpi: auto picks it for Open MPI). envs/modules.sh does the
# same for the plain sbatch scripts (HPC_SETUP=envs/modules.sh).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PREFIX=${2:-${HPC_SITE_PREFIX:-/opt/hpc-site}}
PYTHON=${HPC_SITE_PYTHON:-python3}  # the interpreter the venv is made from
MPI_VERSION=4.1
# mpi4py's pin from the project's requirements: the same release as the wheel, here compiled
MPI4PY=$(grep -E '^mpi4py==' "$REPO/envs/requirements-cpu.txt")

die() { echo "build.sh: $*" >&2; exit 1; }

PACKAGES=(lmod openmpi-bin libopenmpi-dev)

cmd_install() {
  bash "$HERE/../debian.sh" "${PACKAGES[@]}"
}

write_modulefiles() {
  local version
  version=$("$PREFIX/venv/bin/python" -c "import importlib.metadata as m; print(m.version('hpc-trainer'))")
  mkdir -p "$PREFIX/modulefiles/openmpi" "$PREFIX/modulefiles/hpc-trainer"
  # Debian's Open MPI is on the default paths already; the module is what a site's looks like (the variables
  # build tools and users read) and what hpc-trainer depends on.
  cat > "$PREFIX/modulefiles/openmpi/$MPI_VERSION.lua" <<EOF
-- Debian's Open MPI $(mpirun --version | head -1 | awk '{print $NF}') with PMIx (written by envs/site/build.sh)
whatis("Name: openmpi")
whatis("Description: Open MPI with PMIx; start ranks with srun --mpi=pmix")
family("mpi")
setenv("MPI_HOME", "/usr")
setenv("MPICC", "/usr/bin/mpicc")
prepend_path("LD_LIBRARY_PATH", "/usr/lib/x86_64-linux-gnu/openmpi/lib")
-- PMIx's security plugin: munge is not linked into Debian's PMIx; native is what srun's pmix plugin uses here
setenv("PMIX_MCA_psec", "native")
EOF
  cat > "$PREFIX/modulefiles/hpc-trainer/$version.lua" <<EOF
-- The hpc-trainer environment in $PREFIX/venv (written by envs/site/build.sh)
whatis("Name: hpc-trainer")
whatis("Version: $version")
whatis("Description: python -m hpc.submit and the trainer; mpi4py built against openmpi/$MPI_VERSION")
depends_on("openmpi/$MPI_VERSION")
prepend_path("PATH", "$PREFIX/venv/bin")
setenv("PYTHON", "$PREFIX/venv/bin/python")
setenv("VIRTUAL_ENV", "$PREFIX/venv")
EOF
}

cmd_build() {
  command -v mpicc >/dev/null || die "no mpicc: run \`bash envs/site/build.sh install\` first"
  # One build at a time: a second waits for the first (tests/run.sh starts one beside the suite, and
  # tests/slurm/test_site.py's own build waits for it here), then finds the work done.
  mkdir -p "$(dirname "$PREFIX")"
  exec 9>"$PREFIX.build-lock"
  flock 9
  [ -x "$PREFIX/venv/bin/python" ] || "$PYTHON" -m venv "$PREFIX/venv"
  local pip=("$PREFIX/venv/bin/pip" install --quiet --disable-pip-version-check)
  # Everything of the pinned set but the MPICH wheel and the binary mpi4py
  grep -vE '^(mpich|mpi4py)==' "$REPO/envs/requirements-cpu.txt" > "$PREFIX/requirements.txt"
  "${pip[@]}" -r "$PREFIX/requirements.txt"
  if ! "$PREFIX/venv/bin/python" -c "from mpi4py import MPI; assert 'Open MPI' in MPI.Get_library_version()" 2>/dev/null; then
    # HPC_SITE_CFLAGS: added to the compile's flags (tests/run.sh: -O0, 16 s instead of 118 on 2 cores)
    CFLAGS="${CFLAGS:-} ${HPC_SITE_CFLAGS:-}" MPICC=/usr/bin/mpicc "${pip[@]}" --no-binary mpi4py --force-reinstall \
      --no-deps "$MPI4PY"
  fi
  "${pip[@]}" --no-deps -e "$REPO"
  write_modulefiles
  chmod -R go-w "$PREFIX"
}

cmd_check() {
  # shellcheck source=/dev/null
  source /usr/share/lmod/lmod/init/bash
  module use "$PREFIX/modulefiles"
  module load hpc-trainer
  module list 2>&1
  "$PYTHON" -c "from mpi4py import MPI; print(MPI.Get_library_version().strip())"
}

case "${1:-}" in
  install) cmd_install ;;
  packages) echo "${PACKAGES[@]}" ;;
  build) cmd_build ;;
  check) PYTHON=python cmd_check ;;
  *) die "usage: build.sh install|packages|build|check [PREFIX]" ;;
esac

#!/usr/bin/env bash
# The project's test command (README Quickstart, and .ci/run): installs everything it needs (Slurm, munge,
# slurmdbd, MariaDB, shellcheck, Prometheus, nodejs, Lmod and Open MPI from Debian's packages, s3rver from npm; Python
# packages into .venv and the site venv of envs/site/build.sh), then lints and runs the whole suite: unit, multi-process under mpirun, and Slurm and S3 tests against real local
# clusters and servers that the tests start and stop.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# With accounting: tests/slurm/test_accounting.py also runs slurmdbd + MariaDB (Debian packages).
HPC_SLURM_ACCOUNTING=1 bash envs/slurm/cluster.sh install >/dev/null
# A site's way of starting (tests/slurm/test_site.py): Debian's Lmod and Open MPI with PMIx, and a venv with mpi4py
# built against that Open MPI behind modulefiles, in /opt/hpc-site (envs/site/build.sh; ~3 min the first time).
bash envs/site/build.sh install
bash envs/site/build.sh build >/dev/null
# The S3-compatible server the object-storage tests start (envs/s3/server.sh: nodejs and npm from Debian, s3rver).
bash envs/s3/server.sh install
# Prometheus and its Pushgateway (Debian's), which tests/mp/test_live.py starts with envs/prometheus/server.sh.
bash envs/prometheus/server.sh install
# Debian's shellcheck, which tests/slurm/test_sbatch_scripts.py runs on every shell script.
if ! command -v shellcheck >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends shellcheck >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -r envs/requirements-cpu.txt -r envs/requirements-test.txt -e .
# bench/data.py's litdata comparison (its smoke test runs it): without the dependencies litdata does not need.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps -r envs/requirements-bench.txt
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two workers (pytest-xdist): the Slurm tests on one, every other test module on either (tests/conftest.py, WorkUnits).
# HPC_TEST_WORKERS=0 runs everything in this one process.
exec .venv/bin/python -m pytest -n "${HPC_TEST_WORKERS:-2}" --dist loadfile "$@"

#!/usr/bin/env bash
# The project's test command (README Quickstart, and .ci/run): installs everything it needs (Slurm, munge,
# slurmdbd, MariaDB, shellcheck, Prometheus, nodejs, Lmod, Open MPI and Chromium from Debian's packages, s3rver from
# npm; Python packages into .venv and the site venv of envs/site/build.sh, the latter beside the tests), then lints
# and runs the whole suite: unit, multi-process under mpirun, and Slurm and S3 tests against real local clusters and
# servers that the tests start and stop.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Debian's packages, in one apt pass (envs/debian.sh): Slurm and munge, with slurmdbd + MariaDB for
# tests/slurm/test_accounting.py; Lmod and Open MPI with PMIx for a site's way of starting (tests/slurm/test_site.py);
# nodejs and npm for the S3 server; Prometheus and its Pushgateway (tests/mp/test_live.py); shellcheck, which
# tests/slurm/test_sbatch_scripts.py runs on every shell script; Chromium, the headless browser that opens
# `hpc ui` (tests/mp/test_tracking.py).
# shellcheck disable=SC2046  # each script prints its packages as words
bash envs/debian.sh $(HPC_SLURM_ACCOUNTING=1 bash envs/slurm/cluster.sh packages) $(bash envs/site/build.sh packages) \
  $(bash envs/s3/server.sh packages) $(bash envs/prometheus/server.sh packages) shellcheck chromium
HPC_SLURM_ACCOUNTING=1 bash envs/slurm/cluster.sh install >/dev/null
bash envs/prometheus/server.sh install
# Then the installs side by side (network, a compile, disk; none needs another): s3rver from npm
# (envs/s3/server.sh) and the Python packages of .venv, waited for; and the site's venv with mpi4py compiled
# against that Open MPI, behind modulefiles in /opt/hpc-site (envs/site/build.sh), not waited for: the first time
# it takes about a minute (at a lower priority than the tests), and only tests/slurm/test_site.py,
# minutes into the Slurm tests, needs it (its own `build.sh build` waits for this one, then finds the work done).
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
python_packages() {
  .venv/bin/pip install --quiet --disable-pip-version-check -r envs/requirements-cpu.txt -r envs/requirements-test.txt -e .
  # bench/data.py's litdata comparison (its smoke test runs it): without the dependencies litdata does not need.
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps -r envs/requirements-bench.txt
}
logs=$(mktemp -d)
site_log=$(mktemp -t hpc-site-build.XXXXXX.log)
echo "tests/run.sh: building the site environment beside the tests (envs/site/build.sh; its output: $site_log)"
# Its mpi4py compiled without optimisation (HPC_SITE_CFLAGS): it only starts MPI for test_site.py's ranks, and at -O0
# the compile takes 16 CPU-s instead of 118, which the tests beside it would otherwise share the cores with.
HPC_SITE_CFLAGS=-O0 nice -n 10 bash envs/site/build.sh build >"$site_log" 2>&1 &
bash envs/s3/server.sh install >"$logs/s3" 2>&1 &
s3=$!
python_packages >"$logs/python" 2>&1 &
python=$!
failed=0
for job in "s3:$s3" "python:$python"; do
  if ! wait "${job#*:}"; then
    echo "tests/run.sh: the ${job%%:*} install failed:" >&2
    cat "$logs/${job%%:*}" >&2
    failed=1
  fi
done
rm -rf "$logs"
[ "$failed" = 0 ] || exit 1
# The project's bytecode, compiled once: where PYTHONDONTWRITEBYTECODE is set (as on the CI machine) every rank and
# tool process would otherwise compile the modules it imports again (about 0.05 CPU-s each, thousands of processes).
.venv/bin/python -m compileall -q -j 0 bench examples hpc runconfig rundir storage tests tracking trainer >/dev/null
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Three workers (pytest-xdist) on 2 cores: the Slurm tests on one, every other test module on any (tests/conftest.py,
# WorkUnits); a third keeps the cores busy while two wait (Slurm's passes, sleeps): docs/measurements/test-suite.md.
# HPC_TEST_WORKERS=0 runs everything in this one process.
# --no-loadscope-reorder: the units in WorkUnits' order (longest first), not by their number of tests.
exec .venv/bin/python -m pytest -n "${HPC_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"

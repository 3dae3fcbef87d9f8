#!/usr/bin/env bash
# The project's test command (README Quickstart, and .ci/run): installs everything it needs into .venv, then
# lints and runs the whole suite (unit, multi-process under mpirun).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -r envs/requirements-cpu.txt -e .
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"

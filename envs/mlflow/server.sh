#!/usr/bin/env bash
# A real MLflow tracking server on this host for tests and local use: `mlflow server` (the `mlflow` package of the
# test extra, envs/requirements-test.txt) over a SQLite store, artifacts proxied into its state folder.
#
#   bash envs/mlflow/server.sh start  [STATE_DIR] # start on 127.0.0.1:HPC_MLFLOW_PORT, wait until /health answers
#   bash envs/mlflow/server.sh stop   [STATE_DIR] # stop it (every worker); its store stays in STATE_DIR
#   bash envs/mlflow/server.sh status [STATE_DIR] # running or not, and where
#   bash envs/mlflow/server.sh wipe   [STATE_DIR] # stop, then delete STATE_DIR
#
# Runs then track to it with `tracking.uri: http://127.0.0.1:PORT` (or MLFLOW_TRACKING_URI). STATE_DIR defaults to
# $HPC_MLFLOW_STATE, else /tmp/hpc-mlflow; PYTHON (default: the python on PATH) must have the mlflow package.
set -euo pipefail

PORT=${HPC_MLFLOW_PORT:-19300}
START_TIMEOUT=${HPC_MLFLOW_START_TIMEOUT:-60}
STATE=${2:-${HPC_MLFLOW_STATE:-/tmp/hpc-mlflow}}
PYTHON=${PYTHON:-python}

die() { echo "server.sh: $*" >&2; exit 1; }

pid_of() { [ -f "$STATE/mlflow.pid" ] && kill -0 "$(cat "$STATE/mlflow.pid")" 2>/dev/null && cat "$STATE/mlflow.pid"; }

healthy() { "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; }

cmd_start() {
  "$PYTHON" -c "import mlflow.server, flask" 2>/dev/null ||
    die "$PYTHON has no MLflow server: pip install -r envs/requirements-test.txt"
  if pid_of >/dev/null; then return 0; fi
  mkdir -p "$STATE/artifacts"
  chmod 700 "$STATE"
  # One worker, no job runner: ~2 processes and ~0.5 GB instead of ~10 and 2.4 GB (../shared/notes/services.md).
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$PYTHON" -m mlflow server --host 127.0.0.1 --port "$PORT" \
    --backend-store-uri "sqlite:///$STATE/mlflow.db" --artifacts-destination "$STATE/artifacts" --workers 1 \
    >>"$STATE/mlflow.log" 2>&1 < /dev/null &
  echo $! > "$STATE/mlflow.pid"
  local waited=0
  until healthy; do
    pid_of >/dev/null || die "mlflow server exited at start; see $STATE/mlflow.log"
    [ "$waited" -lt $((START_TIMEOUT * 5)) ] || die "mlflow server did not answer on port $PORT in ${START_TIMEOUT}s"
    sleep 0.2
    waited=$((waited + 1))
  done
}

cmd_stop() {
  local pid
  pid=$(pid_of) || { rm -f "$STATE/mlflow.pid"; return 0; }
  kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true  # its session: the server and its workers
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 -- "-$pid" 2>/dev/null || true
  rm -f "$STATE/mlflow.pid"
}

cmd_status() {
  if pid=$(pid_of); then echo "mlflow server running (pid $pid) on http://127.0.0.1:$PORT, store in $STATE"
  else echo "mlflow server not running (state $STATE)"; return 1; fi
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  wipe) cmd_stop; rm -rf -- "$STATE" ;;
  *) die "usage: $0 start|stop|status|wipe [STATE_DIR]" ;;
esac

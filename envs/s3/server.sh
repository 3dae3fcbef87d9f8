#!/usr/bin/env bash
# A real S3-compatible object store on this host for tests and local use: s3rver (npm), which keeps its objects on
# disk, so they survive a restart of the server (as a real store's do). Run as root for `install`.
#
#   bash envs/s3/server.sh install            # nodejs + npm (Debian) and s3rver into HPC_S3_HOME (idempotent)
#   bash envs/s3/server.sh start  [STATE_DIR] # start on 127.0.0.1:HPC_S3_PORT, wait until it answers (idempotent)
#   bash envs/s3/server.sh stop   [STATE_DIR] # stop it; its objects stay in STATE_DIR/data
#   bash envs/s3/server.sh status [STATE_DIR] # running or not, and where
#   bash envs/s3/server.sh wipe   [STATE_DIR] # stop, then delete STATE_DIR
#
# Then `source STATE_DIR/env.sh` points boto3, s3fs and this package at it: AWS_ENDPOINT_URL and the server's fixed
# test credentials (S3RVER / S3RVER; it refuses any other key with 403). STATE_DIR defaults to $HPC_S3_STATE, else
# /tmp/hpc-s3. Buckets: HPC_S3_BUCKETS (space-separated, default "hpc-test") are created at start.
set -euo pipefail

S3RVER_VERSION=3.7.1
HOME_DIR=${HPC_S3_HOME:-/opt/hpc-s3rver}   # where npm installs s3rver
PORT=${HPC_S3_PORT:-19000}
BUCKETS=${HPC_S3_BUCKETS:-hpc-test}
START_TIMEOUT=${HPC_S3_START_TIMEOUT:-30}
STATE=${2:-${HPC_S3_STATE:-/tmp/hpc-s3}}
BIN=$HOME_DIR/node_modules/.bin/s3rver
PACKAGES=(nodejs npm)  # Debian's, where node and npm are missing

die() { echo "server.sh: $*" >&2; exit 1; }

cmd_packages() {  # Debian's node and npm, unless both are there already (from any source)
  command -v node >/dev/null && command -v npm >/dev/null || echo "${PACKAGES[@]}"
}

cmd_install() {
  # shellcheck disable=SC2046  # words
  bash "$(dirname "$0")/../debian.sh" $(cmd_packages)
  if [ ! -x "$BIN" ] || ! grep -q "\"version\": \"$S3RVER_VERSION\"" "$HOME_DIR/node_modules/s3rver/package.json"; then
    mkdir -p "$HOME_DIR"
    npm install --prefix "$HOME_DIR" --no-audit --no-fund --loglevel=error "s3rver@$S3RVER_VERSION" >/dev/null
  fi
  [ -x "$BIN" ] || die "s3rver did not install into $HOME_DIR"
}

pid_of() { [ -f "$STATE/s3rver.pid" ] && kill -0 "$(cat "$STATE/s3rver.pid")" 2>/dev/null && cat "$STATE/s3rver.pid"; }

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

cmd_start() {
  [ -x "$BIN" ] || die "s3rver is not installed: run \`bash envs/s3/server.sh install\` first"
  if pid_of >/dev/null; then return 0; fi
  mkdir -p "$STATE/data"
  chmod 700 "$STATE"
  local args=(-d "$STATE/data" -a 127.0.0.1 -p "$PORT" --silent)
  for bucket in $BUCKETS; do args+=(--configure-bucket "$bucket"); done
  setsid "$BIN" "${args[@]}" >>"$STATE/s3rver.log" 2>&1 < /dev/null &
  echo $! > "$STATE/s3rver.pid"
  cat > "$STATE/env.sh" <<EOF
# The local S3 server of envs/s3/server.sh (test credentials: the server accepts only these).
export AWS_ENDPOINT_URL=http://127.0.0.1:$PORT
export AWS_ACCESS_KEY_ID=S3RVER
export AWS_SECRET_ACCESS_KEY=S3RVER
export AWS_DEFAULT_REGION=us-east-1
EOF
  local waited=0
  until answers; do
    pid_of >/dev/null || die "s3rver exited at start; see $STATE/s3rver.log"
    [ "$waited" -lt $((START_TIMEOUT * 10)) ] || die "s3rver did not answer on port $PORT in ${START_TIMEOUT}s"
    sleep 0.1
    waited=$((waited + 1))
  done
  sleep 0.3
  pid_of >/dev/null || die "port $PORT answers, but not this s3rver (it exited: see $STATE/s3rver.log): another server holds it"
}

cmd_stop() {
  local pid
  pid=$(pid_of) || { rm -f "$STATE/s3rver.pid"; return 0; }
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$STATE/s3rver.pid"
}

cmd_status() {
  if pid=$(pid_of); then echo "s3rver running (pid $pid) on http://127.0.0.1:$PORT, objects in $STATE/data"
  else echo "s3rver not running (state $STATE)"; return 1; fi
}

case "${1:-}" in
  install) cmd_install ;;
  packages) cmd_packages ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  wipe) cmd_stop; rm -rf "$STATE" ;;
  *) die "usage: server.sh install|packages|start|stop|status|wipe [STATE_DIR]" ;;
esac

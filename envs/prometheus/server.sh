#!/usr/bin/env bash
# A real Prometheus and Pushgateway on this host (Debian's packages) for tests and local use: Prometheus scrapes the
# runs' live endpoints through their file_sd target files (live.serve) and the Pushgateway (live.pushgateway).
#
#   bash envs/prometheus/server.sh install        # apt-get install prometheus prometheus-pushgateway (if missing)
#   bash envs/prometheus/server.sh start [STATE]  # start both, wait until they answer
#   bash envs/prometheus/server.sh stop  [STATE]  # stop both; the samples stay in STATE/data
#   bash envs/prometheus/server.sh status [STATE] # running or not, and where
#   bash envs/prometheus/server.sh wipe  [STATE]  # stop, then delete STATE
#
# Prometheus listens on 127.0.0.1:HPC_PROMETHEUS_PORT (19400), the Pushgateway on 127.0.0.1:HPC_PUSHGATEWAY_PORT
# (19401). HPC_PROMETHEUS_TARGETS is the glob of target files to scrape (default: ./runs/prometheus/*.json, where
# runs under ./runs announce themselves), every HPC_PROMETHEUS_SCRAPE (a Prometheus duration, default 1s). STATE
# defaults to $HPC_PROMETHEUS_STATE, else /tmp/hpc-prometheus.
set -euo pipefail

PORT=${HPC_PROMETHEUS_PORT:-19400}
GATEWAY_PORT=${HPC_PUSHGATEWAY_PORT:-19401}
SCRAPE=${HPC_PROMETHEUS_SCRAPE:-1s}
TARGETS=${HPC_PROMETHEUS_TARGETS:-$PWD/runs/prometheus/*.json}
START_TIMEOUT=${HPC_PROMETHEUS_START_TIMEOUT:-30}
STATE=${2:-${HPC_PROMETHEUS_STATE:-/tmp/hpc-prometheus}}

PACKAGES=(prometheus prometheus-pushgateway curl)

die() { echo "server.sh: $*" >&2; exit 1; }

pid_of() { [ -f "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null && cat "$STATE/$1.pid"; }

answers() { curl -fsS -o /dev/null --max-time 2 "$1" 2>/dev/null; }

cmd_packages() {  # Debian's, unless both servers are there already
  command -v prometheus >/dev/null && command -v prometheus-pushgateway >/dev/null || echo "${PACKAGES[@]}"
}

cmd_install() {
  # The packages' services are not started (policy-rc.d): this script starts them.
  # shellcheck disable=SC2046  # words
  bash "$(dirname "$0")/../debian.sh" $(cmd_packages)
}

# A start that fails stops what it started: nothing is left holding a port for the next start to mistake for its own.
fail_start() { cmd_stop; die "$@"; }

wait_for() { # NAME URL
  local waited=0
  until answers "$2"; do
    pid_of "$1" >/dev/null || fail_start "$1 exited at start; see $STATE/$1.log"
    [ "$waited" -lt $((START_TIMEOUT * 5)) ] || fail_start "$1 did not answer at $2 in ${START_TIMEOUT}s"
    sleep 0.2
    waited=$((waited + 1))
  done
}

cmd_start() {
  command -v prometheus >/dev/null || die "no prometheus: bash $0 install"
  mkdir -p "$STATE/data"
  chmod 700 "$STATE"
  cat > "$STATE/prometheus.yml" <<YAML
global:
  scrape_interval: ${SCRAPE}
  evaluation_interval: ${SCRAPE}
scrape_configs:
  - job_name: hpc-trainer
    file_sd_configs:
      - files: ['$TARGETS']
        refresh_interval: ${SCRAPE}
  - job_name: pushgateway
    honor_labels: true
    static_configs:
      - targets: ['127.0.0.1:$GATEWAY_PORT']
YAML
  local port
  for port in "$GATEWAY_PORT" "$PORT"; do
    if ! pid_of pushgateway >/dev/null && ! pid_of prometheus >/dev/null && answers "http://127.0.0.1:$port/-/ready"
    then
      die "port $port already answers (another Prometheus or Pushgateway): set HPC_PROMETHEUS_PORT/HPC_PUSHGATEWAY_PORT"
    fi
  done
  if ! pid_of pushgateway >/dev/null; then
    setsid prometheus-pushgateway --web.listen-address="127.0.0.1:$GATEWAY_PORT" \
      >>"$STATE/pushgateway.log" 2>&1 < /dev/null &
    echo $! > "$STATE/pushgateway.pid"
  fi
  if ! pid_of prometheus >/dev/null; then
    setsid prometheus --config.file="$STATE/prometheus.yml" --storage.tsdb.path="$STATE/data" \
      --web.listen-address="127.0.0.1:$PORT" >>"$STATE/prometheus.log" 2>&1 < /dev/null &
    echo $! > "$STATE/prometheus.pid"
  fi
  wait_for pushgateway "http://127.0.0.1:$GATEWAY_PORT/-/ready"
  wait_for prometheus "http://127.0.0.1:$PORT/-/ready"
}

stop_one() {
  local pid
  pid=$(pid_of "$1") || { rm -f "$STATE/$1.pid"; return 0; }
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$STATE/$1.pid"
}

cmd_stop() { stop_one prometheus; stop_one pushgateway; }

cmd_status() {
  local ok=0 pid
  for name in prometheus pushgateway; do
    if pid=$(pid_of "$name"); then
      echo "$name running (pid $pid), state in $STATE"
    else
      echo "$name not running"
      ok=1
    fi
  done
  echo "prometheus: http://127.0.0.1:$PORT  pushgateway: http://127.0.0.1:$GATEWAY_PORT"
  return "$ok"
}

case "${1:-}" in
  install) cmd_install ;;
  packages) cmd_packages ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  wipe) cmd_stop; rm -rf -- "$STATE" ;;
  *) die "usage: $0 install|packages|start|stop|status|wipe [STATE]" ;;
esac

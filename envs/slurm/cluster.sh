#!/usr/bin/env bash
# A real single-machine Slurm 22.05 cluster (Debian packages) for tests and local use: munged, slurmctld and one
# slurmd per fake node, all on this host, all state, config and logs in one directory. Run as root.
#
#   bash envs/slurm/cluster.sh install            # apt packages + the libpmix.so symlink (idempotent)
#   bash envs/slurm/cluster.sh packages           # print the Debian packages `install` needs
#   bash envs/slurm/cluster.sh start  [STATE_DIR] # write config, start daemons, wait for the nodes (idempotent)
#   bash envs/slurm/cluster.sh stop   [STATE_DIR] # cancel all jobs, stop the daemons; keep state and logs
#   bash envs/slurm/cluster.sh status [STATE_DIR] # sinfo
#   bash envs/slurm/cluster.sh wipe   [STATE_DIR] # stop, then delete STATE_DIR (job ids restart at 1)
#
# Then `source STATE_DIR/env.sh` to point sbatch/srun/squeue/scontrol at this cluster (SLURM_CONF).
# STATE_DIR defaults to $HPC_SLURM_STATE, else /tmp/hpc-slurm. See envs/slurm/README.md for the settings and why.
#
# Accounting (sacct, sacctmgr): HPC_SLURM_ACCOUNTING=1 makes `install` add slurmdbd and mariadb-server, and
# `start` run a private mariadbd (data, socket, pid and log under STATE_DIR/mysql; TCP on 127.0.0.1 port
# HPC_SLURM_DB_PORT, default ctld port + 3) and slurmdbd (STATE_DIR/slurmdbd.conf, port HPC_SLURM_DBD_PORT,
# default ctld port + 2), with slurm.conf pointing at them. `stop`/`wipe` stop them whenever their pid files exist.
# HPC_SLURM_MIN_JOB_AGE (Slurm's MinJobAge, default 300 s): how long the controller keeps a finished job.
# HPC_SLURM_FIRST_JOB_ID (default 1): the first job id; clusters running jobs on one host at once need apart ones.
#
# Separate hosts: HPC_SLURM_NETNS=1 runs each slurmd (and so every job step on that node) in its own network, UTS
# and mount namespace: host name n<i>, its own address HPC_SLURM_SUBNET.<i> on an interface named ic0, joined to the
# controller (HPC_SLURM_SUBNET.254) and the other nodes by a bridge, and an /etc/hosts naming them all. Ranks on two
# nodes then talk over that link, not over loopback or shared memory, as on a cluster. HPC_SLURM_LINK_RATE (e.g.
# 1gbit) shapes each node's link with tbf at both ends (this kernel has no netem: rate, not delay).
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge libpmix2 iproute2)
ACCOUNTING=${HPC_SLURM_ACCOUNTING:-0}
if [ "$ACCOUNTING" = 1 ]; then PACKAGES+=(slurmdbd mariadb-server); fi
NODES=${HPC_SLURM_NODES:-2}               # fake nodes n1..nN, one slurmd each
CPUS=${HPC_SLURM_CPUS:-4}                 # per node; may exceed the real core count (config_overrides)
GPUS=${HPC_SLURM_GPUS:-2}                 # fake GPUs per node (character devices)
CTLD_PORT=${HPC_SLURM_CTLD_PORT:-16817}   # off the default 6817 so a system Slurm is not disturbed
NODE_PORT0=${HPC_SLURM_NODE_PORT:-17001}  # node i listens on NODE_PORT0 + i - 1
START_TIMEOUT=${HPC_SLURM_START_TIMEOUT:-60}
DBD_PORT=${HPC_SLURM_DBD_PORT:-$((CTLD_PORT + 2))}  # slurmdbd (accounting only)
DB_PORT=${HPC_SLURM_DB_PORT:-$((CTLD_PORT + 3))}    # its private mariadbd, 127.0.0.1 only (accounting only)
MIN_JOB_AGE=${HPC_SLURM_MIN_JOB_AGE:-300}         # s a finished job stays in scontrol (Slurm's default)
FIRST_JOB_ID=${HPC_SLURM_FIRST_JOB_ID:-1}         # the first job's id (distinct per cluster where several share a host)
NETNS=${HPC_SLURM_NETNS:-0}                       # 1: every node its own network namespace (see above)
LINK_RATE=${HPC_SLURM_LINK_RATE:-}                # tbf rate of each node's link (netns only); empty: unshaped
SLURMD_TIMEOUT=${HPC_SLURM_SLURMD_TIMEOUT:-300}   # s without an answer before a node is marked DOWN (Slurm's default)
MESSAGE_TIMEOUT=${HPC_SLURM_MESSAGE_TIMEOUT:-10} # s an RPC waits for its answer (Slurm's default); a ping to a lost node
                                                  # waits this long, and the next ping round waits for it
# A /24 per cluster, told apart by the controller's port (16817 -> 10.65.177.0/24); the bridge is named after it.
SUBNET=${HPC_SLURM_SUBNET:-10.$(((CTLD_PORT >> 8) & 255)).$((CTLD_PORT & 255))}
BRIDGE=hpcbr$CTLD_PORT

die() { echo "cluster.sh: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------------- install
cmd_install() {
  bash "$(dirname "$0")/../debian.sh" "${PACKAGES[@]}"
  # Slurm's mpi/pmix plugin dlopens the unversioned libpmix.so, which only libpmix-dev would provide. A symlink
  # to the versioned library does the same. (A running slurmd must be restarted after this, or pmix steps hang.)
  local lib
  lib=$(dpkg -L libpmix2 | grep '/pmix2/lib/libpmix\.so\.2$' | head -n 1)
  [ -n "$lib" ] || die "libpmix.so.2 not found in package libpmix2"
  if [ ! -e "${lib%.2}" ]; then
    ln -s libpmix.so.2 "${lib%.2}"
    echo "created ${lib%.2} -> libpmix.so.2"
  fi
}

# ---------------------------------------------------------------------------------------------------- config
write_config() {
  local host mem_mb i last_port
  host=$(hostname -s)
  last_port=$((NODE_PORT0 + NODES - 1))
  # RealMemory defaults to 1 MB, which rejects any job with --mem; give each fake node an equal share.
  mem_mb=$(( $(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo) / NODES ))

  local ctld_addr=127.0.0.1 node_lines
  node_lines="NodeName=n[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$NODE_PORT0-$last_port] CPUs=$CPUS RealMemory=$mem_mb Gres=gpu:$GPUS State=UNKNOWN"
  if [ "$NETNS" = 1 ]; then
    ctld_addr=$SUBNET.254
    node_lines=$(for i in $(seq 1 "$NODES"); do
      echo "NodeName=n$i NodeHostname=n$i NodeAddr=$SUBNET.$i Port=$((NODE_PORT0 + i - 1)) CPUs=$CPUS RealMemory=$mem_mb Gres=gpu:$GPUS State=UNKNOWN"
    done)
  fi

  cat > "$STATE/slurm.conf" <<EOF
# Generated by envs/slurm/cluster.sh; rewritten on every start.
ClusterName=hpc-local
SlurmctldHost=$host($ctld_addr)
SlurmctldPort=$CTLD_PORT
# Job ids from here: clusters that run jobs on one host at once must not share them (MPICH names its shared-memory
# segments after the PMI job id, Slurm's "JOBID.STEPID": two steps 1.0 of two clusters would share, and hang in, them).
FirstJobId=$FIRST_JOB_ID
# root runs everything: no slurm user, file ownership or spool permissions to manage.
SlurmUser=root
SlurmdUser=root

# munged of this cluster (its own socket in the state dir). cred_expire: a requeued job may start only
# cred_expire+1 s after it ended (default 120 s); 5 makes requeue/preemption tests take ~6 s.
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5,socket=$STATE/munge/munge.socket.2

StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Per-node TMPDIR for jobs; the pmix plugin puts its per-step directories here, and without %n the fake nodes
# (same host, same job and step ids) collide.
TmpFS=$STATE/tmp-%n
MailProg=/bin/true

# No cgroups (no systemd here, and all fake nodes share one host): track processes by parent pid, no binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# A finished job leaves the controller (scontrol) at its first purge pass MinJobAge s after it ended.
MinJobAge=$MIN_JOB_AGE
$(accounting_config)
# Nodes declare more CPUs than the machine has; slurmd would otherwise report the real count and be drained.
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
# A node that was down (e.g. after stop/start) comes back by itself when its slurmd registers.
ReturnToService=2

# Requeue: jobs are requeueable by default (submitit relies on it); fast scheduling passes; KILL 5 s after TERM.
JobRequeue=1
SchedulerParameters=sched_interval=2,bf_interval=1
KillWait=5
# A node that does not answer for this long is marked DOWN and its jobs end with NODE_FAIL (or, with --no-kill,
# continue without it).
SlurmdTimeout=$SLURMD_TIMEOUT
MessageTimeout=$MESSAGE_TIMEOUT

# Preemption: a job in a higher-PriorityTier partition requeues the jobs of a lower one on the same nodes.
# preempt_send_user_signal delivers the job's --signal when it is picked; SIGTERM follows after GraceTime.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal

GresTypes=gpu
$node_lines
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=20
PartitionName=urgent Nodes=n[1-$NODES] MaxTime=INFINITE State=UP PriorityTier=10
EOF

  # Fake GPUs: gres needs File= character devices (regular files are rejected, a line without File= is silently
  # dropped). c 1 3 is /dev/null's number. The trailing digit becomes the index in CUDA_VISIBLE_DEVICES.
  : > "$STATE/gres.conf"
  for i in $(seq 1 "$NODES"); do
    mkdir -p "$STATE/dev/n$i" "$STATE/tmp-n$i" "$STATE/spool-n$i"
    for g in $(seq 0 $((GPUS - 1))); do
      [ -c "$STATE/dev/n$i/nvidia$g" ] || mknod "$STATE/dev/n$i/nvidia$g" c 1 3
    done
    echo "NodeName=n$i Name=gpu File=$STATE/dev/n$i/nvidia[0-$((GPUS - 1))]" >> "$STATE/gres.conf"
  done

  if [ "$ACCOUNTING" = 1 ]; then write_dbd_config; fi

  # Callers source this to reach the cluster; nothing is written to /etc/slurm.
  echo "export SLURM_CONF=$STATE/slurm.conf" > "$STATE/env.sh"
}

accounting_config() {  # the accounting lines of slurm.conf
  if [ "$ACCOUNTING" = 1 ]; then
    cat <<EOF
# Accounting: this cluster's slurmdbd (STATE/slurmdbd.conf) over its private mariadbd. jobacct_gather/linux
# samples the jobs' processes from /proc (no cgroups needed) for sacct's MaxRSS, CPU time etc.
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# Clients reach slurmdbd through the munged named here, not AuthInfo's (else they try /run/munge and fail).
AccountingStoragePass=$STATE/munge/munge.socket.2
EOF
  else
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
  fi
}

write_dbd_config() {
  # mariadbd runs as the mysql user, which must own its data dir and be able to write its log there.
  install -d -o mysql -g mysql -m 0750 "$STATE/mysql"
  cat > "$STATE/mysql/my.cnf" <<EOF
# Generated by envs/slurm/cluster.sh: this cluster's private MariaDB (not the system's /var/lib/mysql).
[mysqld]
user=mysql
datadir=$STATE/mysql/data
socket=$STATE/mysql/mysqld.sock
pid-file=$STATE/mysql/mariadbd.pid
log-error=$STATE/mysql/mariadbd.log
bind-address=127.0.0.1
port=$DB_PORT
skip-name-resolve
# Slurm's recommended InnoDB settings, except the buffer pool; a test database needs no fsync per commit.
innodb_buffer_pool_size=128M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
innodb_flush_log_at_trx_commit=2
# Plain file I/O: container seccomp profiles often forbid io_uring; a tiny database does not miss it.
innodb_use_native_aio=0

[client]
socket=$STATE/mysql/mysqld.sock
user=root
EOF
  chmod 0644 "$STATE/mysql/my.cnf"
  # slurmdbd reads slurmdbd.conf next to slurm.conf (SLURM_CONF's directory) and refuses it unless it is owned
  # by SlurmUser (root here) and mode 600: it holds the database password.
  if [ ! -s "$STATE/mysql/slurm.pass" ]; then
    (umask 077 && od -An -N12 -tx1 /dev/urandom | tr -d ' \n' > "$STATE/mysql/slurm.pass")
  fi
  (umask 077 && cat > "$STATE/slurmdbd.conf") <<EOF
# Generated by envs/slurm/cluster.sh; rewritten on every start.
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket.2
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$STATE/mysql/slurm.pass")
StorageLoc=slurm_acct_db
EOF
  chown root:root "$STATE/slurmdbd.conf"
  chmod 0600 "$STATE/slurmdbd.conf"
}

# ---------------------------------------------------------------------------------------------------- daemons
alive() {  # alive PIDFILE: the pid in it runs (a zombie, left for init to reap, counts as gone)
  [ -s "$1" ] && pid_alive "$(cat "$1")"
}

pid_alive() { [ -e "/proc/$1" ] && ! grep -q '^[^)]*) Z' "/proc/$1/stat" 2>/dev/null; }

node_pidfiles() {
  local i
  for i in $(seq 1 "$NODES"); do echo "$STATE/slurmd-n$i.pid"; done
}

all_alive() {  # every daemon runs, and accounting is on in slurm.conf exactly when asked for
  local f on=0
  if grep -q '^AccountingStorageType=accounting_storage/slurmdbd' "$STATE/slurm.conf"; then on=1; fi
  [ "$on" = "$ACCOUNTING" ] || return 1
  for f in $(node_pidfiles) $(ns_pidfiles) "$STATE/slurmctld.pid" "$STATE/munge/munged.pid"; do
    alive "$f" || return 1
  done
  if [ "$ACCOUNTING" = 1 ]; then
    for f in "$STATE/slurmdbd.pid" "$STATE/mysql/mariadbd.pid"; do alive "$f" || return 1; done
  fi
}

wait_for() {  # wait_for DESCRIPTION COMMAND...: poll every 0.2 s; on timeout show the logs, stop, fail
  local deadline=$((SECONDS + START_TIMEOUT)) what=$1
  shift
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "cluster.sh: timed out after ${START_TIMEOUT}s waiting for $what" >&2
      show_logs
      cmd_stop >&2
      exit 1
    fi
    sleep 0.2
  done
}

show_logs() {
  local f
  for f in "$STATE"/log/*.log "$STATE"/munge/munged.log "$STATE"/mysql/mariadbd.{log,out}; do
    [ -f "$f" ] || continue
    echo "---- tail $f" >&2
    tail -n 20 "$f" >&2
  done
}

nodes_up() {  # every node responding and usable (idle, or running jobs kept across a restart)
  local states
  states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u) || return 1
  [ "$(grep -cE ' (idle|mixed|allocated)$' <<< "$states")" -eq "$NODES" ]
}

start_munged() {
  # munged refuses keys and sockets in directories others may write; a munge-owned 0755 directory passes.
  install -d -o munge -g munge -m 0755 "$STATE/munge"
  if [ ! -s "$STATE/munge/munge.key" ]; then
    dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
  fi
  chown munge:munge "$STATE/munge/munge.key"
  chmod 0400 "$STATE/munge/munge.key"
  rm -f "$STATE/munge/munge.socket.2"*
  runuser -u munge -- /usr/sbin/munged \
    --key-file="$STATE/munge/munge.key" --socket="$STATE/munge/munge.socket.2" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
    --seed-file="$STATE/munge/munged.seed"
  wait_for munged test -S "$STATE/munge/munge.socket.2"
}

gone() {  # gone NAME PID: a daemon we wait for has exited (e.g. its port was taken): show why, stop, fail now
  if [ -n "$2" ] && ! pid_alive "$2"; then
    show_logs
    cmd_stop >&2
    die "$1 exited during start-up; see the logs above"
  fi
}

mariadb_up() {
  gone mariadbd "$mariadbd_pid"
  mariadb-admin --defaults-file="$STATE/mysql/my.cnf" --connect-timeout=2 ping > /dev/null 2>&1
}

dbd_up() {
  if [ -s "$STATE/slurmdbd.pid" ]; then gone slurmdbd "$(cat "$STATE/slurmdbd.pid")"; fi
  timeout 10 sacctmgr -n list cluster > /dev/null 2>&1
}

ctld_registered() {  # the controller has connected to slurmdbd: the cluster's row shows its port
  [ "$(sacctmgr -n -P list cluster hpc-local format=ControlPort 2>/dev/null)" = "$CTLD_PORT" ]
}

start_accounting() {  # private mariadbd, the slurm database user, slurmdbd, the cluster registered in it
  if [ ! -d "$STATE/mysql/data/mysql" ]; then  # first start: create the data dir (kept across stop/start)
    mariadb-install-db --defaults-file="$STATE/mysql/my.cnf" --auth-root-authentication-method=socket \
      --auth-root-socket-user=root --skip-test-db > "$STATE/log/mariadb-install-db.log" 2>&1 \
      || { tail -n 20 "$STATE/log/mariadb-install-db.log" >&2; die "mariadb-install-db failed"; }
  fi
  rm -f "$STATE/mysql/mysqld.sock"
  # mariadbd does not daemonize: run it in the background in its own session; it drops to the mysql user.
  setsid /usr/sbin/mariadbd --defaults-file="$STATE/mysql/my.cnf" < /dev/null >> "$STATE/mysql/mariadbd.out" 2>&1 &
  mariadbd_pid=$!
  wait_for mariadbd mariadb_up
  # root logs in over the socket (unix_socket auth); slurmdbd over TCP with the password.
  mariadb --defaults-file="$STATE/mysql/my.cnf" <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$STATE/mysql/slurm.pass")';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
  /usr/sbin/slurmdbd  # forks into the background and writes its pid file; creates its tables on first start
  wait_for slurmdbd dbd_up
  gone slurmdbd "$(cat "$STATE/slurmdbd.pid" 2>/dev/null || echo 0)"  # not some other slurmdbd on its port
  if ! sacctmgr -n -P list cluster format=Cluster | grep -qx hpc-local; then
    sacctmgr -i add cluster hpc-local > /dev/null
  fi
}

# ---------------------------------------------------------------------------------------------------- netns
# Each node's namespaces are held by a `sleep infinity` (pid in STATE/ns-n<i>.pid) started by unshare: network, UTS
# (its host name) and mount (its /etc/hosts, bind-mounted; every other mount stays visible, unlike `ip netns exec`,
# which remounts /sys and hides the cgroup mounts). slurmd enters them with nsenter; its job steps inherit them.
ns_pidfiles() {  # this start's holders; stop_namespaces stops whatever holders an earlier start left
  local i
  if [ "$NETNS" != 1 ]; then return; fi
  for i in $(seq 1 "$NODES"); do echo "$STATE/ns-n$i.pid"; done
}

start_namespaces() {
  local host i pid veth
  host=$(hostname -s)
  ip link show "$BRIDGE" > /dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$SUBNET.254/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  { echo "127.0.0.1 localhost"; echo "$SUBNET.254 $host"; for i in $(seq 1 "$NODES"); do echo "$SUBNET.$i n$i"; done; } \
    > "$STATE/hosts"
  for i in $(seq 1 "$NODES"); do
    unshare --net --uts --mount --propagation private \
      sh -c "hostname n$i && mount --bind '$STATE/hosts' /etc/hosts && exec sleep infinity" \
      < /dev/null > /dev/null 2>> "$STATE/log/netns.log" &
    pid=$!
    echo "$pid" > "$STATE/ns-n$i.pid"
    wait_for "node n$i's namespaces" ns_ready "$pid" "n$i"
    veth=hv${CTLD_PORT}n$i
    ip link del "$veth" 2> /dev/null || true
    ip link add "$veth" type veth peer name ic0 netns "$pid"
    ip link set "$veth" master "$BRIDGE" up
    nsenter -t "$pid" --net sh -c "ip link set lo up && ip addr add $SUBNET.$i/24 dev ic0 && ip link set ic0 up"
    if [ -n "$LINK_RATE" ]; then
      tc qdisc replace dev "$veth" root tbf rate "$LINK_RATE" burst 256kb latency 50ms
      nsenter -t "$pid" --net tc qdisc replace dev ic0 root tbf rate "$LINK_RATE" burst 256kb latency 50ms
    fi
  done
}

ns_ready() {  # ns_ready PID NAME: the holder has its host name and /etc/hosts (so unshare and mount are done)
  gone "node $2's namespace holder" "$1"
  [ "$(nsenter -t "$1" --uts hostname 2> /dev/null)" = "$2" ] && nsenter -t "$1" --mount grep -q " $2\$" /etc/hosts
}

stop_namespaces() {
  local files=()
  mapfile -t files < <(compgen -G "$STATE/ns-n*.pid" || true)
  stop_pidfiles "${files[@]}"  # the last process in a namespace gone, the kernel removes it and its veth
  if ip link show "$BRIDGE" > /dev/null 2>&1; then ip link del "$BRIDGE"; fi
}

cmd_start() {
  [ "$(id -u)" = 0 ] || die "run as root"
  command -v slurmctld > /dev/null || die "Slurm is not installed; run: bash $0 install"
  if [ "$ACCOUNTING" = 1 ] && ! { command -v slurmdbd && command -v mariadbd; } > /dev/null; then
    die "accounting (slurmdbd, mariadb-server) is not installed; run: HPC_SLURM_ACCOUNTING=1 bash $0 install"
  fi
  export SLURM_CONF="$STATE/slurm.conf"
  if [ -f "$SLURM_CONF" ] && all_alive && sinfo > /dev/null 2>&1; then
    echo "already running: source $STATE/env.sh"
    return
  fi
  cmd_stop > /dev/null  # clear any half-started leftovers
  local t0 i
  t0=$(date +%s.%N)
  mkdir -p "$STATE/log" "$STATE/ctld"
  write_config
  start_munged
  if [ "$ACCOUNTING" = 1 ]; then start_accounting; fi
  # Both daemons fork into the background and write their pid files.
  if [ "$NETNS" = 1 ]; then start_namespaces; fi
  /usr/sbin/slurmctld
  for i in $(seq 1 "$NODES"); do
    if [ "$NETNS" = 1 ]; then
      nsenter -t "$(cat "$STATE/ns-n$i.pid")" --net --uts --mount /usr/sbin/slurmd -N "n$i"
    else
      /usr/sbin/slurmd -N "n$i"
    fi
  done
  wait_for "$NODES nodes to come up" nodes_up
  if [ "$ACCOUNTING" = 1 ]; then
    wait_for "slurmctld to register with slurmdbd" ctld_registered
    sacct -n -X > /dev/null || die "sacct does not answer"
  fi
  sinfo
  echo "cluster up in $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}") s; use it with: source $STATE/env.sh"
}

descendants() {  # every process below pid $1
  local p
  for p in $(ps -o pid= --ppid "$1"); do
    echo "$p"
    descendants "$p"
  done
}

stop_pids() {  # stop_pids PID...: TERM, wait up to 10 s, then KILL
  local p left
  [ "$#" -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for _ in $(seq 50); do
    left=0
    for p in "$@"; do pid_alive "$p" && left=1; done
    [ "$left" = 0 ] && return
    sleep 0.2
  done
  kill -KILL "$@" 2>/dev/null || true
}

stop_pidfiles() {  # stop_pidfiles FILE...: stop the daemons named in the pid files, remove the files
  local f pids=()
  for f in "$@"; do
    alive "$f" && pids+=("$(cat "$f")")
    rm -f "$f"
  done
  stop_pids "${pids[@]}"
  stopped=$((stopped + ${#pids[@]}))
}

cancel_jobs() {  # scancel every job and wait (up to 30 s) until none runs or completes
  local jobs=()
  mapfile -t jobs < <(squeue -h -o %A 2>/dev/null)
  [ "${#jobs[@]}" -gt 0 ] || return 0
  scancel "${jobs[@]}" || true
  for _ in $(seq 150); do
    [ -z "$(squeue -h -t running,completing -o %A 2>/dev/null)" ] && return
    sleep 0.2
  done
}

cmd_stop() {
  local stopped=0 files=() steps=() p
  export SLURM_CONF="$STATE/slurm.conf"
  # A stopped test cluster runs nothing: cancel all jobs while the daemons still answer, so Slurm records them
  # as ended. (Killing their processes behind Slurm's back would leave jobs it believes RUNNING forever.)
  if alive "$STATE/slurmctld.pid"; then cancel_jobs; fi
  # slurmd first, while slurmctld and munged still answer its last messages; else each waits out a timeout.
  mapfile -t files < <(node_pidfiles)
  stop_pidfiles "${files[@]}"
  stop_pidfiles "$STATE/slurmctld.pid"
  # Accounting (if it ran): slurmdbd once slurmctld has sent its last records, then its database.
  stop_pidfiles "$STATE/slurmdbd.pid"
  stop_pidfiles "$STATE/mysql/mariadbd.pid"
  stop_pidfiles "$STATE/munge/munged.pid"
  # Last resort for job processes that outlived the cancel (slurmstepd outlives slurmd by design). They belong
  # to this cluster when they inherited its SLURM_CONF from our slurmd.
  for p in $(pgrep -x slurmstepd || true); do
    if { tr '\0' '\n' < "/proc/$p/environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF"; then
      mapfile -t -O "${#steps[@]}" steps < <(echo "$p"; descendants "$p")
    fi
  done
  stop_pids "${steps[@]}"
  stop_namespaces
  echo "stopped $stopped daemons and ${#steps[@]} leftover job processes; logs kept in $STATE/log"
}

cmd_status() {
  export SLURM_CONF="$STATE/slurm.conf"
  [ -f "$SLURM_CONF" ] || die "no cluster in $STATE"
  sinfo
}

cmd_wipe() {
  cmd_stop
  rm -rf "$STATE"
  echo "wiped $STATE (job ids restart at $FIRST_JOB_ID: use a fresh log folder per run, a reused %j folder can hold old results)"
}

# ---------------------------------------------------------------------------------------------- node loss
# A node lost as hardware is lost (separate hosts only): its link goes down first, so no FIN or RST of its dying
# connections reaches a peer, then its slurmd and every process on it (job steps, ranks) are SIGKILLed at once.
# Its peers see silence; slurmctld marks it DOWN after SlurmdTimeout. node-up brings the link and slurmd back
# (ReturnToService=2 returns it to service when it registers).
node_index() {  # node_index NAME: i of n<i>, checked against this cluster's separate hosts
  local i=${1#n}
  if ! [[ "$1" =~ ^n[0-9]+$ ]] || ! [ -f "$STATE/ns-n$i.pid" ]; then
    die "no separate host named '$1' in $STATE (node-down and node-up need HPC_SLURM_NETNS=1 and a node n1..nN)"
  fi
  alive "$STATE/ns-n$i.pid" || die "node $1's namespace holder is gone: restart the cluster"
  echo "$i"
}

node_link() {  # node_link I: the host side of node i's link (named after the port of the cluster in STATE)
  echo "hv$(sed -n 's/^SlurmctldPort=//p' "$STATE/slurm.conf")n$1"
}

cmd_node_down() {
  local i holder space p killed=0
  i=$(node_index "$NODE")
  holder=$(cat "$STATE/ns-n$i.pid")
  space=$(readlink "/proc/$holder/ns/net")
  ip link set "$(node_link "$i")" down
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    if [ "$p" = "$holder" ] || [ "$(readlink "/proc/$p/ns/net" 2> /dev/null)" != "$space" ]; then continue; fi
    kill -KILL "$p" 2> /dev/null && killed=$((killed + 1))
  done
  rm -f "$STATE/slurmd-$NODE.pid"
  echo "node $NODE lost: link down, $killed processes killed (slurmd among them)"
}

cmd_node_up() {
  local i
  i=$(node_index "$NODE")
  export SLURM_CONF="$STATE/slurm.conf"
  ip link set "$(node_link "$i")" up
  alive "$STATE/slurmd-$NODE.pid" || nsenter -t "$(cat "$STATE/ns-n$i.pid")" --net --uts --mount /usr/sbin/slurmd -N "$NODE"
  echo "node $NODE back: link up, slurmd started"
}

# ---------------------------------------------------------------------------------------------------- main
case "${1:-}" in
  node-down | node-up) NODE=${2:-}; STATE=$(realpath -m "${3:-${HPC_SLURM_STATE:-/tmp/hpc-slurm}}") ;;
  *) STATE=$(realpath -m "${2:-${HPC_SLURM_STATE:-/tmp/hpc-slurm}}") ;;
esac
case "${1:-}" in
  install) cmd_install ;;
  packages) echo "${PACKAGES[@]}" ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  wipe) cmd_wipe ;;
  node-down) cmd_node_down ;;
  node-up) cmd_node_up ;;
  *) echo "usage: $0 {install|packages|start|stop|status|wipe} [STATE_DIR] | {node-down|node-up} NODE [STATE_DIR]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# A cluster of hosts on this machine, for tests, demos and benchmarks: each host a network
# namespace on one bridge with no route out, running a real Spark standalone master (the
# head) or Worker (each worker host) from the pyspark package.
#
#   scripts/cluster.sh up N [--services]   N worker hosts and the head (--services: also
#                                          ZooKeeper and Kafka on a host of their own)
#   scripts/cluster.sh down                stop everything `up` started, remove its hosts
#   scripts/cluster.sh status              one line per host; exit 3 if no cluster is up
#   scripts/cluster.sh crash HOST          SIGKILL every process of HOST
#   scripts/cluster.sh restart HOST        HOST boots again: its daemons start again
#   scripts/cluster.sh partition HOST      cut HOST's link (no reset: packets vanish)
#   scripts/cluster.sh slow HOST RATE      throttle HOST's link both ways (tc tbf), e.g. 2mbit
#   scripts/cluster.sh heal [HOST]         undo partition and slow (every host if none given)
#   scripts/cluster.sh exec HOST CMD...    run CMD on HOST (SPARK_LOCAL_IP etc. set)
#   scripts/cluster.sh master              print the master URL
#
# Hosts are named PREFIX+head, PREFIX+w1..wN and PREFIX+svc (PREFIX: $TANDEM_CLUSTER_PREFIX,
# default td); HOST may also be given without the prefix (head, w1, svc). Addresses come
# from the RFC 2544 test range 198.18.0.0/15 and exist only inside these namespaces: the
# head is 198.18.0.1, the services host 198.18.0.2, worker K 198.18.0.(10+K). The bridge has
# no address, and no host has a default route, so nothing reaches outside.
#
# Everything `up` creates or starts is recorded under $TANDEM_CLUSTER_DIR (default .cluster/)
# before it exists (run/objects: bridge, links, namespaces; run/pids: daemons), and `down`
# removes exactly that: SIGTERM to every process in the recorded namespaces, SIGKILL after
# $TANDEM_CLUSTER_STOP_GRACE seconds, then the namespaces, links and bridge. `up` first
# cleans up whatever a previous run recorded and left (a crashed test session). Logs stay
# in .cluster/logs/ and the Spark work directories (executor logs) in .cluster/work/HOST/.
#
# Environment (defaults in brackets): TANDEM_CLUSTER_DIR [.cluster], TANDEM_CLUSTER_PREFIX
# [td], TANDEM_CLUSTER_PYTHON [.venv/bin/python: the interpreter with pyspark and tandem],
# TANDEM_CLUSTER_WORKER_CORES [2], TANDEM_CLUSTER_WORKER_MEMORY [1g],
# TANDEM_CLUSTER_DAEMON_MEMORY [256m], TANDEM_CLUSTER_START_TIMEOUT [120 s],
# TANDEM_CLUSTER_STOP_GRACE [5 s].
#
# Exit codes: 0 ok; 1 failed (the message says what and what to do); 2 usage; 3 `status`:
# no cluster is up.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${TANDEM_CLUSTER_DIR:-$ROOT/.cluster}"
RUN="$STATE/run"
PREFIX="${TANDEM_CLUSTER_PREFIX:-td}"
PYTHON="${TANDEM_CLUSTER_PYTHON:-$ROOT/.venv/bin/python}"
WORKER_CORES="${TANDEM_CLUSTER_WORKER_CORES:-2}"
WORKER_MEMORY="${TANDEM_CLUSTER_WORKER_MEMORY:-1g}"
DAEMON_MEMORY="${TANDEM_CLUSTER_DAEMON_MEMORY:-256m}"
START_TIMEOUT="${TANDEM_CLUSTER_START_TIMEOUT:-120}"
STOP_GRACE="${TANDEM_CLUSTER_STOP_GRACE:-5}"
NET=198.18.0
MASTER_PORT=7077
BRIDGE="${PREFIX}br0"

say() { printf 'cluster: %s\n' "$*"; }
die() {
  printf 'cluster: error: %s\n' "$*" >&2
  exit 1
}

usage() {
  sed -n '6,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# -- checks ---------------------------------------------------------------------------------

need_root() {
  local missing=()
  ((EUID == 0)) || die "this needs root (it creates network namespaces, links and a bridge, and runs processes in them): run it with sudo, or as root as CI does"
  command -v ip >/dev/null 2>&1 || missing+=("ip (Debian: apt-get install -y iproute2)")
  command -v tc >/dev/null 2>&1 || missing+=("tc (Debian: apt-get install -y iproute2)")
  command -v setsid >/dev/null 2>&1 || missing+=("setsid (Debian: apt-get install -y util-linux)")
  ((${#missing[@]} == 0)) || die "missing: ${missing[*]}"
  ip netns list >/dev/null 2>&1 || die "'ip netns list' failed: this kernel or container does not allow network namespaces (needs CAP_SYS_ADMIN and CONFIG_NET_NS)"
}

check_prefix() {
  [[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,5}$ ]] ||
    die "TANDEM_CLUSTER_PREFIX=$PREFIX: use 1-6 lower-case letters or digits, starting with a letter (link names are limited to 15 characters)"
}

spark_home() { # -> the pyspark package's folder (holds bin/spark-class and jars/)
  [[ -x "$PYTHON" ]] ||
    die "no Python at $PYTHON: create the project's environment first (make install), or point TANDEM_CLUSTER_PYTHON at an interpreter with pyspark and tandem installed"
  local home
  home="$("$PYTHON" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))' 2>/dev/null)" ||
    die "$PYTHON cannot import pyspark: pip install ./spark_integration (it brings pyspark) into that environment"
  [[ -x "$home/bin/spark-class" ]] || die "$home/bin/spark-class is missing: reinstall pyspark"
  printf '%s' "$home"
}

check_java() {
  local java
  if [[ -n "${JAVA_HOME:-}" && -x "$JAVA_HOME/bin/java" ]]; then
    java="$JAVA_HOME/bin/java"
  else
    java="$(command -v java || true)"
  fi
  [[ -n "$java" ]] || die "Java not found: Spark needs Java 17 (Debian: apt-get install -y openjdk-17-jre-headless), or set JAVA_HOME"
}

# -- names ----------------------------------------------------------------------------------

host_name() { # HOST as given (with or without the prefix) -> the recorded namespace name
  local want="$1" name
  [[ -f "$RUN/hosts" ]] || die "no cluster is up (no $RUN/hosts): scripts/cluster.sh up N"
  while read -r name _; do
    if [[ "$name" == "$want" || "$name" == "$PREFIX$want" ]]; then
      printf '%s' "$name"
      return 0
    fi
  done <"$RUN/hosts"
  die "no host '$want' in this cluster; its hosts: $(cut -d' ' -f1 "$RUN/hosts" | tr '\n' ' ')"
}

host_field() { # HOST FIELD(2 role, 3 address, 4 root-side link)
  awk -v h="$1" -v f="$2" '$1 == h { print $f }' "$RUN/hosts"
}

record() { # kind name: written before the object exists, so that `down` finds a half `up`
  mkdir -p "$RUN"
  printf '%s %s\n' "$1" "$2" >>"$RUN/objects"
}

# -- processes ------------------------------------------------------------------------------

start_time() { # pid -> its start time in clock ticks (field 22 of /proc/PID/stat), or nothing
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 0
  stat="${stat##*) }"
  # shellcheck disable=SC2086 # split the fields on purpose
  set -- $stat
  printf '%s' "${20}"
}

alive() { # pid: alive and not a zombie
  kill -0 "$1" 2>/dev/null || return 1
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  [[ "${stat:0:1}" != Z ]]
}

netns_pids() { # namespace -> PIDs of every process in it, one a line
  ip netns pids "$1" 2>/dev/null || true
}

# Start a daemon on a host, in its own session (a terminal's Ctrl-C does not reach it),
# and record its PID with its start time (PIDs get reused).
launch() { # host role log cmd...
  local host="$1" role="$2" log="$3" addr pid
  shift 3
  addr="$(host_field "$host" 3)"
  [[ -f "$log" ]] && mv -f "$log" "$log.prev"
  mkdir -p "$STATE/work/$host/local"
  ip netns exec "$host" env SPARK_LOCAL_IP="$addr" SPARK_LOCAL_HOSTNAME="$addr" \
    SPARK_WORKER_DIR="$STATE/work/$host" SPARK_LOCAL_DIRS="$STATE/work/$host/local" \
    SPARK_LOG_DIR="$STATE/logs" \
    SPARK_DAEMON_MEMORY="$DAEMON_MEMORY" PYSPARK_PYTHON="$PYTHON" SPARK_HOME="$SPARK_HOME" \
    setsid "$@" >"$log" 2>&1 </dev/null &
  pid=$!
  printf '%s %s %s %s\n' "$host" "$role" "$pid" "$(start_time "$pid")" >>"$RUN/pids"
}

# -- up -------------------------------------------------------------------------------------

add_host() { # name role address
  local host="$1" role="$2" addr="$3" link
  link="${PREFIX}v-${host#"$PREFIX"}"
  if ip netns list | awk '{print $1}' | grep -qx "$host"; then
    die "a network namespace '$host' already exists and this cluster did not record it: another cluster (another checkout?) uses prefix '$PREFIX'; stop it there, or choose another prefix with TANDEM_CLUSTER_PREFIX"
  fi
  record netns "$host"
  ip netns add "$host"
  ip -n "$host" link set lo up
  record link "$link"
  ip link add "$link" type veth peer name eth0 netns "$host"
  ip link set "$link" master "$BRIDGE"
  ip link set "$link" up
  ip -n "$host" addr add "$addr/24" dev eth0
  ip -n "$host" link set eth0 up
  printf '%s %s %s %s\n' "$host" "$role" "$addr" "$link" >>"$RUN/hosts"
}

master_url() { printf 'spark://%s:%s' "$NET.1" "$MASTER_PORT"; }

wait_for() { # what log pid probe-function...: until the probe passes, the pid dies or time is up
  local what="$1" log="$2" pid="$3" deadline=$((SECONDS + START_TIMEOUT))
  shift 3
  until "$@"; do
    if ! alive "$pid"; then
      tail -n 30 "$log" >&2 || true
      die "$what exited during start-up (last lines of $log above)"
    fi
    if ((SECONDS >= deadline)); then
      tail -n 30 "$log" >&2 || true
      die "$what was not ready after ${START_TIMEOUT}s (log: $log); raise TANDEM_CLUSTER_START_TIMEOUT on a busy machine"
    fi
    sleep 0.2
  done
}

# The daemons of a host's role: the master (head), a Worker (worker), ZooKeeper and Kafka
# (services). start_daemons launches them, wait_daemons waits until they are ready.
start_daemons() { # host
  local host="$1" role addr
  role="$(host_field "$host" 2)"
  addr="$(host_field "$host" 3)"
  case "$role" in
  head)
    launch "$host" master "$STATE/logs/$host-master.log" "$SPARK_HOME/bin/spark-class" \
      org.apache.spark.deploy.master.Master --host "$addr" --port "$MASTER_PORT" --webui-port 8080
    ;;
  worker)
    mkdir -p "$STATE/work/$host"
    launch "$host" worker "$STATE/logs/$host-worker.log" "$SPARK_HOME/bin/spark-class" \
      org.apache.spark.deploy.worker.Worker --host "$addr" --webui-port 8081 \
      --cores "$WORKER_CORES" --memory "$WORKER_MEMORY" --work-dir "$STATE/work/$host" \
      "$(master_url)"
    ;;
  services) start_services ;;
  esac
}

wait_daemons() { # host
  local host="$1" role pid
  role="$(host_field "$host" 2)"
  case "$role" in
  head)
    pid="$(awk -v h="$host" '$1 == h && $2 == "master" { print $3 }' "$RUN/pids")"
    wait_for "the Spark master on $host" "$STATE/logs/$host-master.log" "$pid" master_ready "$host"
    ;;
  worker)
    pid="$(awk -v h="$host" '$1 == h && $2 == "worker" { print $3 }' "$RUN/pids")"
    wait_for "the Spark Worker on $host" "$STATE/logs/$host-worker.log" "$pid" worker_ready "$host"
    ;;
  services) wait_services ;;
  esac
}

master_ready() { grep -q "I have been elected leader" "$STATE/logs/$1-master.log" 2>/dev/null; }
worker_ready() { grep -q "Successfully registered with master" "$STATE/logs/$1-worker.log" 2>/dev/null; }

up() { # N [--services]
  local n="$1" services="$2" k host pid
  if ! [[ "$n" =~ ^[0-9]+$ ]] || ((10#$n < 1 || 10#$n > 200)); then
    die "up N: N is the number of worker hosts, 1..200 (got '$n')"
  fi
  n=$((10#$n))
  need_root
  check_prefix
  check_java
  SPARK_HOME="$(spark_home)"
  if [[ -s "$RUN/objects" || -s "$RUN/pids" ]]; then
    say "a previous cluster is recorded in $RUN: taking it down first"
    down
  fi
  if ip link show "$BRIDGE" >/dev/null 2>&1; then
    die "a link '$BRIDGE' already exists and this cluster did not record it: another cluster (another checkout?) uses prefix '$PREFIX'; stop it there, or choose another prefix with TANDEM_CLUSTER_PREFIX"
  fi
  rm -rf "$RUN" "$STATE/work" "$STATE/logs" "$STATE/services"
  mkdir -p "$RUN" "$STATE/work" "$STATE/logs"
  : >"$RUN/hosts"
  : >"$RUN/pids"
  # From here on, a failure takes down what was made so far.
  trap 'rc=$?; if ((rc != 0)); then say "start-up failed: taking down what was started (logs stay in $STATE/logs)"; down >&2 || true; fi' EXIT
  local t0=$SECONDS
  record bridge "$BRIDGE"
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  add_host "${PREFIX}head" head "$NET.1"
  for ((k = 1; k <= n; k++)); do add_host "${PREFIX}w$k" worker "$NET.$((10 + k))"; done
  ((services)) && add_host "${PREFIX}svc" services "$NET.2"

  start_daemons "${PREFIX}head"
  if ((services)); then start_daemons "${PREFIX}svc"; fi
  wait_daemons "${PREFIX}head"
  for ((k = 1; k <= n; k++)); do start_daemons "${PREFIX}w$k"; done
  for ((k = 1; k <= n; k++)); do wait_daemons "${PREFIX}w$k"; done
  if ((services)); then wait_daemons "${PREFIX}svc"; fi
  master_url >"$RUN/master"
  trap - EXIT
  say "up in $((SECONDS - t0)) s: master $(master_url) on ${PREFIX}head, $n worker host(s) of $WORKER_CORES cores / $WORKER_MEMORY each"
  if ((services)); then say "ZooKeeper $NET.2:21810 and Kafka $NET.2:19092 on ${PREFIX}svc"; fi
}

# ZooKeeper and Kafka: the project's own scripts/services.sh, run on the services host and
# bound to its address, with its state under the cluster's folder (emptied by `up`, kept
# by `restart`, as a machine's disk survives its crash).
# A crashed Kafka starts again only once its previous broker session (30 s) has expired:
# about a minute in all, so the start-up timeout is the cluster's.
services_env() {
  printf '%s\n' "TANDEM_SERVICES_HOST=$NET.2" "TANDEM_SERVICES_DIR=$STATE/services" \
    "TANDEM_SERVICES_START_TIMEOUT=$START_TIMEOUT"
}

start_services() {
  local -a envs
  mapfile -t envs < <(services_env)
  # The jars come from Maven Central once, cached in ~/.cache/tandem/jars: from here, since the
  # services host has no route out.
  "$ROOT/scripts/services.sh" jars all >"$STATE/logs/${PREFIX}svc-jars.log" 2>&1 ||
    die "resolving the ZooKeeper and Kafka jars failed: $(tail -n 5 "$STATE/logs/${PREFIX}svc-jars.log")"
  ip netns exec "${PREFIX}svc" env "${envs[@]}" "$ROOT/scripts/services.sh" start all \
    >"$STATE/logs/${PREFIX}svc-services.log" 2>&1 </dev/null &
  SERVICES_STARTER=$!
}

wait_services() {
  if ! wait "$SERVICES_STARTER"; then
    cat "$STATE/logs/${PREFIX}svc-services.log" >&2
    die "ZooKeeper/Kafka did not start on ${PREFIX}svc (scripts/services.sh's messages above)"
  fi
  local name pid
  for name in zookeeper kafka; do
    pid="$(tr -dc '0-9' <"$STATE/services/run/$name.pid")"
    printf '%s %s %s %s\n' "${PREFIX}svc" "$name" "$pid" "$(start_time "$pid")" >>"$RUN/pids"
  done
}

# -- down -----------------------------------------------------------------------------------

down() {
  need_root
  local kind name host pid start
  local -a namespaces=() links=() bridges=() pids=()
  if [[ ! -s "$RUN/objects" && ! -s "$RUN/pids" ]]; then
    say "no cluster recorded in $RUN: nothing to take down"
    rm -rf "$RUN"
    return 0
  fi
  if [[ -f "$RUN/objects" ]]; then
    while read -r kind name; do
      case "$kind" in
      netns) namespaces+=("$name") ;;
      link) links+=("$name") ;;
      bridge) bridges+=("$name") ;;
      esac
    done <"$RUN/objects"
  fi
  # The daemons this script started (if still the same processes), and every process in
  # the namespaces it created: nothing else runs there.
  if [[ -f "$RUN/pids" ]]; then
    while read -r host _ pid start; do
      [[ -n "$pid" ]] || continue
      if alive "$pid" && [[ "$(start_time "$pid")" == "$start" ]]; then pids+=("$pid"); fi
    done <"$RUN/pids"
  fi
  for host in "${namespaces[@]}"; do
    while read -r pid; do [[ -n "$pid" ]] && pids+=("$pid"); done < <(netns_pids "$host")
  done
  if ((${#pids[@]})); then
    mapfile -t pids < <(printf '%s\n' "${pids[@]}" | sort -un)
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local deadline=$((SECONDS + STOP_GRACE)) left
    while :; do
      left=()
      for pid in "${pids[@]}"; do alive "$pid" && left+=("$pid"); done
      for host in "${namespaces[@]}"; do
        while read -r pid; do [[ -n "$pid" ]] && alive "$pid" && left+=("$pid"); done < <(netns_pids "$host")
      done
      ((${#left[@]})) || break
      if ((SECONDS >= deadline)); then
        kill -KILL "${left[@]}" 2>/dev/null || true
        ((SECONDS < deadline + 10)) || die "processes ${left[*]} survived SIGKILL for 10 s"
      fi
      sleep 0.1
    done
  fi
  for name in "${links[@]}"; do
    if ip link show "$name" >/dev/null 2>&1; then ip link del "$name" 2>/dev/null || true; fi
  done
  for name in "${namespaces[@]}"; do
    if [[ -e "/run/netns/$name" ]]; then ip netns del "$name" 2>/dev/null || true; fi
  done
  for name in "${bridges[@]}"; do
    if ip link show "$name" >/dev/null 2>&1; then ip link del "$name" 2>/dev/null || true; fi
  done
  rm -rf "$RUN"
  say "down: stopped ${#pids[@]} process(es), removed ${#namespaces[@]} host(s), ${#links[@]} link(s), ${#bridges[@]} bridge(s)"
}

# -- faults ---------------------------------------------------------------------------------

crash() { # host
  need_root
  local host n=0 pid round
  host="$(host_name "$1")"
  # Processes may fork while they are being killed: repeat until the namespace is empty.
  for ((round = 0; round < 50; round++)); do
    local -a pids=()
    while read -r pid; do [[ -n "$pid" ]] && alive "$pid" && pids+=("$pid"); done < <(netns_pids "$host")
    ((${#pids[@]})) || break
    kill -KILL "${pids[@]}" 2>/dev/null || true
    n=$((n + ${#pids[@]}))
    sleep 0.05
  done
  say "crash $host: SIGKILLed $n process(es)"
}

restart() { # host: boots again after a crash (what still runs there is SIGKILLed first)
  need_root
  local host t0=$SECONDS
  host="$(host_name "$1")"
  SPARK_HOME="$(spark_home)"
  crash "$host" >/dev/null
  awk -v h="$host" '$1 != h' "$RUN/pids" >"$RUN/pids.new"
  mv -f "$RUN/pids.new" "$RUN/pids"
  start_daemons "$host"
  wait_daemons "$host"
  say "restart $host: its daemons run again ($((SECONDS - t0)) s)"
}

partition() { # host
  need_root
  local host
  host="$(host_name "$1")"
  ip link set "$(host_field "$host" 4)" down
  say "partition $host: its link is down (packets to and from it vanish)"
}

# tbf on the root-side link shapes what the host receives, on the namespace's eth0 what
# it sends. The burst is 10 ms of the rate (at least 3 full-size frames), the queue holds
# at most 100 ms more; beyond that packets are dropped, as on a saturated link.
rate_bytes() { # RATE -> bytes per second
  local n unit
  [[ "$1" =~ ^([0-9]+)(bit|kbit|mbit|gbit|bps|kbps|mbps)$ ]] ||
    die "slow: rate '$1' is not tc's syntax: a whole number and bit, kbit, mbit, gbit, bps, kbps or mbps (e.g. 2mbit)"
  n="${BASH_REMATCH[1]}"
  unit="${BASH_REMATCH[2]}"
  case "$unit" in
  bit) printf '%s' $((n / 8)) ;;
  kbit) printf '%s' $((n * 1000 / 8)) ;;
  mbit) printf '%s' $((n * 1000000 / 8)) ;;
  gbit) printf '%s' $((n * 1000000000 / 8)) ;;
  bps) printf '%s' "$n" ;;
  kbps) printf '%s' $((n * 1000)) ;;
  mbps) printf '%s' $((n * 1000000)) ;;
  esac
}

slow() { # host rate
  need_root
  local host rate="$2" bytes burst
  host="$(host_name "$1")"
  bytes="$(rate_bytes "$rate")"
  ((bytes >= 125)) || die "slow: rate $rate is below 1kbit; tc tbf needs more"
  burst=$((bytes / 100))
  ((burst >= 4542)) || burst=4542
  tc qdisc replace dev "$(host_field "$host" 4)" root tbf rate "$rate" burst "$burst" latency 100ms
  ip netns exec "$host" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 100ms
  say "slow $host: $rate both ways (tc tbf, burst $burst bytes, 100 ms queue)"
}

heal() { # [host]
  need_root
  local host link
  local -a hosts
  if (($#)); then
    hosts=("$(host_name "$1")")
  else
    [[ -f "$RUN/hosts" ]] || die "no cluster is up (no $RUN/hosts): scripts/cluster.sh up N"
    mapfile -t hosts < <(cut -d' ' -f1 "$RUN/hosts")
  fi
  for host in "${hosts[@]}"; do
    link="$(host_field "$host" 4)"
    if tc qdisc show dev "$link" | grep -q '^qdisc tbf'; then tc qdisc del dev "$link" root; fi
    if ip netns exec "$host" tc qdisc show dev eth0 | grep -q '^qdisc tbf'; then
      ip netns exec "$host" tc qdisc del dev eth0 root
    fi
    ip link set "$link" up
  done
  say "healed ${hosts[*]}"
}

# -- status, exec ---------------------------------------------------------------------------

status() {
  if [[ ! -s "$RUN/hosts" ]]; then
    say "no cluster is up (no $RUN/hosts)"
    return 3
  fi
  need_root
  local host role addr link state shaped procs daemons pid start r
  printf '%-10s %-8s %-13s %-5s %-10s %-6s %s\n' HOST ROLE ADDRESS LINK SHAPED PROCS DAEMONS
  while read -r host role addr link; do
    state="$(cat "/sys/class/net/$link/operstate" 2>/dev/null || echo gone)"
    [[ "$state" == up ]] || state=down
    shaped="$(tc qdisc show dev "$link" 2>/dev/null | sed -n 's/^qdisc tbf .* rate \([^ ]*\).*/\1/p')"
    procs="$(netns_pids "$host" | grep -c . || true)"
    daemons=""
    while read -r _ r pid start; do
      if alive "$pid" && [[ "$(start_time "$pid")" == "$start" ]]; then
        daemons+="$r=$pid "
      else
        daemons+="$r=dead "
      fi
    done < <(awk -v h="$host" '$1 == h' "$RUN/pids")
    printf '%-10s %-8s %-13s %-5s %-10s %-6s %s\n' "$host" "$role" "$addr" "$state" \
      "${shaped:--}" "$procs" "${daemons:--}"
  done <"$RUN/hosts"
  printf 'master %s\n' "$(cat "$RUN/master" 2>/dev/null || echo '(not started)')"
}

exec_on() { # host cmd...
  need_root
  local host addr
  host="$(host_name "$1")"
  shift
  (($#)) || die "exec HOST CMD...: give a command to run on $host"
  addr="$(host_field "$host" 3)"
  mkdir -p "$STATE/work/$host/local"
  exec ip netns exec "$host" env SPARK_LOCAL_IP="$addr" SPARK_LOCAL_HOSTNAME="$addr" \
    SPARK_LOCAL_DIRS="$STATE/work/$host/local" TANDEM_CLUSTER_HOST="$host" TANDEM_CLUSTER_ADDRESS="$addr" \
    TANDEM_CLUSTER_MASTER="$(cat "$RUN/master" 2>/dev/null || true)" "$@"
}

main() {
  (($# >= 1)) || usage
  local command="$1"
  shift
  case "$command" in
  up)
    local n="" services=0
    while (($#)); do
      case "$1" in
      --services) services=1 ;;
      *)
        [[ -z "$n" ]] || usage
        n="$1"
        ;;
      esac
      shift
    done
    [[ -n "$n" ]] || usage
    up "$n" "$services"
    ;;
  down | status)
    (($# == 0)) || usage
    "$command"
    ;;
  crash | partition | restart)
    (($# == 1)) || usage
    "$command" "$1"
    ;;
  slow)
    (($# == 2)) || usage
    slow "$1" "$2"
    ;;
  heal)
    (($# <= 1)) || usage
    heal "$@"
    ;;
  exec)
    (($# >= 1)) || usage
    exec_on "$@"
    ;;
  master)
    [[ -s "$RUN/master" ]] || die "no cluster is up (no $RUN/master): scripts/cluster.sh up N"
    cat "$RUN/master"
    ;;
  -h | --help | help) usage ;;
  *) usage ;;
  esac
}

main "$@"

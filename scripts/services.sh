#!/usr/bin/env bash
# Real ZooKeeper and Kafka (KRaft, single node) for tandem's KaZoo ordering, without Docker.
#
#   scripts/services.sh start   [zookeeper|kafka|all] [--fresh]
#   scripts/services.sh stop    [zookeeper|kafka|all]
#   scripts/services.sh status  [zookeeper|kafka|all]
#   scripts/services.sh restart [zookeeper|kafka|all]
#   scripts/services.sh jars    [zookeeper|kafka|all]   (resolve/cache jars only; print folders)
#
# Both servers bind 127.0.0.1 only ($TANDEM_SERVICES_HOST: another address of this host, e.g. a
# cluster host's, see scripts/cluster.sh) and keep everything under one project-local folder:
#   .services/lib/<server>-<version>/  jars from Maven Central (scripts/services/pom.xml), kept
#   $TANDEM_SERVICES_DIR (default .services/): data/, conf/, logs/, run/<server>.pid
# `start` is idempotent: a server this script already runs is left alone; `--fresh` wipes the
# data of a server it is about to start (tests want an empty ZooKeeper and a new Kafka
# cluster), `restart` never does (a restart must look like a crash-and-recover to clients).
# `stop` only signals the PIDs its own PID files name, and only after checking that the
# process is still the server it started (PIDs get reused): SIGTERM, then SIGKILL after
# $TANDEM_SERVICES_STOP_GRACE seconds.
#
# Environment (defaults in brackets): TANDEM_SERVICES_HOST [127.0.0.1], TANDEM_ZK_PORT [21810],
# TANDEM_KAFKA_PORT [19092], TANDEM_KAFKA_CONTROLLER_PORT [Kafka's port + 1],
# TANDEM_SERVICES_DIR [.services], TANDEM_SERVICES_START_TIMEOUT [60 s],
# TANDEM_SERVICES_STOP_GRACE [15 s], TANDEM_JAVA [$JAVA_HOME/bin/java, else java on PATH].
#
# Exit codes: 0 ok; 1 a server failed (the message says which and why); 2 usage;
# 3 `status`: a requested server is not running.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
POM="$ROOT/scripts/services/pom.xml"
STATE="${TANDEM_SERVICES_DIR:-$ROOT/.services}"
LIB_ROOT="$ROOT/.services/lib"
ZK_PORT="${TANDEM_ZK_PORT:-21810}"
KAFKA_PORT="${TANDEM_KAFKA_PORT:-19092}"
CONTROLLER_PORT="${TANDEM_KAFKA_CONTROLLER_PORT:-}"
START_TIMEOUT="${TANDEM_SERVICES_START_TIMEOUT:-60}"
STOP_GRACE="${TANDEM_SERVICES_STOP_GRACE:-15}"
HOST="${TANDEM_SERVICES_HOST:-127.0.0.1}"

say() { printf 'services: %s\n' "$*"; }
die() {
  printf 'services: error: %s\n' "$*" >&2
  exit 1
}

# The versions live in the pom only; read them from there so the two can never disagree.
pom_property() {
  local value
  value="$(sed -n "s:.*<$1>\(.*\)</$1>.*:\1:p" "$POM" | head -n 1)"
  [[ -n "$value" ]] || die "no <$1> in $POM: the pom pins every server version"
  printf '%s' "$value"
}

check_port_number() { # name value
  if ! [[ "$2" =~ ^[0-9]{1,5}$ ]] || ((10#$2 < 1 || 10#$2 > 65535)); then
    die "$1=$2 is not a TCP port: use a number in 1..65535"
  fi
}

lib_dir() { # server -> folder holding its jars
  case "$1" in
  zookeeper) printf '%s/zookeeper-%s' "$LIB_ROOT" "$(pom_property zookeeper.version)" ;;
  kafka) printf '%s/kafka-%s' "$LIB_ROOT" "$(pom_property kafka.version)" ;;
  esac
}

address() { # server -> host:port clients use
  case "$1" in
  zookeeper) printf '%s:%s' "$HOST" "$ZK_PORT" ;;
  kafka) printf '%s:%s' "$HOST" "$KAFKA_PORT" ;;
  esac
}

ports() { # server -> every port it binds
  case "$1" in
  zookeeper) printf '%s\n' "$ZK_PORT" ;;
  kafka) printf '%s\n%s\n' "$KAFKA_PORT" "$CONTROLLER_PORT" ;;
  esac
}

pid_file() { printf '%s/run/%s.pid' "$STATE" "$1"; }
log_file() { printf '%s/logs/%s.log' "$STATE" "$1"; }

find_java() {
  local java="${TANDEM_JAVA:-}"
  if [[ -z "$java" ]]; then
    if [[ -n "${JAVA_HOME:-}" && -x "$JAVA_HOME/bin/java" ]]; then
      java="$JAVA_HOME/bin/java"
    else
      java="$(command -v java || true)"
    fi
  fi
  [[ -n "$java" && -x "$java" ]] ||
    die "Java not found${TANDEM_JAVA:+ at TANDEM_JAVA=$TANDEM_JAVA}: ZooKeeper and Kafka need Java 17 (Debian: apt-get install -y openjdk-17-jre-headless), or set JAVA_HOME"
  local major
  major="$("$java" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n 1)"
  [[ -n "$major" ]] || die "$java -version printed no version: is it a working Java?"
  ((major >= 17)) || die "$java is Java $major; Kafka $(pom_property kafka.version) and this script need Java 17 or newer"
  printf '%s' "$java"
}

# The PID in the file, if that process is alive and is the server this script started there
# (its command line carries -Dtandem.service=NAME and -Dtandem.state=STATE).
our_pid() { # server -> pid, or nothing
  local file pid
  file="$(pid_file "$1")"
  [[ -f "$file" ]] || return 0
  pid="$(tr -dc '0-9' <"$file")"
  [[ -n "$pid" && -r "/proc/$pid/cmdline" ]] || return 0
  if tr '\0' '\n' <"/proc/$pid/cmdline" | grep -qx -- "-Dtandem.service=$1" &&
    tr '\0' '\n' <"/proc/$pid/cmdline" | grep -qx -- "-Dtandem.state=$STATE"; then
    printf '%s' "$pid"
  fi
}

# Who listens on a port, as "java pid=123" (empty when nobody does or ss cannot tell).
port_owner() {
  local line
  if command -v ss >/dev/null 2>&1; then
    line="$(ss -Hltnp "sport = :$1" 2>/dev/null | head -n 1)"
    if [[ -n "$line" ]]; then
      local who
      who="$(grep -o 'users:(("[^"]*",pid=[0-9]*' <<<"$line" | head -n 1 | sed 's/users:(("\([^"]*\)",pid=\([0-9]*\)/\1 pid=\2/')"
      printf '%s' "${who:-an unknown process}"
      return 0
    fi
    return 0
  fi
  if (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; then printf 'an unknown process'; fi
}

check_ports_free() { # server
  local port owner env
  while read -r port; do
    owner="$(port_owner "$port")"
    if [[ -n "$owner" ]]; then
      case "$port" in
      "$ZK_PORT") env=TANDEM_ZK_PORT ;;
      "$KAFKA_PORT") env=TANDEM_KAFKA_PORT ;;
      *) env=TANDEM_KAFKA_CONTROLLER_PORT ;;
      esac
      die "cannot start $1: port $port is already taken by $owner; stop that process, or pick another port with $env=PORT"
    fi
  done < <(ports "$1")
}

# Jars: resolved once with Maven, then read from the folder. The .complete marker is written
# last, so an interrupted download is redone instead of leaving a half classpath.
ensure_jars() { # server
  local dir
  dir="$(lib_dir "$1")"
  [[ -f "$dir/.complete" ]] && return 0
  command -v mvn >/dev/null 2>&1 ||
    die "the $1 jars are not cached in $dir and Maven is missing: apt-get install -y maven (needs Maven Central once; later starts are offline)"
  say "resolving $1 jars from Maven Central into $dir (once)"
  rm -rf "$dir"
  mkdir -p "$dir"
  if ! mvn -q -B -f "$POM" -P"$1" dependency:copy-dependencies -Dlib.dir="$dir" \
    >"$dir.mvn.log" 2>&1; then
    tail -n 30 "$dir.mvn.log" >&2
    die "Maven could not resolve the $1 jars (log: $dir.mvn.log)"
  fi
  rm -f "$dir.mvn.log"
  touch "$dir/.complete"
}

write_log4j() { # server -> path of a log4j 1 config sending INFO to stdout
  local file="$STATE/conf/$1-log4j.properties"
  cat >"$file" <<EOF
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.org.apache.kafka.clients=WARN
log4j.logger.org.apache.kafka.common.utils.AppInfoParser=WARN
log4j.logger.kafka.log.LogManager=WARN
log4j.logger.org.apache.zookeeper.server.ZooKeeperServer=WARN
EOF
  printf '%s' "$file"
}

write_zookeeper_conf() {
  local file="$STATE/conf/zookeeper.properties"
  # tickTime=100 / minSessionTimeout=500: kazoo sessions of 0.5-1 s, so a dead leader is
  # noticed in about one session timeout. The server expires sessions on tick boundaries:
  # with 250 ms ticks a 0.5 s session died 0.47-0.72 s after its worker (three demo runs),
  # with 100 ms ticks within 0.6 s.
  # The admin server is off: it would bind 0.0.0.0:8080. srvr/ruok are whitelisted for the
  # readiness probe. forceSync=no: this single-node server is for tests and demos, and an
  # fsync of its log stalled behind other disk writers for 6-10 s (measured on a busy 2-core
  # machine) blocks every session until they all expire; the data dies with the run anyway.
  cat >"$file" <<EOF
tickTime=100
minSessionTimeout=500
maxSessionTimeout=60000
initLimit=10
syncLimit=5
dataDir=$STATE/data/zookeeper
clientPort=$ZK_PORT
clientPortAddress=$HOST
maxClientCnxns=0
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,stat,mntr
forceSync=no
EOF
  printf '%s' "$file"
}

write_kafka_conf() {
  local file="$STATE/conf/kafka.properties"
  # One process is broker and the whole controller quorum. Internal topics get one replica
  # and one partition (fewer partitions to create = faster first consumer group). Topics are
  # created explicitly (auto.create.topics.enable=false), so a typo fails loudly instead of
  # silently creating a topic with default settings. The broker's session with its own
  # controller is 30 s instead of 9 s: on a saturated 2-core machine its heartbeats were
  # late, the controller fenced the only broker, and every partition lost its leader (a
  # single-node cluster has no other broker to move them to, so fencing only does harm).
  cat >"$file" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$STATE/data/kafka
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
broker.session.timeout.ms=30000
EOF
  printf '%s' "$file"
}

classpath() { # server
  local dir
  dir="$(lib_dir "$1")"
  printf '%s/*' "$dir"
}

# KRaft refuses to start on unformatted storage; format once per data folder. The cluster id
# is 16 random bytes in URL-safe base64 without padding, as `kafka-storage random-uuid`
# prints, made here to spare a JVM start. One that begins with "-" (1 in 64) would read as
# an option to the tool: draw again.
format_kafka_storage() { # java conf log4j
  [[ -f "$STATE/data/kafka/meta.properties" ]] && return 0
  local cluster_id="-"
  while [[ "$cluster_id" == -* ]]; do
    cluster_id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
  done
  mkdir -p "$STATE/data/kafka"
  # A one-shot tool: the C1 compiler alone starts it ~40% faster (0.8 s instead of 1.4 s).
  if ! "$1" -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Dlog4j.configuration="file:$3" \
    -cp "$(classpath kafka)" kafka.tools.StorageTool format -t "$cluster_id" -c "$2" \
    >"$STATE/logs/kafka-format.log" 2>&1; then
    cat "$STATE/logs/kafka-format.log" >&2
    die "formatting Kafka storage in $STATE/data/kafka failed (log above)"
  fi
}

launch() { # server: start the JVM in its own session, write the PID file
  local name="$1" java conf log4j main log
  java="$(find_java)"
  check_ports_free "$name"
  ensure_jars "$name"
  mkdir -p "$STATE/conf" "$STATE/logs" "$STATE/run" "$STATE/data/$name"
  log4j="$(write_log4j "$name")"
  log="$(log_file "$name")"
  [[ -f "$log" ]] && mv -f "$log" "$log.prev"
  local -a jvm
  case "$name" in
  zookeeper)
    conf="$(write_zookeeper_conf)"
    main=org.apache.zookeeper.server.quorum.QuorumPeerMain
    jvm=(-Xms32m -Xmx256m -XX:+UseSerialGC -Dzookeeper.admin.enableServer=false
      -Dzookeeper.jmx.log4j.disable=true)
    ;;
  kafka)
    conf="$(write_kafka_conf)"
    format_kafka_storage "$java" "$conf" "$log4j"
    main=kafka.Kafka
    jvm=(-Xms128m -Xmx512m -XX:+UseG1GC -XX:MaxGCPauseMillis=20
      -XX:InitiatingHeapOccupancyPercent=35)
    ;;
  esac
  # setsid: the server outlives this script and ignores the terminal's Ctrl-C; it is
  # stopped by `stop`, which finds it through the PID file.
  setsid "$java" "${jvm[@]}" -Djava.awt.headless=true -Djava.net.preferIPv4Stack=true -Dlog4j.configuration="file:$log4j" \
    "-Dtandem.service=$name" "-Dtandem.state=$STATE" \
    -cp "$(classpath "$name")" "$main" "$conf" >"$log" 2>&1 </dev/null &
  echo "$!" >"$(pid_file "$name")"
}

zookeeper_ready() {
  local reply
  reply="$(timeout 2 bash -c "exec 3<>/dev/tcp/$HOST/$ZK_PORT && printf srvr >&3 && cat <&3" 2>/dev/null || true)"
  [[ "$reply" == *"Mode: standalone"* ]]
}

kafka_ready() {
  grep -q "Kafka Server started" "$(log_file kafka)" 2>/dev/null &&
    (exec 3<>"/dev/tcp/$HOST/$KAFKA_PORT") 2>/dev/null
}

ready() { "${1}_ready"; }

wait_ready() { # server
  local name="$1" deadline=$((SECONDS + START_TIMEOUT)) pid
  # Liveness by PID alone here: the process was just forked by this script, and between
  # fork and exec its command line is still bash's, which our_pid would not recognise.
  pid="$(tr -dc '0-9' <"$(pid_file "$name")" 2>/dev/null || true)"
  while ! ready "$name"; do
    if [[ -z "$pid" ]] || ! alive "$pid"; then
      tail -n 40 "$(log_file "$name")" >&2 || true
      rm -f "$(pid_file "$name")"
      die "$name exited during start-up (last log lines above; full log: $(log_file "$name"))"
    fi
    if ((SECONDS >= deadline)); then
      tail -n 40 "$(log_file "$name")" >&2 || true
      die "$name (pid $pid) was not ready at $(address "$name") after ${START_TIMEOUT}s (log: $(log_file "$name")); it is left running for inspection: scripts/services.sh stop $name"
    fi
    sleep 0.1
  done
}

now_ms() { date +%s%3N; }

start() { # servers... ; starts what is not running, in parallel, then waits for each
  local name pid t0
  local -a launched=()
  t0="$(now_ms)"
  for name in "$@"; do
    pid="$(our_pid "$name")"
    if [[ -n "$pid" ]]; then
      say "$name already running (pid $pid) at $(address "$name")"
      continue
    fi
    rm -f "$(pid_file "$name")"
    if ((FRESH)); then rm -rf "${STATE:?}/data/$name"; fi
    launch "$name"
    launched+=("$name")
  done
  for name in "${launched[@]}"; do
    wait_ready "$name"
    say "$name ready at $(address "$name") (pid $(our_pid "$name"), $(($(now_ms) - t0)) ms)"
  done
  for name in "$@"; do wait_ready "$name"; done
}

# Alive and not a zombie: a killed server whose parent has not reaped it yet is gone as far
# as its ports and files are concerned.
alive() { # pid
  kill -0 "$1" 2>/dev/null || return 1
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  [[ "${stat:0:1}" != Z ]]
}

stop_one() { # server
  local name="$1" file pid
  file="$(pid_file "$name")"
  if [[ ! -f "$file" ]]; then
    say "$name not running (no $file)"
    return 0
  fi
  pid="$(our_pid "$name")"
  if [[ -z "$pid" ]]; then
    say "$name not running (stale $file for pid $(tr -dc '0-9' <"$file"), which is not ours: left alone)"
    rm -f "$file"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + STOP_GRACE))
  while alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
  if alive "$pid"; then
    say "$name (pid $pid) still running ${STOP_GRACE}s after SIGTERM: sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while alive "$pid"; do
      ((SECONDS < deadline)) || die "$name (pid $pid) survived SIGKILL for 10 s"
      sleep 0.05
    done
  fi
  rm -f "$file"
  say "$name stopped (pid $pid)"
}

stop() { # servers... ; in reverse order of start
  local i
  for ((i = $#; i >= 1; i--)); do stop_one "${!i}"; done
}

status() { # servers... ; one line each: NAME up|starting|down ADDRESS [pid=PID]
  local name pid rc=0 state
  for name in "$@"; do
    pid="$(our_pid "$name")"
    if [[ -n "$pid" ]] && ready "$name"; then
      state=up
    elif [[ -n "$pid" ]]; then
      state=starting
      rc=3
    else
      state=down
      rc=3
    fi
    printf '%s %s %s%s\n' "$name" "$state" "$(address "$name")" "${pid:+ pid=$pid}"
  done
  return "$rc"
}

usage() {
  sed -n '3,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

main() {
  (($# >= 1)) || usage
  local command="$1" target=all
  shift
  FRESH=0
  while (($#)); do
    case "$1" in
    zookeeper | kafka | all) target="$1" ;;
    --fresh) FRESH=1 ;;
    *) usage ;;
    esac
    shift
  done
  [[ "$HOST" =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]] ||
    die "TANDEM_SERVICES_HOST=$HOST is not an IPv4 address: give the address the servers bind (default 127.0.0.1)"
  check_port_number TANDEM_ZK_PORT "$ZK_PORT"
  check_port_number TANDEM_KAFKA_PORT "$KAFKA_PORT"
  # The controller listens next to the broker unless told otherwise, so moving Kafka with
  # TANDEM_KAFKA_PORT alone moves both of its ports.
  [[ -n "$CONTROLLER_PORT" ]] || CONTROLLER_PORT=$((10#$KAFKA_PORT + 1))
  check_port_number TANDEM_KAFKA_CONTROLLER_PORT "$CONTROLLER_PORT"
  local -a servers
  if [[ "$target" == all ]]; then servers=(zookeeper kafka); else servers=("$target"); fi
  case "$command" in
  start) start "${servers[@]}" ;;
  stop) stop "${servers[@]}" ;;
  status) status "${servers[@]}" ;;
  jars)
    local name
    for name in "${servers[@]}"; do
      ensure_jars "$name"
      printf '%s %s\n' "$name" "$(lib_dir "$name")"
    done
    ;;
  restart)
    FRESH=0
    stop "${servers[@]}"
    start "${servers[@]}"
    ;;
  *) usage ;;
  esac
}

main "$@"

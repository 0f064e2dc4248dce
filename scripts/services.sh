#!/usr/bin/env bash
# Real ZooKeeper and Kafka (KRaft, single node) for tandem's KaZoo ordering, without Docker:
# the checkout's face of `tandem services`, which ships in the wheel. Same commands, same
# environment, same exit codes; it runs the packaged tool from this checkout's sources
# (python/tandem/_services/control.py, standard library only), so it needs neither the
# build nor an installed tandem, only a Python 3.10+.
#
#   scripts/services.sh start   [zookeeper|kafka|all] [--fresh]
#   scripts/services.sh stop    [zookeeper|kafka|all]
#   scripts/services.sh status  [zookeeper|kafka|all]
#   scripts/services.sh restart [zookeeper|kafka|all]
#   scripts/services.sh jars    [zookeeper|kafka|all]   (download/cache the jars only; print folders)
#
# `scripts/services.sh --help` lists the settings (TANDEM_ZK_PORT, TANDEM_KAFKA_PORT,
# TANDEM_SERVICES_DIR, ...) with their defaults. Python: $TANDEM_PYTHON, else the
# checkout's .venv, else python3 on PATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${TANDEM_PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
TANDEM_SERVICES_PROG=scripts/services.sh exec "$PYTHON" "$ROOT/python/tandem/_services/control.py" "$@"

#!/usr/bin/env bash
# Set up, then run every test: unit, property, contract (SGLang's own classes), integration
# (real nats-server and redis-server on free loopback ports) and process tests.
# With no arguments: the tests that open no port (pure logic, properties, decoders) on both
# cores, then those that do (marked integration, docker, soak or chaos) one at a time, alone on
# the machine: they start servers on free ports and time real processes. With arguments: one
# pytest run with them, one test at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== lint"
.venv/bin/ruff check schemas libs services tests bench
PYTEST=(.venv/bin/pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then
  echo "== tests"
  exec "${PYTEST[@]}" "$@"
fi
SERIAL="integration or docker or soak or chaos"
echo "== tests that open no port, on 2 processes"
status=0
"${PYTEST[@]}" -n 2 -m "not ($SERIAL)" tests || status=$?
echo "== tests that open ports or start processes, one at a time"
"${PYTEST[@]}" -m "$SERIAL" tests || status=$?
exit $status

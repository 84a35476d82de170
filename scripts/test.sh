#!/usr/bin/env bash
# Set up, then run every test: unit, property, contract (SGLang's own classes), integration
# (real nats-server and redis-server on free loopback ports) and process tests.
# With no arguments: the tests that open no port (pure logic, properties, decoders) on both
# cores, then those that do (marked integration, docker, soak or chaos) on two runners as well,
# apart from the CPU-bound ones: they mostly wait on servers and processes (alone on the machine
# they kept 0.7 of its 2 cores busy), and each runner takes its ports from its own range
# (tests/conftest.py). With arguments: one pytest run with them, one test at a time.
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
echo "== tests that open ports or start processes, on 2 runners"
"${PYTEST[@]}" -n 2 -m "$SERIAL" tests || status=$?
exit $status

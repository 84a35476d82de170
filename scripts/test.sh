#!/usr/bin/env bash
# Set up, then run every test: unit, property, contract (SGLang's own classes), integration
# (real nats-server and redis-server on free loopback ports) and process tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== lint"
.venv/bin/ruff check schemas libs services tests bench
echo "== tests"
exec .venv/bin/pytest -q -p no:cacheprovider "$@"

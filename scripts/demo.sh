#!/usr/bin/env bash
# Quick start: set up, then start NATS + Redis + every service + simulated workers, run a short
# conversational workload through the stack, print its summary, and stop everything.
set -euo pipefail
cd "$(dirname "$0")/.."
THUNDERAGENT_SKIP_CONTRACT=1 bash scripts/setup.sh
exec .venv/bin/thunderagent demo --workers "${WORKERS:-4}" --requests "${REQUESTS:-200}" "$@"

#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine (or refresh an existing checkout): system packages,
# a virtual environment in .venv, and the project with its test and benchmark extras.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v g++ >/dev/null || need_apt+=(g++)
[ -f /usr/include/openssl/sha.h ] || need_apt+=(libssl-dev)
python3 -c "import venv, ensurepip" 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing system packages: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
PIP=".venv/bin/pip"
$PIP install -q --upgrade pip >/dev/null
echo "== installing thunderagent (editable) with dev and bench extras"
$PIP install -q --no-warn-conflicts -e ".[dev,bench]"
if [ "${THUNDERAGENT_SKIP_NIXL:-0}" != "1" ]; then
  # NIXL for KV moves between simulated engines (migration): runs without a GPU (UCX, host
  # memory); --no-deps keeps torch and CUDA out, numpy is all its Python side needs here
  echo "== installing nixl==1.5.1 (--no-deps) for KV migration"
  $PIP install -q --no-deps --no-warn-conflicts "nixl==1.5.1" "nixl-cu12==1.5.1" numpy
fi
if [ "${THUNDERAGENT_SKIP_CONTRACT:-0}" != "1" ]; then
  # SGLang's own classes for the wire-format contract tests: no dependencies (no torch), just
  # the few its kv_events module imports. SGLang's router for the side-by-side benchmark.
  echo "== installing sglang==0.5.23 (--no-deps) and sglang-router==0.3.2 for contract tests"
  $PIP install -q pydantic psutil pybind11 "sglang-router==0.3.2"
  # SMG (the current SGLang gateway) for the live benchmark's second baseline
  $PIP install -q "smg==1.13.0"
  # --no-deps leaves SGLang's (torch, ...) requirements unmet on purpose: don't list them
  $PIP install -q --no-deps --no-warn-conflicts "sglang==0.5.23"
  # Dynamo (CPU only): its RadixTree for the index agreement test and `bench index`, its offline
  # replay for `bench dynamo-sim`, its router's selection core for `bench live --baseline
  # dynamo`: a 75 MB wheel (~220 MB installed, seconds from pip's cache); it pins pydantic
  # <= 2.13.5.
  echo "== installing ai-dynamo-runtime==1.6.1 (Dynamo's index, router and offline replay)"
  $PIP install -q --no-warn-conflicts "ai-dynamo-runtime==1.6.1"
fi
.venv/bin/thunderagent --help >/dev/null  # the CLI imports and parses
echo "== ready: .venv/bin/thunderagent (thunderagent --help lists its commands)"

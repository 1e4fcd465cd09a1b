#!/usr/bin/env bash
# Runs the whole test suite against real services: starts PostgreSQL and
# SeaweedFS (scripts/services.sh), runs the tests, and stops what it started,
# whatever the outcome. Extra arguments go to cargo nextest (or cargo test).
set -euo pipefail
cd "$(dirname "$0")/.."
trap 'scripts/services.sh down' EXIT
eval "$(scripts/services.sh up)"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --no-fail-fast "$@"
else
  cargo test --no-fail-fast "$@"
fi

#!/usr/bin/env bash
# Runs the whole test suite against real services: starts PostgreSQL and
# SeaweedFS (scripts/services.sh), runs the tests, and stops what it started,
# whatever the outcome. Without arguments it then runs the PostgreSQL version
# matrix (scripts/test-matrix.sh: the version-specific tests against 12, 13,
# 14, 16, 17 and 18; the suite itself runs against the system's 15);
# WT_TEST_PG_MAJORS="" leaves the matrix out, WT_TEST_PG_MAJORS="12 18" picks
# majors. Extra arguments go to cargo nextest (or cargo test), and leave the
# matrix out.
set -euo pipefail
cd "$(dirname "$0")/.."
trap 'scripts/services.sh down' EXIT
eval "$(scripts/services.sh up)"
status=0
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --no-fail-fast "$@" || status=$?
else
  cargo test --no-fail-fast "$@" || status=$?
fi
majors=${WT_TEST_PG_MAJORS-12 13 14 16 17 18}
if [ $# -eq 0 ] && [ -n "$majors" ]; then
  PG_MAJORS=$majors scripts/test-matrix.sh || status=$?
fi
exit $status

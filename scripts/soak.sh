#!/usr/bin/env bash
# The soak (not in CI): tests/soak.rs for WT_SOAK_SECS seconds (default 1800)
# against a PostgreSQL of its own and SeaweedFS behind a fault proxy. A
# writer commits about 100 small transactions a second and now and then one
# of 20,000 rows; waltail is killed with -9 every 10-40 s, the store freezes
# for 5-25 s every 1-3 minutes (parked batches are replayed once it is back),
# Postgres restarts every 3-5 minutes. At the end the archive must hold every
# seq once, no change twice, and replay to the tables; the last line printed
# gives the figures. Starts the services it needs and stops them after.
# Usage: scripts/soak.sh
#        WT_SOAK_SECS=300 WT_TEST_SEED=42 scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
trap 'scripts/services.sh down' EXIT
eval "$(scripts/services.sh up)"
export WT_SOAK_SECS=${WT_SOAK_SECS:-1800}
cargo nextest run --profile long --test soak --run-ignored only --no-capture

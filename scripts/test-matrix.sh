#!/usr/bin/env bash
# The PostgreSQL version matrix: for each major in PG_MAJORS, installs its
# server (pg-install.sh, cached), starts it, runs the tests that exercise
# what differs between majors against it, and stops it. The whole suite runs
# against Debian's 15 (scripts/test.sh); this adds the other majors.
#   - check on a healthy setup (every line ok)
#   - the streaming contract test (replay equals the tables)
#   - kill -9 at random moments
#   - the fidelity suite (every type's JSON form, TOAST, replica identities,
#     truncate, partitions, DDL, large transactions: streamed while in
#     progress from 14, decoded through the server's disk on 12 and 13)
#   - backfill while writes go on, and resumed after kill -9 (watermarks as
#     logical messages from 14, as rows of a watermark table on 12 and 13)
# Uses the other services (SeaweedFS, the readers) from the environment that
# scripts/services.sh prints, and starts them itself when that is not set.
# Usage: scripts/test-matrix.sh                 (majors 12 13 14 16 17 18)
#        PG_MAJORS="12 18" scripts/test-matrix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
majors=${PG_MAJORS:-12 13 14 16 17 18}
base=${TMPDIR:-/tmp}
failed= started= own_services=
cleanup() {
  # The running server of the matrix, by its data folder; then the
  # services, if this script started them.
  if [ -n "$started" ]; then PG_BIN=$started PG_ROOT=$base/waltail-pg-matrix scripts/pg-stop.sh || true; fi
  started=
  if [ -n "$own_services" ]; then scripts/services.sh down; fi
}
trap cleanup EXIT
if [ -z "${WT_TEST_S3_ENDPOINT:-}" ]; then
  own_services=1
  eval "$(scripts/services.sh up)"
fi
every='binary(check) & test(check_passes_and_writes_the_marker)
  | binary(stream) & test(s3_archive_follows_the_contract_and_replays_to_the_tables)
  | binary(delivery) & test(kill_9_at_random_moments_loses_nothing_and_never_writes_a_seq_twice)
  | binary(fidelity)'
backfill='binary(backfill) & (test(backfill_while_writes_go_on) | test(backfill_resumes_after_kill9))'
run_tests() {
  if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --no-fail-fast -E "$1"
  else
    echo "the version matrix needs cargo-nextest (cargo install cargo-nextest)" >&2
    return 1
  fi
}
for major in $majors; do
  bin=$(scripts/pg-install.sh "$major")
  # A port below the kernel's ephemeral range (32768-60999): one inside it
  # can be held by an outgoing connection of the services (seen: 55470
  # taken by one after the main suite, so the server could not listen).
  url=$(PG_BIN=$bin PG_ROOT=$base/waltail-pg-matrix PG_PORT=25470 scripts/pg-start.sh)
  started=$bin
  filter="$every | $backfill"
  echo "=== PostgreSQL $major ($("$bin/postgres" --version)) ===" >&2
  # PG_BIN: tests that start a server of their own start this major too.
  WT_TEST_PG=$url PG_BIN=$bin run_tests "$filter" || failed="$failed $major"
  PG_BIN=$bin PG_ROOT=$base/waltail-pg-matrix scripts/pg-stop.sh
  started=
done
if [ -n "$failed" ]; then
  echo "the version matrix failed on PostgreSQL$failed" >&2
  exit 1
fi
echo "the version matrix passed on PostgreSQL $majors" >&2

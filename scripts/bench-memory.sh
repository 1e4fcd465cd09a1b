#!/usr/bin/env bash
# Peak memory (VmHWM) of `waltail run` in the situations that could make it
# grow without bound, each on a fresh process:
#   1. archiving one transaction of ROWS rows (default 1,000,000), with the
#      server's logical_decoding_work_mem = WORK_MEM (default 64MB, the
#      Postgres default: the transaction is streamed to waltail while in
#      progress and buffered/spilled there; 1GB keeps it on the server);
#   1b. one transaction of TOAST_MB values of 1 MB each (default 50);
#   2. the store hung (SeaweedFS SIGSTOPped) for DOWN seconds (default 180)
#      under a steady write load of RATE rows/s (default 500), then resumed.
# Uses its own Postgres (port 55470) and SeaweedFS (ports 18500-18509), so it
# can run beside the tests; stops both by pid at the end.
# Usage: scripts/bench-memory.sh            (release build; takes ~10 min)
#        ROWS=200000 DOWN=30 scripts/bench-memory.sh    (DOWN=0 skips part 2)
#        BENCH_BIN=path/to/waltail scripts/bench-memory.sh  (that binary, no build)
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-1000000}
WORK_MEM=${WORK_MEM:-64MB}
TOAST_MB=${TOAST_MB:-50}
DOWN=${DOWN:-180}
RATE=${RATE:-500}
base=${TMPDIR:-/tmp}
export PG_ROOT=$base/waltail-bench-pg PG_PORT=55470
export S3_ROOT=$base/waltail-bench-s3 S3_PORT_BASE=18500
work=$(mktemp -d)
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  [ -f "$S3_ROOT/weed.pid" ] && kill -CONT "$(cat "$S3_ROOT/weed.pid")" 2>/dev/null || true
  scripts/s3-stop.sh >/dev/null 2>&1 || true
  scripts/pg-stop.sh >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

if [ -n "${BENCH_BIN:-}" ]; then bin=$BENCH_BIN; else
  cargo build --release --quiet
  bin=${CARGO_TARGET_DIR:-target}/release/waltail
fi
url=$(scripts/pg-start.sh)
scripts/s3-start.sh >/dev/null
psql() { "$PG_BIN/psql" -X -q -t -A -v ON_ERROR_STOP=1 "$url" "$@"; }
psql -c "ALTER SYSTEM SET logical_decoding_work_mem = '$WORK_MEM'" -c "SELECT pg_reload_conf()" >/dev/null
psql -c "CREATE TABLE bench (id bigint PRIMARY KEY, payload text, n int, at timestamptz DEFAULT now())"
psql -c "CREATE TABLE wide (id int PRIMARY KEY, doc text)"

export WALTAIL_SOURCE_URL=$url WALTAIL_SOURCE_TABLES=public.bench,public.wide
export WALTAIL_DESTINATION_TYPE=s3 WALTAIL_DESTINATION_BUCKET=waltail-test
export WALTAIL_DESTINATION_ENDPOINT=http://127.0.0.1:$S3_PORT_BASE WALTAIL_DESTINATION_USE_PATH_STYLE=true
export WALTAIL_DESTINATION_ACCESS_KEY_ID=waltail-test-key WALTAIL_DESTINATION_SECRET_ACCESS_KEY=waltail-test-secret
export WALTAIL_STATE_DIR=$work/state

# Waits until the slot has confirmed everything written so far.
caught_up() {
  local target; target=$(psql -c "SELECT pg_current_wal_lsn()")
  until [ "$(psql -c "SELECT confirmed_flush_lsn >= '$target' FROM pg_replication_slots WHERE slot_name = 'waltail_$1'")" = t ]; do
    sleep 0.2
  done
}
hwm() { awk '/VmHWM/ {printf "%.1f MB", $2/1024}' "/proc/$1/status"; }

echo "== 1. one transaction of $ROWS rows (logical_decoding_work_mem $WORK_MEM)"
WALTAIL_PIPELINE=bigtx WALTAIL_DESTINATION_PREFIX=bigtx "$bin" run 2>"$work/bigtx.log" &
pid=$!; pids+=("$pid")
until grep -q streaming "$work/bigtx.log"; do sleep 0.1; done
start=$(date +%s.%N)
psql -c "INSERT INTO bench SELECT g, md5(g::text) || md5((g+1)::text), g FROM generate_series(1, $ROWS) g"
committed=$(date +%s.%N)
caught_up bigtx
done_at=$(date +%s.%N)
echo "   insert took $(echo "$committed - $start" | bc) s; archived $(echo "$done_at - $committed" | bc) s after commit"
echo "   => $(echo "$ROWS / ($done_at - $start)" | bc) changes/s from BEGIN; peak RSS $(hwm "$pid")"
kill -INT "$pid"; wait "$pid"

echo "== 1b. one transaction of $TOAST_MB TOASTed values of 1 MB"
WALTAIL_PIPELINE=toast WALTAIL_DESTINATION_PREFIX=toast "$bin" run 2>"$work/toast.log" &
pid=$!; pids+=("$pid")
until grep -q streaming "$work/toast.log"; do sleep 0.1; done
# md5 chains do not compress: every value is stored out of line, 1 MB each.
psql -c "INSERT INTO wide SELECT g, (SELECT string_agg(md5((g * 100000 + i)::text), '') FROM generate_series(1, 32768) i) FROM generate_series(1, $TOAST_MB) g"
caught_up toast
echo "   archived; peak RSS $(hwm "$pid")"
kill -INT "$pid"; wait "$pid"

[ "$DOWN" -gt 0 ] || exit 0
echo "== 2. store hung for $DOWN s under $RATE rows/s"
WALTAIL_PIPELINE=down WALTAIL_DESTINATION_PREFIX=down "$bin" run 2>"$work/down.log" &
pid=$!; pids+=("$pid")
until grep -q streaming "$work/down.log"; do sleep 0.1; done
weed=$(cat "$S3_ROOT/weed.pid")
kill -STOP "$weed"
end=$(( $(date +%s) + DOWN )); next_id=$((ROWS + 1)); written=0
while [ "$(date +%s)" -lt "$end" ]; do
  psql -c "INSERT INTO bench SELECT g, 'steady', g FROM generate_series($next_id, $((next_id + RATE / 10 - 1))) g"
  next_id=$((next_id + RATE / 10)); written=$((written + RATE / 10))
  sleep 0.1
done
echo "   wrote $written rows while the store hung; peak RSS so far $(hwm "$pid")"
kill -CONT "$weed"
resumed=$(date +%s.%N)
caught_up down
echo "   caught up $(echo "$(date +%s.%N) - $resumed" | bc) s after the store resumed (the next retry is up to a backoff away)"
echo "   peak RSS $(hwm "$pid"); parked: $(WALTAIL_PIPELINE=down "$bin" parked list | tail -1)"
kill -INT "$pid"; wait "$pid"

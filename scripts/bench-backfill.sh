#!/usr/bin/env bash
# Backfill throughput against the raw ceiling, on one machine, in one run:
#   1. ceiling: `COPY (SELECT * FROM bench) TO STDOUT` into /dev/null (psql),
#      Postgres reading and sending every row as text;
#   2. `waltail backfill --yes` of the same table into SeaweedFS (no pipeline
#      running, so it runs one itself: read in chunks between watermarks,
#      store the chunk, render JSON, batch, PUT, confirm), twice: at the
#      default backfill.batch_size (1000 read events per object) and at
#      BATCH (5000);
# prints rows/s for each, the ratio to COPY and waltail's peak RSS.
# Uses its own Postgres (port 55490) and SeaweedFS (ports 18700-18709), so it
# can run beside the tests (not beside another benchmark); stops both by pid.
# Usage: scripts/bench-backfill.sh                      (release build; ROWS=1000000)
#        ROWS=100000 scripts/bench-backfill.sh          (quick check)
#        BENCH_BIN=path/to/waltail scripts/bench-backfill.sh  (that binary, no build)
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-1000000}
BATCH=${BATCH:-5000}
CHUNK=${CHUNK:-5000}
base=${TMPDIR:-/tmp}
export PG_ROOT=$base/waltail-bench-backfill-pg PG_PORT=55490
export S3_ROOT=$base/waltail-bench-backfill-s3 S3_PORT_BASE=18700
work=$(mktemp -d)
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
wt= sampler=
cleanup() {
  for p in $wt $sampler; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
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
psql -c "CREATE TABLE bench (id bigint PRIMARY KEY, payload text, n int, at timestamptz DEFAULT now())" \
     -c "INSERT INTO bench (id, payload, n) SELECT g, md5(g::text) || md5((g * 7)::text) || md5((g * 13)::text), g % 1000 FROM generate_series(1, $ROWS) g" \
     -c "VACUUM ANALYZE bench"
size=$(psql -c "SELECT pg_size_pretty(pg_total_relation_size('bench'))")

export WALTAIL_SOURCE_URL=$url WALTAIL_SOURCE_TABLES=public.bench
export WALTAIL_DESTINATION_TYPE=s3 WALTAIL_DESTINATION_BUCKET=waltail-test
export WALTAIL_DESTINATION_ENDPOINT=http://127.0.0.1:$S3_PORT_BASE WALTAIL_DESTINATION_USE_PATH_STYLE=true
export WALTAIL_DESTINATION_ACCESS_KEY_ID=waltail-test-key WALTAIL_DESTINATION_SECRET_ACCESS_KEY=waltail-test-secret
export WALTAIL_STATE_DIR=$work/state

now() { date +%s.%N; }
rate() { awk -v n="$1" -v t="$2" 'BEGIN { printf "%.0f", n / t }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }

# The ceiling, warm: one COPY first so both read from the buffer cache.
psql -c "COPY (SELECT * FROM bench) TO STDOUT" >/dev/null
t0=$(now)
psql -c "COPY (SELECT * FROM bench) TO STDOUT" >/dev/null
copy_secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }')
copy_rate=$(rate "$ROWS" "$copy_secs")

# Runs `waltail backfill --yes` as pipeline $1 with batch size $2; prints
# "<seconds> <peak RSS MB>".
backfill() {
  local log=$work/$1.log peak=$work/$1.peak
  t0=$(now)
  WALTAIL_PIPELINE=$1 WALTAIL_BACKFILL_BATCH_SIZE=$2 \
    "$bin" backfill --yes --chunk-size "$CHUNK" >"$log" 2>&1 &
  wt=$!
  # VmHWM is gone once the process exits: sample it while it runs.
  ( m=0; while [ -r "/proc/$wt/status" ]; do
      v=$(awk '/VmHWM/ {print $2}' "/proc/$wt/status" 2>/dev/null || true)
      [ -n "$v" ] && [ "$v" -gt "$m" ] && m=$v && echo "$m" >"$peak"
      sleep 0.1
    done ) &
  sampler=$!
  if ! wait "$wt"; then echo "waltail backfill failed:" >&2; cat "$log" >&2; exit 1; fi
  local secs; secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }')
  wt=; wait "$sampler" 2>/dev/null || true; sampler=
  grep -q "public.bench: done" "$log" || { cat "$log" >&2; exit 1; }
  echo "$secs $(awk '{printf "%.1f", $1/1024}' "$peak")"
}
read -r d_secs d_rss < <(backfill bench-default 1000)
read -r b_secs b_rss < <(backfill bench-batch "$BATCH")
d_rate=$(rate "$ROWS" "$d_secs"); b_rate=$(rate "$ROWS" "$b_secs")

printf '\nbackfill of %s rows (%s on disk), chunks of %s rows, SeaweedFS on the same machine\n' "$ROWS" "$size" "$CHUNK"
printf '%-44s %12s %8s %10s\n' "" "rows/s" "ratio" "peak RSS"
printf '%-44s %12s %8s %10s\n' "COPY (SELECT * FROM bench) TO STDOUT" "$copy_rate" "1.00" "-"
printf '%-44s %12s %8s %10s\n' "waltail backfill, 1000 rows/object (default)" "$d_rate" "$(ratio "$d_rate" "$copy_rate")" "$d_rss MB"
printf '%-44s %12s %8s %10s\n' "waltail backfill, $BATCH rows/object" "$b_rate" "$(ratio "$b_rate" "$copy_rate")" "$b_rss MB"

#!/usr/bin/env bash
# Backfill throughput against the raw ceiling, on one machine, in one run:
#   1. ceiling: `COPY (SELECT * FROM bench) TO STDOUT` into /dev/null (psql),
#      Postgres reading and sending every row as text;
#   2. `waltail backfill --yes` of the same table (no pipeline running, so it
#      runs one itself), into each destination of DESTS (a local folder, and
#      SeaweedFS on the same cores), at each backfill.parallelism of
#      PARALLELISM, at backfill.batch_size BATCH read events per object;
# prints rows/s for each, the ratio to COPY, waltail's peak RSS, the CPU per
# object of waltail, of the store (into SeaweedFS) and of Postgres, and the
# bound those CPU times put on rows/s with every core of the machine busy
# (cores / CPU per row of the three together) with the ratio to it.
# With LAT_RATE set (tx/s), a last pass backfills into the folder while
# `waltail run` streams one-row transactions into another table at that rate
# (pgbench), and prints the commit-to-object latency of those changes.
# Uses its own Postgres (port 55490) and SeaweedFS (ports 18700-18709), so it
# can run beside the tests (not beside another benchmark); stops both by pid.
# Usage: scripts/bench-backfill.sh                      (release build; ROWS=1000000)
#        ROWS=100000 scripts/bench-backfill.sh          (quick check)
#        ROWS=10000000 DESTS=folder PARALLELISM=2 scripts/bench-backfill.sh  (memory)
#        LAT_RATE=500 scripts/bench-backfill.sh         (streaming latency during a backfill)
#        BENCH_BIN=path/to/waltail scripts/bench-backfill.sh  (that binary, no build)
#        KEEP=/tmp/bf WALTAIL_LOG=info,waltail::source::backfill=debug scripts/bench-backfill.sh
#                                                       (keeps the logs, with each chunk's read and store times)
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-1000000}
BATCH=${BATCH:-1000}
CHUNK=${CHUNK:-20000}
DESTS=${DESTS-folder s3}
PARALLELISM=${PARALLELISM:-1 2}
LAT_RATE=${LAT_RATE:-}
base=${TMPDIR:-/tmp}
export PG_ROOT=$base/waltail-bench-backfill-pg PG_PORT=55490
export S3_ROOT=$base/waltail-bench-backfill-s3 S3_PORT_BASE=18700
work=$(mktemp -d)
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
wt= sampler= bg=
cleanup() {
  for p in $wt $sampler $bg; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  scripts/s3-stop.sh >/dev/null 2>&1 || true
  scripts/pg-stop.sh >/dev/null 2>&1 || true
  [ -n "${KEEP:-}" ] && cp -r "$work" "$KEEP"; rm -rf "$work"
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
     -c "VACUUM ANALYZE bench" -c "CHECKPOINT"
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

cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / hz }' "/proc/$1/stat"; }
weed_pid=$(cat "$S3_ROOT/weed.pid")
pm_pid=$(head -1 "$PG_ROOT/data/postmaster.pid")
# Postgres's CPU seconds so far: the postmaster's, its ended children's
# (reaped into its own) and its running children's (their backends).
pg_cpu_s() {
  local pids; pids="$pm_pid $(ps -o pid= --ppid "$pm_pid" | tr '\n' ' ')"
  for p in $pids; do cat "/proc/$p/stat" 2>/dev/null || true; done \
    | awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); t += $12 + $13 + $14 + $15 } END { printf "%.2f", t / hz }'
}
# Runs waltail (exec: call it in a subshell) with destination $1 (folder or
# s3) as pipeline $2; the rest are its arguments.
waltail_to() {
  local dest=$1 name=$2; shift 2
  if [ "$dest" = folder ]; then
    exec ${WRAP:-} env -u WALTAIL_DESTINATION_BUCKET -u WALTAIL_DESTINATION_ENDPOINT -u WALTAIL_DESTINATION_USE_PATH_STYLE \
      -u WALTAIL_DESTINATION_ACCESS_KEY_ID -u WALTAIL_DESTINATION_SECRET_ACCESS_KEY \
      WALTAIL_DESTINATION_TYPE=file WALTAIL_DESTINATION_PATH="$work/archive-$name" \
      WALTAIL_PIPELINE=$name WALTAIL_STATE_DIR=$work/state-$name "$bin" "$@"
  else
    WALTAIL_DESTINATION_PREFIX=$name WALTAIL_PIPELINE=$name WALTAIL_STATE_DIR=$work/state-$name exec "$bin" "$@"
  fi
}
# Samples VmHWM of pid $1 into file $2 while it runs (gone once it exits).
sample_peak() {
  ( m=0; while [ -r "/proc/$1/status" ]; do
      v=$(awk '/VmHWM/ {print $2}' "/proc/$1/status" 2>/dev/null || true)
      [ -n "$v" ] && [ "$v" -gt "$m" ] && m=$v && echo "$m" >"$2"
      sleep 0.1
    done ) &
  sampler=$!
}
# Objects of `read` events: the rows fill objects of BATCH events (a linger
# may cut a few short, so this is a floor and the CPU per object a ceiling).
objects=$(( (ROWS + BATCH - 1) / BATCH ))
# backfill DEST PARALLELISM: one `waltail backfill --yes` run; prints
# "<seconds> <peak RSS MB> <waltail CPU s> <store CPU s> <Postgres CPU s>".
backfill() {
  local dest=$1 par=$2 name=bf-$1-$2-$RANDOM
  local log=$work/$name.log peak=$work/$name.peak
  psql -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE NOT active" >/dev/null
  local weed0; weed0=$(cpu_s "$weed_pid")
  local pg0; pg0=$(pg_cpu_s)
  t0=$(now)
  # PARALLELISM=- leaves backfill.parallelism unset (a release without it).
  ( [ "$par" = - ] || export WALTAIL_BACKFILL_PARALLELISM="$par"
    WALTAIL_BACKFILL_BATCH_SIZE=$BATCH waltail_to "$dest" "$name" backfill --yes --chunk-size "$CHUNK" ) >"$log" 2>&1 &
  wt=$!
  sample_peak "$wt" "$peak"
  local cpu=0
  while kill -0 "$wt" 2>/dev/null; do
    c=$(cpu_s "$wt" 2>/dev/null || true); [ -n "$c" ] && cpu=$c
    sleep 0.2
  done
  if ! wait "$wt"; then echo "waltail backfill failed:" >&2; cat "$log" >&2; exit 1; fi
  local secs; secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }')
  wt=; wait "$sampler" 2>/dev/null || true; sampler=
  grep -q "public.bench: done" "$log" || { cat "$log" >&2; exit 1; }
  local weed; weed=$(awk -v a="$weed0" -v b="$(cpu_s "$weed_pid")" 'BEGIN { print b - a }')
  [ "$dest" = s3 ] || weed=0
  local pg; pg=$(awk -v a="$pg0" -v b="$(pg_cpu_s)" 'BEGIN { print b - a }')
  echo "$secs $(awk '{printf "%.1f", $1/1024}' "$peak") $cpu $weed $pg"
}

printf '\nbackfill of %s rows (%s on disk), chunks of %s rows, %s read events per object\n' "$ROWS" "$size" "$CHUNK" "$BATCH"
cores=$(nproc)
printf '%-46s %10s %7s %10s  %-30s %s\n' "" "rows/s" "ratio" "peak RSS" "CPU ms/object: waltail/store/pg" "bound on $cores cores (ratio)"
printf '%-46s %10s %7s %10s\n' "COPY (SELECT * FROM bench) TO STDOUT" "$copy_rate" "1.00" "-"
for dest in $DESTS; do
  for par in $PARALLELISM; do
    read -r secs rss cpu weed pg < <(backfill "$dest" "$par")
    r=$(rate "$ROWS" "$secs")
    per=$(awk -v w="$cpu" -v s="$weed" -v p="$pg" -v n="$objects" \
      'BEGIN { printf "%.2f / %s / %.2f", w * 1000 / n, (s > 0 ? sprintf("%.2f", s * 1000 / n) : "-"), p * 1000 / n }')
    bound=$(awk -v c="$cores" -v w="$cpu" -v s="$weed" -v p="$pg" -v n="$ROWS" 'BEGIN { printf "%.0f", c * n / (w + s + p) }')
    printf '%-46s %10s %7s %10s  %-30s %s (%s)\n' "waltail backfill -> $dest, parallelism $par" "$r" "$(ratio "$r" "$copy_rate")" \
      "$rss MB" "$per" "$bound" "$(ratio "$r" "$bound")"
  done
done

if [ -n "$LAT_RATE" ]; then
  # Streaming latency while a backfill runs: `waltail run` streams bench and
  # lat into the folder; pgbench inserts into lat at LAT_RATE tx/s, each row
  # carrying clock_timestamp(); `waltail backfill --yes` asks the running
  # pipeline to backfill bench and follows it. An object arrives at its
  # file's mtime (the folder store writes a staging file and renames it).
  psql -c "CREATE TABLE lat (id bigserial PRIMARY KEY, at timestamptz NOT NULL)"
  echo "INSERT INTO lat (at) VALUES (clock_timestamp());" >"$work/lat.sql"
  name=lat-$RANDOM
  export WALTAIL_SOURCE_TABLES=public.bench,public.lat WALTAIL_SOURCE_PUBLICATION=waltail_lat
  ( waltail_to folder "$name" run ) >"$work/$name.log" 2>&1 &
  wt=$!
  until grep -q streaming "$work/$name.log"; do
    kill -0 "$wt" 2>/dev/null || { cat "$work/$name.log" >&2; exit 1; }
    sleep 0.05
  done
  sample_peak "$wt" "$work/$name.peak"
  "$PG_BIN/pgbench" -n -f "$work/lat.sql" -R "$LAT_RATE" -T 3600 -c 8 -j 2 "$url" >"$work/pgbench.out" 2>&1 &
  bg=$!
  sleep 2
  t0=$(now)
  ( waltail_to folder "$name" backfill --yes --chunk-size "$CHUNK" public.bench ) >"$work/$name.backfill.log" 2>&1 \
    || { cat "$work/$name.backfill.log" >&2; exit 1; }
  t1=$(now)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')
  kill "$bg"; wait "$bg" 2>/dev/null || true; bg=
  sleep 2
  kill -INT "$wt"; wait "$wt" || true; wt=
  wait "$sampler" 2>/dev/null || true; sampler=
  # Only the changes committed while the backfill ran.
  rows=$(psql -c "SELECT count(*) FROM lat WHERE at BETWEEN to_timestamp($t0) AND to_timestamp($t1)")
  lat=$(python3 scripts/latency.py "$work/archive-$name" "$rows" public.lat "$t0" "$t1")
  printf '\nstreamed changes at %s tx/s while `waltail backfill` read %s rows in %.1f s (%s rows/s) into the folder:\n  %s; peak RSS %s MB\n' \
    "$LAT_RATE" "$ROWS" "$secs" "$(rate "$ROWS" "$secs")" "$lat" "$(awk '{printf "%.1f", $1/1024}' "$work/$name.peak")"
fi

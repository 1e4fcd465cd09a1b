#!/usr/bin/env bash
# End-to-end throughput and latency of `waltail run` against the raw ceiling,
# on one machine:
#   1. three backlogs, each written while nothing consumes it, then drained
#      twice from its own slots: by pg_recvlogical (pgoutput to /dev/null: the
#      ceiling, Postgres's own decoding and sending) and by `waltail run` into
#      SeaweedFS (decode, JSON, batch, PUT, confirm):
#        a. one transaction of 1,000,000 inserts
#        b. 100,000 transactions of 10 inserts
#        c. 300,000 transactions of one update
#      prints changes/s for both, the ratio and waltail's peak RSS (VmHWM),
#      and the CPU time per object of waltail and of SeaweedFS (both share
#      the machine's cores with the walsender); then drains it a third time
#      by `waltail run` into a local folder (no store on the cores: waltail's
#      own ceiling);
#   2. commit-to-object latency: pgbench drives LAT_RATE one-row transactions/s
#      (default 2000) for LAT_SECONDS (default 30) into a streaming waltail,
#      once writing to a local folder and once to SeaweedFS; each row carries
#      clock_timestamp() at insert; an object arrives at its file's mtime
#      (the folder store writes a staging file and renames it) or, in S3,
#      when its PUT returned (waltail's debug log line for it); prints
#      p50/p99/max.
# With several binaries in BENCH_BIN (an A/B), each backlog and latency pass
# is run by each binary in turn, ROUNDS times (default 1): A B A B ..., so
# both share the machine's moment; print `md5sum` of both first.
# Uses its own Postgres (port 55480) and SeaweedFS (ports 18600-18609), so it
# can run beside the tests (not beside another benchmark); stops both by pid
# at the end.
# Usage: scripts/bench-e2e.sh                      (release build; ~10 min)
#        SCALE=0.1 LAT_SECONDS=10 scripts/bench-e2e.sh   (quick check)
#        BENCH_BIN=path/to/waltail scripts/bench-e2e.sh  (that binary, no build)
#        BENCH_BIN="old/waltail new/waltail" ROUNDS=3 scripts/bench-e2e.sh  (A/B, alternated)
#        BACKLOGS=a LAT_SECONDS=0 WORK_MEM=1GB scripts/bench-e2e.sh  (backlog a only, no
#          latency run, the big transaction kept in the server's memory)
#        WALTAIL_DESTINATION_COMPRESSION=zstd scripts/bench-e2e.sh  (objects compressed;
#          the summary's last column is what the folder's objects take)
#        FOLDER_ON=/mnt/xfs scripts/bench-e2e.sh  (the folder drains and the folder's
#          latency pass write under that folder: its file system sets much of
#          the folder's CPU per object, so say which one a figure is on)
set -euo pipefail
cd "$(dirname "$0")/.."
SCALE=${SCALE:-1}
LAT_RATE=${LAT_RATE:-2000}
LAT_SECONDS=${LAT_SECONDS:-30}
# The server's logical_decoding_work_mem. 64MB is PostgreSQL's default: a
# transaction decoded past it is spilled to the server's disk (pg_recvlogical,
# protocol 1) or streamed to the client while in progress (waltail, protocol
# 2). WORK_MEM=1GB keeps a SCALE=1 transaction in the server's memory.
WORK_MEM=${WORK_MEM:-64MB}
# Which backlogs to run (any of a, b, c; c updates the rows a inserted).
BACKLOGS=${BACKLOGS:-abc}
scaled() { awk -v n="$1" -v s="$SCALE" 'BEGIN { v = int(n * s); print (v < 1 ? 1 : v) }'; }
ROWS_A=$(scaled 1000000)     # a: rows in the one transaction
TX_B=$(scaled 100000)        # b: transactions of 10 rows
UPD_C=$(scaled 300000)       # c: one-row update transactions (rows 1..UPD_C of a)
base=${TMPDIR:-/tmp}
export PG_ROOT=$base/waltail-bench-e2e-pg PG_PORT=55480
export S3_ROOT=$base/waltail-bench-e2e-s3 S3_PORT_BASE=18600
work=$(mktemp -d)
# Where the folder destinations go (a folder of the run's own, removed at the end).
folders=$(mktemp -d "${FOLDER_ON:-$work}/waltail-bench-folders.XXXXXX")
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
wt= bg=   # the running waltail and pg_recvlogical/pgbench, if any
cleanup() {
  for p in $wt $bg; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  scripts/s3-stop.sh >/dev/null 2>&1 || true
  scripts/pg-stop.sh >/dev/null 2>&1 || true
  rm -rf "$folders" "$work"
}
trap cleanup EXIT

# BENCH_BIN may name several binaries (space-separated): each backlog is then
# drained by each of them in turn, ROUNDS times (A B A B ...), so an A/B
# comparison shares the machine's moment; the summary has a row per binary
# and round.
if [ -n "${BENCH_BIN:-}" ]; then read -r -a bins <<<"$BENCH_BIN"; else
  cargo build --release --quiet
  bins=("${CARGO_TARGET_DIR:-target}/release/waltail")
fi
ROUNDS=${ROUNDS:-1}
for b in "${bins[@]}"; do [ -x "$b" ] || { echo "not an executable: $b" >&2; exit 2; }; done
[ "${#bins[@]}" -gt 1 ] && md5sum "${bins[@]}"
bin=${bins[0]}
url=$(scripts/pg-start.sh)
scripts/s3-start.sh >/dev/null
psql() { "$PG_BIN/psql" -X -q -t -A -v ON_ERROR_STOP=1 "$url" "$@"; }
psql -c "ALTER SYSTEM SET logical_decoding_work_mem = '$WORK_MEM'" -c "SELECT pg_reload_conf()" >/dev/null
psql -c "CREATE TABLE bench (id bigint PRIMARY KEY, payload text, n int, at timestamptz DEFAULT now())" \
     -c "CREATE PUBLICATION bench_pub FOR TABLE bench"

export WALTAIL_SOURCE_URL=$url
export WALTAIL_DESTINATION_TYPE=s3 WALTAIL_DESTINATION_BUCKET=waltail-test
export WALTAIL_DESTINATION_ENDPOINT=http://127.0.0.1:$S3_PORT_BASE WALTAIL_DESTINATION_USE_PATH_STYLE=true
export WALTAIL_DESTINATION_ACCESS_KEY_ID=waltail-test-key WALTAIL_DESTINATION_SECRET_ACCESS_KEY=waltail-test-secret

now() { date +%s.%N; }
# Waits (server side, 20 ms steps, one connection) until the slot has
# confirmed everything up to $2.
wait_confirmed() {
  psql -c "DO \$\$ BEGIN
    WHILE coalesce((SELECT confirmed_flush_lsn < '$2' FROM pg_replication_slots WHERE slot_name = '$1'), true) LOOP
      PERFORM pg_sleep(0.02);
    END LOOP; END \$\$"
}
hwm() { awk '/VmHWM/ {printf "%.1f MB", $2/1024}' "/proc/$1/status"; }
# Changes waltail archived so far in a pipeline (its seq counter), once stopped.
archived() {
  python3 -c 'import sqlite3, sys
db = sqlite3.connect("file:" + sys.argv[1] + "?mode=ro", uri=True)
print(db.execute("SELECT next_seq - 1 FROM cursor WHERE id = 1").fetchone()[0])' "$1"
}
rate() { awk -v n="$1" -v t="$2" 'BEGIN { printf "%.0f", n / t }'; }
# Starts `waltail run` for pipeline $1 in the background (pid in $wt, log
# $work/$1.log, appended) and waits for it to stream.
streamed() { cat "$1" 2>/dev/null | grep -c streaming || true; }
# With FOLDER set, the destination is a local folder instead of SeaweedFS.
start_waltail() {
  local log=$work/$1.log
  local before; before=$(streamed "$log")
  if [ -n "${FOLDER:-}" ]; then
    env -u WALTAIL_DESTINATION_BUCKET -u WALTAIL_DESTINATION_ENDPOINT -u WALTAIL_DESTINATION_USE_PATH_STYLE \
      -u WALTAIL_DESTINATION_ACCESS_KEY_ID -u WALTAIL_DESTINATION_SECRET_ACCESS_KEY -u WALTAIL_DESTINATION_PREFIX \
      WALTAIL_DESTINATION_TYPE=file WALTAIL_DESTINATION_PATH="$FOLDER" \
      WALTAIL_PIPELINE=$1 WALTAIL_STATE_DIR=$work/state-$1 "$bin" --log-format "${LOG_FORMAT:-text}" run 2>>"$log" &
  else
    WALTAIL_PIPELINE=$1 WALTAIL_STATE_DIR=$work/state-$1 "$bin" --log-format "${LOG_FORMAT:-text}" run 2>>"$log" &
  fi
  wt=$!
  until [ "$(streamed "$log")" -gt "$before" ]; do
    kill -0 "$wt" 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.05
  done
}
stop_waltail() { kill -INT "$wt"; wait "$wt"; wt=; }
# CPU seconds (user + system) a process has used so far.
cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / hz }' "/proc/$1/stat"; }
weed_pid=$(cat "$S3_ROOT/weed.pid")
# CPU seconds Postgres's exited backends have used so far (the walsender of a
# drain is counted once its connection has closed): the server's side of a drain.
pm_pid=$(head -1 "$PG_ROOT/data/postmaster.pid")
server_cpu() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($16 + $17) / hz }' "/proc/$pm_pid/stat"; }
since() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
BATCH=${WALTAIL_DELIVERY_BATCH_SIZE:-100}

table=()
# drain_waltail SLOT PIPELINE END: drains the backlog through `waltail run`
# (into SeaweedFS, or a folder with FOLDER set) until the slot has confirmed
# END; sets secs, peak, wt_cpu and weed_cpu.
drain_waltail() {
  local t0 weed0 pg0; t0=$(now); weed0=$(cpu_s "$weed_pid"); pg0=$(server_cpu)
  WALTAIL_SOURCE_SLOT=$1 start_waltail "$2"
  wait_confirmed "$1" "$3"
  secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { print b - a }')
  peak=$(hwm "$wt"); wt_cpu=$(cpu_s "$wt")
  weed_cpu=$(awk -v a="$weed0" -v b="$(cpu_s "$weed_pid")" 'BEGIN { print b - a }')
  stop_waltail
  psql -c "SELECT pg_drop_replication_slot('$1')" >/dev/null
  pg_cpu=$(since "$pg0" "$(server_cpu)")
}
# backlog NAME LABEL CHANGES SQL...: the SQL (run in one session with
# synchronous_commit off) writes the backlog; every round drains it once by
# pg_recvlogical and once by each binary into SeaweedFS and into a folder.
backlog() {
  local name=$1 label=$2 changes=$3; shift 3
  echo "== $label ($changes changes)"
  export WALTAIL_SOURCE_TABLES=public.bench WALTAIL_SOURCE_PUBLICATION=bench_pub WALTAIL_DESTINATION_PREFIX=$name
  local r i
  for r in $(seq "$ROUNDS"); do
    psql -c "SELECT pg_create_logical_replication_slot('ceiling_${name}_$r', 'pgoutput')" >/dev/null
    for i in "${!bins[@]}"; do
      # waltail's slots are created by waltail itself, so that its state knows them.
      bin=${bins[$i]}
      WALTAIL_SOURCE_SLOT=wt_${name}_${i}_$r start_waltail "e2e_${name}_${i}_$r"; stop_waltail
      WALTAIL_SOURCE_SLOT=wtf_${name}_${i}_$r FOLDER=$folders/folder start_waltail "e2f_${name}_${i}_$r"; stop_waltail
    done
  done

  local t0 t1; t0=$(now)
  psql -c "SET synchronous_commit = off" "$@"
  t1=$(now)
  psql -c "CHECKPOINT" >/dev/null
  local end; end=$(psql -c "SELECT pg_current_wal_lsn()")
  echo "   written in $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s; WAL end $end"

  local objects=$(( (changes + BATCH - 1) / BATCH ))
  for r in $(seq "$ROUNDS"); do
    t0=$(now)
    local pg0; pg0=$(server_cpu)
    "$PG_BIN/pg_recvlogical" -d "$url" --slot "ceiling_${name}_$r" --start --plugin=pgoutput \
      -o proto_version=1 -o publication_names=bench_pub -f /dev/null --endpos "$end" &
    bg=$!; wait "$bg"; bg=
    t1=$(now)
    local ceil_t; ceil_t=$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')
    psql -c "SELECT pg_drop_replication_slot('ceiling_${name}_$r')" >/dev/null
    local c; c=$(rate "$changes" "$ceil_t")
    sleep 0.2   # the walsender exits and is counted
    printf '   round %s: pg_recvlogical %.2f s = %s changes/s; server CPU %s s\n' "$r" "$ceil_t" "$c" "$(since "$pg0" "$(server_cpu)")"
    for i in "${!bins[@]}"; do
      bin=${bins[$i]}
      drain_waltail "wt_${name}_${i}_$r" "e2e_${name}_${i}_$r" "$end"
      local wt_t=$secs w_peak=$peak w_pg=$pg_cpu
      local got; got=$(archived "$work/state-e2e_${name}_${i}_$r/e2e_${name}_${i}_$r.sqlite")
      [ "$got" = "$changes" ] || echo "   WARNING: waltail archived $got changes, expected $changes"
      local per_obj; per_obj=$(awk -v w="$wt_cpu" -v s="$weed_cpu" -v n="$objects" \
        'BEGIN { printf "%.2f / %.2f", w * 1000 / n, s * 1000 / n }')
      FOLDER=$folders/folder drain_waltail "wtf_${name}_${i}_$r" "e2f_${name}_${i}_$r" "$end"
      local wf_t=$secs wf_pg=$pg_cpu wf_cpu; wf_cpu=$(awk -v w="$wt_cpu" -v n="$objects" 'BEGIN { printf "%.2f", w * 1000 / n }')
      # What the objects take on disk (their bytes, not the blocks they fill).
      local stored; stored=$(find "$folders/folder" -type f -name '*.ndjson*' -printf '%s\n' |
        awk -v n="$changes" '{ b += $1 } END { printf "%.1f MB (%.0f B/change)", b / 1e6, b / n }')
      # Kept, not removed, until the run ends: an archive only grows, and
      # on ext4 the files of the next drain would be created among the
      # inodes just freed, which it skips one by one (`recently_deleted`).
      mv "$folders/folder" "$folders/drained-${name}_${i}_$r"
      local w f; w=$(rate "$changes" "$wt_t"); f=$(rate "$changes" "$wf_t")
      local who=$label; [ "${#bins[@]}" -gt 1 ] && who="$label [bin $((i + 1))]"
      [ "$ROUNDS" -gt 1 ] && who="$who r$r"
      printf '   %s: waltail %.2f s = %s changes/s (server CPU %s s); CPU per object (%s objects): waltail %s SeaweedFS ms; into a local folder %.2f s = %s changes/s (waltail CPU %s ms/object, server CPU %s s), stored %s; peak RSS %s\n' \
        "$who" "$wt_t" "$w" "$w_pg" "$objects" "$per_obj" "$wf_t" "$f" "$wf_cpu" "$wf_pg" "$stored" "$w_peak"
      table+=("$(printf '%-38s | %24s | %17s | %5s | %16s | %21s | %5s | %16s | %s' "$who" "$c" "$w" \
        "$(awk -v a="$w" -v b="$c" 'BEGIN { printf "%.2f", a / b }')" "$per_obj" "$f" \
        "$(awk -v a="$f" -v b="$c" 'BEGIN { printf "%.2f", a / b }')" "$w_peak" "${stored%% (*}")")
    done
  done
}

[[ $BACKLOGS != *a* ]] || backlog a "a. 1 tx x $ROWS_A inserts" "$ROWS_A" \
  -c "INSERT INTO bench SELECT g, md5(g::text) || md5((g+1)::text), g FROM generate_series(1, $ROWS_A) g"
[[ $BACKLOGS != *b* ]] || backlog b "b. $TX_B tx x 10 inserts" "$((TX_B * 10))" \
  -c "DO \$\$ BEGIN FOR t IN 0..$((TX_B - 1)) LOOP
        INSERT INTO bench SELECT g, md5(g::text) || md5((g+1)::text), g
          FROM generate_series($ROWS_A + 1 + t * 10, $ROWS_A + 10 + t * 10) g;
        COMMIT;
      END LOOP; END \$\$"
# Backlog c updates the rows backlog a inserts; without a, they are put
# there first, before c's slots exist (so they are not part of c).
if [[ $BACKLOGS == *c* && $BACKLOGS != *a* ]]; then
  psql -c "INSERT INTO bench SELECT g, md5(g::text) || md5((g+1)::text), g FROM generate_series(1, $UPD_C) g" >/dev/null
fi
[[ $BACKLOGS != *c* ]] || backlog c "c. $UPD_C tx x 1 update" "$UPD_C" \
  -c "DO \$\$ BEGIN FOR i IN 1..$UPD_C LOOP
        UPDATE bench SET n = n + 1 WHERE id = i;
        COMMIT;
      END LOOP; END \$\$"

lat_rows=()
if [ "$LAT_SECONDS" != 0 ]; then
psql -c "CREATE TABLE lat (id bigserial PRIMARY KEY, at timestamptz NOT NULL)"
echo "INSERT INTO lat (at) VALUES (clock_timestamp());" >"$work/lat.sql"
export WALTAIL_SOURCE_TABLES=public.lat WALTAIL_LOG=info,waltail::pipeline=debug
unset WALTAIL_SOURCE_PUBLICATION
# latency DEST RUN: pgbench drives LAT_RATE one-row transactions/s for
# LAT_SECONDS into a streaming waltail writing to DEST (folder or s3); each
# row carries clock_timestamp() at insert. An object arrives at its file's
# mtime (the folder store writes a staging file and renames it) or, in S3,
# when its PUT returned (waltail's debug line "archived", then the object is
# fetched to read its rows).
latency() {
  local dest=$1 run=$2 from; from=$(psql -c "SELECT coalesce(max(id), 0) FROM lat")
  if [ "$dest" = folder ]; then
    FOLDER=$folders/lat-$run WALTAIL_SOURCE_SLOT=wt_$run start_waltail "$run"
  else
    LOG_FORMAT=json WALTAIL_DESTINATION_PREFIX=$run WALTAIL_SOURCE_SLOT=wt_$run start_waltail "$run"
  fi
  "$PG_BIN/pgbench" -n -f "$work/lat.sql" -R "$LAT_RATE" -T "$LAT_SECONDS" -c 8 -j 2 "$url" >"$work/pgbench.out" 2>&1 &
  bg=$!; wait "$bg"; bg=
  wait_confirmed "wt_$run" "$(psql -c "SELECT pg_current_wal_lsn()")"
  local lat_peak; lat_peak=$(hwm "$wt")
  stop_waltail
  psql -c "SELECT pg_drop_replication_slot('wt_$run')" >/dev/null
  local rows tps; rows=$(psql -c "SELECT count(*) FROM lat WHERE id > $from")
  tps=$(awk '/^tps/ { printf "%.0f", $3 }' "$work/pgbench.out")
  local objects=$folders/lat-$run
  if [ "$dest" = s3 ]; then
    # The log's "archived" lines name each object and when its PUT returned.
    mkdir -p "$objects"
    python3 - "$work/$run.log" "$objects/arrivals" <<'PY'
import datetime, json, sys
with open(sys.argv[2], "w") as out:
    for line in open(sys.argv[1]):
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        if e.get("message") == "archived" and "key" in e:
            t = datetime.datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            out.write(f"{e['key']} {t}\n")
PY
    while read -r key _; do
      curl -sf --aws-sigv4 "aws:amz:us-east-1:s3" --user "$WALTAIL_DESTINATION_ACCESS_KEY_ID:$WALTAIL_DESTINATION_SECRET_ACCESS_KEY" \
        -o "$objects/$(basename "$key")" "$WALTAIL_DESTINATION_ENDPOINT/$WALTAIL_DESTINATION_BUCKET/$key"
    done <"$objects/arrivals"
  fi
  local lat; lat=$(python3 scripts/latency.py "$objects" "$rows")
  lat_rows+=("$(printf '%-22s %-7s at %5s tx/s: %s; peak RSS %s' "$3" "$dest" "$tps" "$lat" "$lat_peak")")
  echo "   ${lat_rows[-1]}"
}
echo "== latency: $LAT_RATE one-row tx/s for $LAT_SECONDS s, commit to object"
for r in $(seq "$ROUNDS"); do
  for i in "${!bins[@]}"; do
    bin=${bins[$i]}
    who=waltail; [ "${#bins[@]}" -gt 1 ] && who="bin $((i + 1))"; [ "$ROUNDS" -gt 1 ] && who="$who r$r"
    latency folder "lat_f_${i}_$r" "$who"
    latency s3 "lat_s_${i}_$r" "$who"
  done
done
fi
echo
echo "== summary (SCALE=$SCALE, $(nproc) cores, $("$PG_BIN/postgres" --version | awk '{print $3}'), logical_decoding_work_mem $WORK_MEM, batch_size ${WALTAIL_DELIVERY_BATCH_SIZE:-100}, max_in_flight ${WALTAIL_DELIVERY_MAX_IN_FLIGHT:-4}, compression ${WALTAIL_DESTINATION_COMPRESSION:-none})"
printf '%-38s | %24s | %17s | %5s | %16s | %21s | %5s | %16s | %s\n' backlog "pg_recvlogical changes/s" "waltail changes/s" ratio \
  "CPU ms/object w/s" "waltail→folder ch/s" ratio "waltail peak RSS" "folder stored"
for row in "${table[@]}"; do echo "$row"; done
if [ "$LAT_SECONDS" != 0 ]; then
  echo "latency, commit to object ($LAT_RATE one-row tx/s targeted for $LAT_SECONDS s; folder: file mtime, S3: PUT returned):"
  for row in "${lat_rows[@]}"; do echo "  $row"; done
fi

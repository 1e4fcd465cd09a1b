#!/usr/bin/env bash
# `waltail compact` against DuckDB's COPY of the same NDJSON to Parquet, in
# one run, on one machine:
#   1. generates an archive of 5,000,000 changes over 1,000,000 keys of one
#      table (inserts, updates, some leaving a column out as unchanged TOAST
#      does, deletes, re-inserts) directly as files, twice: in objects of 100
#      and of 10,000 lines, with its schema record (no Postgres needed);
#   2. for each: `waltail compact` (typed history + latest view, zstd) into
#      the local folder, then DuckDB `COPY (SELECT * FROM read_ndjson_auto(...))
#      TO ... (FORMAT parquet, COMPRESSION zstd)` of the same files;
#   3. prints changes/s, peak RSS (GNU time's maximum resident set size), the
#      ratio, and the Delta commits' share of waltail's time;
#   4. runs `waltail compact` RUNS (1,000) times, one small object each, then
#      times opening the latest view after them: a whole `waltail query` of
#      its row count, and `DeltaTable(...)` of the deltalake package (the
#      median of five each).
# Needs no service and no port (the archive is a local folder), so it can run
# beside the tests; uses DuckDB from PyPI (scripts/duckdb.sh).
# Usage: scripts/bench-compact.sh                     (release build; several minutes)
#        SCALE=0.05 scripts/bench-compact.sh          (quick check)
#        BENCH_BIN=path/to/waltail scripts/bench-compact.sh   (that binary, no build)
#        BENCH_BIN="old/waltail new/waltail new/waltail old/waltail" scripts/bench-compact.sh
#            (each in turn on the same archive, after one untimed run)
#        LINES=100 KEEP=1 SCALE=0.05 scripts/bench-compact.sh   (objects of 100 lines only; archives kept)
set -euo pipefail
cd "$(dirname "$0")/.."
SCALE=${SCALE:-1}
scaled() { awk -v n="$1" -v s="$SCALE" 'BEGIN { v = int(n * s); print (v < 1 ? 1 : v) }'; }
CHANGES=$(scaled 5000000)
KEYS=$(scaled 1000000)
work=$(mktemp -d "${TMPDIR:-/tmp}/waltail-bench-compact.XXXXXX")
# KEEP=1 keeps the work folder (printed) for a closer look.
if [ "${KEEP:-}" = 1 ]; then trap 'echo "kept $work" >&2' EXIT; else trap 'rm -rf "$work"' EXIT; fi
python=$(scripts/duckdb.sh)
if [ -n "${BENCH_BIN:-}" ]; then
  bins=$BENCH_BIN
else
  cargo build --release --quiet
  bins=${CARGO_TARGET_DIR:-target}/release/waltail
fi

# Writes the archive in objects of $1 lines (the same changes for every $1:
# one seed), one at a time so that the disk holds one archive.
generate() {
echo "generating $CHANGES changes over $KEYS keys in objects of $1 lines ..." >&2
"$python" - "$work" "$CHANGES" "$KEYS" "$1" <<'PY'
import json, os, random, sys
work, n, keys, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rnd = random.Random(42)
schema = {"table": "public.bench", "version": 1, "columns": [
    {"name": "id", "type": "bigint", "type_oid": 20, "type_modifier": -1, "key": True},
    {"name": "account", "type": "integer", "type_oid": 23, "type_modifier": -1, "key": False},
    {"name": "amount", "type": "numeric(12,2)", "type_oid": 1700, "type_modifier": ((12 << 16) | 2) + 4, "key": False},
    {"name": "status", "type": "text", "type_oid": 25, "type_modifier": -1, "key": False},
    {"name": "note", "type": "text", "type_oid": 25, "type_modifier": -1, "key": False},
    {"name": "updated_at", "type": "timestamp with time zone", "type_oid": 1184, "type_modifier": -1, "key": False}],
    "replica_identity": "default"}
outs = {}
for lines in (per,):
    root = os.path.join(work, f"archive-{lines}")
    os.makedirs(os.path.join(root, "_schemas", "public.bench"))
    with open(os.path.join(root, "_schemas", "public.bench", "1.json"), "w") as f:
        f.write(json.dumps(schema, separators=(",", ":")) + "\n")
    outs[lines] = root
alive = bytearray(keys + 1)
buffers = {lines: [] for lines in outs}
first = {lines: 1 for lines in outs}
days = 5
def flush(lines, last, day):
    root = outs[lines]
    d = os.path.join(root, "2026", "11", f"{day + 1:02d}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"bench-{first[lines]}-{last}.ndjson"), "w") as f:
        f.write("".join(buffers[lines]))
    buffers[lines] = []
    first[lines] = last + 1
for seq in range(1, n + 1):
    day = (seq - 1) * days // n
    k = seq if seq <= keys else rnd.randint(1, keys)
    ts = f"2026-11-{day + 1:02d}T{(seq // 3600) % 24:02d}:{(seq // 60) % 60:02d}:{seq % 60:02d}.{seq % 1000000:06d}+00:00"
    row = f'"id":{k},"account":{k % 9973},"amount":{rnd.randint(0, 9999999) / 100:.2f},"status":"s{seq % 7}"'
    note = f',"note":"note {k} {seq % 13}"'
    if not alive[k]:
        op, data, old = "insert", "{" + row + note + f',"updated_at":"{ts}"' + "}", "null"
        alive[k] = 1
    elif rnd.random() < 0.12:
        op, data, old = "delete", "null", f'{{"id":{k}}}'
        alive[k] = 0
    else:
        # One update in ten leaves `note` out, as Postgres does for an unchanged TOASTed value.
        op, data, old = "update", "{" + row + ("" if rnd.random() < 0.1 else note) + f',"updated_at":"{ts}"' + "}", "null"
    lsn = f"{seq >> 20:X}/{(seq * 64) & 0xFFFFFFFF:X}"
    line = f'{{"op":"{op}","table":"public.bench","data":{data},"old":{old},"seq":{seq},"idempotency_key":"{seq:08x}-0000-5000-8000-000000000000","commit_lsn":"{lsn}"}}\n'
    for lines in outs:
        buffers[lines].append(line)
        if len(buffers[lines]) == lines or seq == n or (seq * days // n) != day:
            flush(lines, seq, day)
PY
}

# Prints "<seconds> <peak RSS KiB>" for a command.
measure() {
  /usr/bin/time -f "%e %M" -o "$work/time" "$@" >"$work/out" 2>"$work/err" || {
    cat "$work/out" "$work/err" >&2; exit 1; }
  cat "$work/time"
}
printf '%-22s %10s %12s %12s %10s\n' "archive" "engine" "seconds" "changes/s" "peak RSS"
for lines in ${LINES:-100 10000}; do
  generate "$lines"
  root=$work/archive-$lines
  size=$(du -sh "$root" | cut -f1)
  label="$lines lines/object ($size)"
  read -r dk_s dk_kb < <(measure "$python" -c "
import duckdb, sys
duckdb.sql(\"COPY (SELECT * FROM read_ndjson_auto('$root/2026/*/*/*.ndjson')) TO '$work/duck-$lines.parquet' (FORMAT parquet, COMPRESSION zstd)\")
")
  awk -v l="$label" -v n="$CHANGES" -v s="$dk_s" -v k="$dk_kb" 'BEGIN { printf "%-22s %10s %12.2f %12.0f %8.0f MB\n", l, "duckdb", s, n / (s > 0 ? s : 0.01), k / 1024 }'
  # Compacts the archive from scratch with binary $1.
  compact() {
    rm -rf "$root/parquet" "$root/latest" "$root/_waltail"
    WALTAIL_PIPELINE=bench WALTAIL_SOURCE_URL=postgres://bench@127.0.0.1:1/bench \
    WALTAIL_SOURCE_TABLES=public.bench WALTAIL_DESTINATION_TYPE=file \
    WALTAIL_DESTINATION_PATH="$root" WALTAIL_STATE_DIR="$work/state" \
    measure "$1" compact
  }
  # One untimed run first: the first compaction of a fresh archive measured
  # 25-30% slower than any later one, whichever binary made it, which would
  # favour every binary but the first of an A/B.
  compact "${bins%% *}" >/dev/null
  for bin in $bins; do
    read -r wt_s wt_kb < <(compact "$bin")
    grep -q "compacted" "$work/out" || { cat "$work/out" >&2; exit 1; }
    latest=$(find "$root/latest" -name '*.parquet' -not -path '*/_delta_log/*' | wc -l)
    commit_s=$(awk '$1 == "delta" { print $5 }' "$work/out")
    awk -v n="$CHANGES" -v s="$wt_s" -v k="$wt_kb" 'BEGIN { printf "%-22s %10s %12.2f %12.0f %8.0f MB\n", "", "waltail", s, n / (s > 0 ? s : 0.01), k / 1024 }'
    awk -v a="$wt_s" -v b="$dk_s" -v bin="$bin" -v f="$latest" 'BEGIN { printf "%-22s %10s %12s waltail takes %.2fx DuckDB'"'"'s time (%s; %d latest files)\n", "", "ratio", "", (b > 0 ? a / b : 0), bin, f }'
    awk -v c="$commit_s" -v a="$wt_s" 'BEGIN { printf "%-22s %10s %12.2f %.1f%% of waltail'"'"'s time\n", "", "commits", c, (a > 0 ? 100 * c / a : 0) }'
  done
  [ "${KEEP:-}" = 1 ] || rm -rf "$root" "$work/duck-$lines.parquet"
done

# 4. Opening a table after many runs: RUNS runs of one object (10 changes
# over 100 keys) each; a checkpoint every 10 commits keeps the log short.
RUNS=${RUNS:-1000}
root=$work/runs
mkdir -p "$root/_schemas/public.bench" "$work/objects"
"$python" - "$root" "$work/objects" "$RUNS" <<'PY'
import json, os, sys
root, objects, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
schema = {"table": "public.bench", "version": 1, "replica_identity": "default", "columns": [
    {"name": "id", "type": "bigint", "type_oid": 20, "type_modifier": -1, "key": True},
    {"name": "n", "type": "integer", "type_oid": 23, "type_modifier": -1, "key": False}]}
with open(os.path.join(root, "_schemas", "public.bench", "1.json"), "w") as f:
    f.write(json.dumps(schema) + "\n")
seq = 0
for run in range(runs):
    lines = []
    for _ in range(10):
        seq += 1
        op = "insert" if seq <= 100 else "update"
        lines.append(json.dumps({"op": op, "table": "public.bench", "data": {"id": seq % 100, "n": seq},
            "old": None, "seq": seq, "idempotency_key": f"{seq:08x}-0000-5000-8000-000000000000",
            "commit_lsn": f"0/{seq * 64:X}"}) + "\n")
    with open(os.path.join(objects, f"bench-{seq - 9}-{seq}.ndjson"), "w") as f:
        f.write("".join(lines))
PY
bin=${bins##* }
export WALTAIL_PIPELINE=bench WALTAIL_SOURCE_URL=postgres://bench@127.0.0.1:1/bench \
  WALTAIL_SOURCE_TABLES=public.bench WALTAIL_DESTINATION_TYPE=file \
  WALTAIL_DESTINATION_PATH="$root" WALTAIL_STATE_DIR="$work/state-runs"
echo "compacting $RUNS runs of one object each ..." >&2
mkdir -p "$root/2026/11/01"
started=$(date +%s.%N)
for object in $(ls "$work/objects" | sort -t- -k2 -n); do
  mv "$work/objects/$object" "$root/2026/11/01/"
  "$bin" compact >"$work/out" 2>&1 || { cat "$work/out" >&2; exit 1; }
done
runs_s=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')
table=$root/latest/public/bench
commits=$(find "$table/_delta_log" -name '*.json' | wc -l)
checkpoints=$(find "$table/_delta_log" -name '*.checkpoint.parquet' | wc -l)
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
query_ms=$(for _ in 1 2 3 4 5; do
  s=$(date +%s%N); "$bin" query --format csv "SELECT count(*) FROM public.bench" >/dev/null; e=$(date +%s%N)
  echo $(( (e - s) / 1000000 )); done | median)
deltalake_ms=$("$python" - "$table" <<'PY'
import statistics, sys, time
from deltalake import DeltaTable
times = []
for _ in range(5):
    t = time.perf_counter()
    DeltaTable(sys.argv[1]).file_uris()
    times.append((time.perf_counter() - t) * 1000)
print(round(statistics.median(times)))
PY
)
printf '\n%s runs in %.0f s; the latest view has %d commits and %d checkpoints in its log\n' "$RUNS" "$runs_s" "$commits" "$checkpoints"
printf 'opening it: waltail query (whole process, count) %d ms, deltalake DeltaTable() %d ms (median of 5)\n' "$query_ms" "$deltalake_ms"

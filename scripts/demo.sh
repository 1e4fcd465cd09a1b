#!/usr/bin/env bash
# The whole job, for a first look: starts a local PostgreSQL (port 55450) with
# a demo table `public.orders`, then runs `waltail run` streaming it into the
# embedded default destination, the folder ./waltail-archive, until Ctrl-C.
# A few sample transactions are committed once it is streaming; once they are
# archived, `waltail compact` turns the archive into Delta tables and `waltail
# query` prints the table from them. Commit and query your own with the lines
# it prints. Postgres stops when the demo ends; re-running
# keeps the database, the state and the archive, so seq numbering continues.
set -euo pipefail
cd "$(dirname "$0")/.."
PG_ROOT=${PG_ROOT:-${TMPDIR:-/tmp}/waltail-demo-pg}
PG_PORT=${PG_PORT:-55450}
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}
# Keep the demo database only while this folder's state matches it; otherwise
# (first run, or a fresh clone) start from an empty database.
keep=0; [ -f waltail-state/demo.sqlite ] && keep=1
url=$(PG_ROOT=$PG_ROOT PG_PORT=$PG_PORT PG_KEEP=$keep scripts/pg-start.sh)
pid=
# On any exit (Ctrl-C, or a step that failed): waltail stops cleanly, then Postgres.
cleanup() {
  if [ -n "$pid" ]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  PG_ROOT=$PG_ROOT scripts/pg-stop.sh
}
trap cleanup EXIT
psql() { "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 "$url" "$@"; }
psql -c "CREATE TABLE IF NOT EXISTS public.orders (
  id bigserial PRIMARY KEY, customer text NOT NULL, status text NOT NULL,
  total numeric(10,2) NOT NULL, items jsonb, created_at timestamptz NOT NULL DEFAULT now())"

if [ -x "${CARGO_TARGET_DIR:-target}/debug/waltail" ]; then
  echo "building waltail (only what changed)..." >&2
else
  echo "building waltail: the first build compiles about 600 crates (DataFusion, arrow," >&2
  echo "parquet, the Delta kernel) and takes 10-20 minutes on 2 cores; later ones, seconds" >&2
fi
cargo build --quiet
export WALTAIL_PIPELINE=demo
export WALTAIL_SOURCE_URL=$url
export WALTAIL_SOURCE_TABLES=public.orders
bin=${CARGO_TARGET_DIR:-target}/debug/waltail
"$bin" check
"$bin" run &
pid=$!
trap 'kill -INT $pid 2>/dev/null' INT TERM
sleep 2
archived() { find waltail-archive -name '*.ndjson' 2>/dev/null | wc -l; }
before=$(archived)
psql -c "INSERT INTO orders (customer, status, total, items) VALUES
  ('ada', 'paid', 19.99, '[{\"sku\": \"A1\", \"qty\": 1}]'), ('grace', 'paid', 5.00, NULL)"
psql -c "UPDATE orders SET status = 'shipped' WHERE customer = 'ada'"
psql -c "DELETE FROM orders WHERE customer = 'grace'"
# The four changes are archived within a linger (200 ms) of their commit.
for _ in $(seq 50); do
  [ "$(archived)" -gt "$before" ] && break
  sleep 0.2
done
echo >&2
echo "archived: $(find waltail-archive -name '*.ndjson' | sort | tail -1)" >&2
echo "compacting the archive into Delta tables (waltail compact)..." >&2
"$bin" compact
echo >&2
sql="SELECT id, customer, status, total, items FROM public.orders ORDER BY id"
echo "the table as the archive holds it (waltail query \"$sql\"):" >&2
"$bin" query "$sql"
cat >&2 <<MSG

waltail is streaming public.orders into ./waltail-archive (Ctrl-C stops it cleanly).
See the objects:   find waltail-archive -name '*.ndjson' | sort | tail -3 | xargs cat
Commit a change:   $PG_BIN/psql "$url" -c "INSERT INTO orders (customer, status, total) VALUES ('you', 'new', 1.00)"
Query the archive: WALTAIL_SOURCE_URL='$url' WALTAIL_SOURCE_TABLES=public.orders WALTAIL_PIPELINE=demo \\
                     $bin query "SELECT status, count(*) FROM history.public.orders GROUP BY status"
                   (every version is in history.public.orders; without SQL it opens a prompt)
MSG
# wait returns early when a trapped signal arrives; wait again for waltail's clean exit.
wait $pid || wait $pid
pid=

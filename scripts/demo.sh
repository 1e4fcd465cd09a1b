#!/usr/bin/env bash
# The main job, for a first look: starts a local PostgreSQL (port 55450) with a
# demo table `public.orders`, then runs `waltail run` streaming it into the
# embedded default destination, the folder ./waltail-archive, until Ctrl-C.
# A few sample transactions are committed once it is streaming; commit your own
# with the psql line it prints. Postgres stops when the demo ends; re-running
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
trap 'PG_ROOT=$PG_ROOT scripts/pg-stop.sh' EXIT
psql() { "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 "$url" "$@"; }
psql -c "CREATE TABLE IF NOT EXISTS public.orders (
  id bigserial PRIMARY KEY, customer text NOT NULL, status text NOT NULL,
  total numeric(10,2) NOT NULL, items jsonb, created_at timestamptz NOT NULL DEFAULT now())"

echo "building waltail..." >&2
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
psql -c "INSERT INTO orders (customer, status, total, items) VALUES
  ('ada', 'paid', 19.99, '[{\"sku\": \"A1\", \"qty\": 1}]'), ('grace', 'paid', 5.00, NULL)"
psql -c "UPDATE orders SET status = 'shipped' WHERE customer = 'ada'"
psql -c "DELETE FROM orders WHERE customer = 'grace'"
cat >&2 <<MSG

waltail is streaming public.orders into ./waltail-archive (Ctrl-C stops it cleanly).
See the objects:   find waltail-archive -name '*.ndjson' | sort | tail -3 | xargs cat
Commit a change:   $PG_BIN/psql "$url" -c "INSERT INTO orders (customer, status, total) VALUES ('you', 'new', 1.00)"
MSG
# wait returns early when a trapped signal arrives; wait again for waltail's clean exit.
wait $pid || wait $pid

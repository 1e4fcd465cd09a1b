#!/usr/bin/env bash
# Stops the PostgreSQL started by pg-start.sh (same PG_ROOT), by its data folder.
set -euo pipefail
PG_ROOT=${PG_ROOT:-${TMPDIR:-/tmp}/waltail-pg}
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}
if [ "$(id -u)" = 0 ]; then as_pg() { runuser -u postgres -- "$@"; }; else as_pg() { "$@"; }; fi
PG_ROOT=$(cd "$(dirname "$PG_ROOT")" 2>/dev/null && pwd)/$(basename "$PG_ROOT")
cd /
if [ -f "$PG_ROOT/data/postmaster.pid" ]; then
  as_pg "$PG_BIN/pg_ctl" -D "$PG_ROOT/data" -m fast -w stop >/dev/null
fi

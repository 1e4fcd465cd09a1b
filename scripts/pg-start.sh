#!/usr/bin/env bash
# Starts a throwaway PostgreSQL with logical replication on 127.0.0.1 and prints
# its URL. Idempotent: a previous instance in the same PG_ROOT is stopped and
# wiped first. As root (CI), the server runs as the `postgres` OS user, since
# Postgres refuses to run as root.
#   PG_ROOT       data + socket folder       (default ${TMPDIR:-/tmp}/waltail-pg)
#   PG_PORT       TCP port                   (default 55440)
#   PG_WAL_LEVEL  logical | replica          (default logical; replica is for check tests)
#   PG_BIN        server binaries            (default: newest /usr/lib/postgresql/*/bin)
#   PG_KEEP=1     keep an existing instance's data (start it if stopped) instead of starting afresh
set -euo pipefail
PG_ROOT=${PG_ROOT:-${TMPDIR:-/tmp}/waltail-pg}
PG_PORT=${PG_PORT:-55440}
PG_WAL_LEVEL=${PG_WAL_LEVEL:-logical}
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}
if [ -z "$PG_BIN" ] || [ ! -x "$PG_BIN/initdb" ]; then
  echo "PostgreSQL server binaries not found: install them (Debian: apt-get install postgresql) or set PG_BIN" >&2
  exit 1
fi
if [ "$(id -u)" = 0 ]; then as_pg() { runuser -u postgres -- "$@"; }; else as_pg() { "$@"; }; fi
mkdir -p "$(dirname "$PG_ROOT")"; PG_ROOT=$(cd "$(dirname "$PG_ROOT")" && pwd)/$(basename "$PG_ROOT")
cd /   # the postgres user may not be allowed into the caller's folder

if [ "${PG_KEEP:-0}" = 1 ] && [ -f "$PG_ROOT/data/PG_VERSION" ]; then
  if ! as_pg "$PG_BIN/pg_ctl" -D "$PG_ROOT/data" status >/dev/null 2>&1; then
    as_pg "$PG_BIN/pg_ctl" -D "$PG_ROOT/data" -l "$PG_ROOT/server.log" -w start >/dev/null
  fi
  echo "postgres://postgres@127.0.0.1:$PG_PORT/postgres"
  exit 0
fi
if [ -f "$PG_ROOT/data/postmaster.pid" ]; then
  as_pg "$PG_BIN/pg_ctl" -D "$PG_ROOT/data" -m fast -w stop >/dev/null 2>&1 || true
fi
rm -rf "$PG_ROOT"; mkdir -p "$PG_ROOT"
if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$PG_ROOT"; fi
as_pg "$PG_BIN/initdb" -D "$PG_ROOT/data" -U postgres --auth=trust -E UTF8 >"$PG_ROOT/initdb.log"
cat >>"$PG_ROOT/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_ROOT'
wal_level = $PG_WAL_LEVEL
max_replication_slots = 40
max_wal_senders = 40
max_connections = 200
fsync = on
CONF
as_pg "$PG_BIN/pg_ctl" -D "$PG_ROOT/data" -l "$PG_ROOT/server.log" -w start >/dev/null
echo "postgres://postgres@127.0.0.1:$PG_PORT/postgres"

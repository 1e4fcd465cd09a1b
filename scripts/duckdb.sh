#!/usr/bin/env bash
# Installs DuckDB's Python package (PyPI) into a venv under ~/.cache, if it
# is not there yet, and prints the venv's python. The compact tests and
# scripts/bench-compact.sh read the Parquet output with it, as a user would.
# `scripts/duckdb.sh --cli` also installs DuckDB's command-line shell (PyPI
# duckdb-cli) into the same venv and prints the path of its executable
# itself (not the Python wrapper, whose start would be timed too):
# scripts/bench-query.sh times it process against process with `waltail query`.
#   DUCKDB_VENV  the venv (default ~/.cache/waltail-duckdb-venv)
set -euo pipefail
DUCKDB_VENV=${DUCKDB_VENV:-$HOME/.cache/waltail-duckdb-venv}
DUCKDB_VERSION=1.4.2
# The newest shell on PyPI (it starts at 1.4.4; no 1.4.2 build exists).
DUCKDB_CLI_VERSION=1.5.6
if ! "$DUCKDB_VENV/bin/python" -c "import duckdb, sys; sys.exit(duckdb.__version__ != '$DUCKDB_VERSION')" 2>/dev/null; then
  python3 -m venv "$DUCKDB_VENV" >&2
  "$DUCKDB_VENV/bin/pip" install -q --disable-pip-version-check "duckdb==$DUCKDB_VERSION" >&2
fi
if [ "${1:-}" != --cli ]; then
  echo "$DUCKDB_VENV/bin/python"
  exit 0
fi
cli() {
  "$DUCKDB_VENV/bin/python" -c "import duckdb_cli, os; print(os.path.join(os.path.dirname(duckdb_cli.__file__), 'duckdb'))" 2>/dev/null
}
if ! { path=$(cli) && "$path" --version 2>/dev/null | grep -q "^v$DUCKDB_CLI_VERSION "; }; then
  "$DUCKDB_VENV/bin/pip" install -q --disable-pip-version-check "duckdb-cli==$DUCKDB_CLI_VERSION" >&2
  path=$(cli)
fi
echo "$path"

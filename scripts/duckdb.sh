#!/usr/bin/env bash
# Installs DuckDB's Python package (PyPI) into a venv under ~/.cache, if it
# is not there yet, and prints the venv's python. The compact tests and
# scripts/bench-compact.sh read the Parquet output with it, as a user would.
#   DUCKDB_VENV  the venv (default ~/.cache/waltail-duckdb-venv)
set -euo pipefail
DUCKDB_VENV=${DUCKDB_VENV:-$HOME/.cache/waltail-duckdb-venv}
DUCKDB_VERSION=1.4.2
if ! "$DUCKDB_VENV/bin/python" -c "import duckdb, sys; sys.exit(duckdb.__version__ != '$DUCKDB_VERSION')" 2>/dev/null; then
  python3 -m venv "$DUCKDB_VENV" >&2
  "$DUCKDB_VENV/bin/pip" install -q --disable-pip-version-check "duckdb==$DUCKDB_VERSION" >&2
fi
echo "$DUCKDB_VENV/bin/python"

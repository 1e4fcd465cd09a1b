#!/usr/bin/env bash
# Installs the readers we did not write (all from PyPI) into a venv under
# ~/.cache, if they are missing or at another version, and prints the venv's
# python. The compact tests and scripts/bench-compact.sh read the Parquet
# output with DuckDB, and tests/readers/delta.py reads waltail's Delta Lake
# tables with DuckDB's Delta extension and with the deltalake package, as a
# user would:
#   - duckdb             DuckDB's Python package
#   - duckdb-ext-delta   DuckDB's own (signed) delta and httpfs (for s3://)
#     duckdb-ext-httpfs  extension binaries, repackaged as wheels by the
#                        duckdb-ext project, so they load offline with
#                        LOAD '<file>' (the extension repository is not
#                        reachable here); each is built for one DuckDB release
#                        only, hence the exact pins
#   - deltalake          delta-rs's Python package, a second Delta reader
#   - pyarrow            what deltalake hands tables over as
# `scripts/duckdb.sh --cli` also installs DuckDB's command-line shell (PyPI
# duckdb-cli) into the same venv and prints the path of its executable
# itself (not the Python wrapper, whose start would be timed too):
# scripts/bench-query.sh times it process against process with `waltail query`.
# `scripts/duckdb.sh --delta-extension` (or --httpfs-extension) prints the
# absolute path of the extension file to LOAD.
#   DUCKDB_VENV  the venv (default ~/.cache/waltail-duckdb-venv)
set -euo pipefail
DUCKDB_VENV=${DUCKDB_VENV:-$HOME/.cache/waltail-duckdb-venv}
DUCKDB_VERSION=1.4.4
# The extension wheels' version is DuckDB's followed by their build date; the
# 1.4.4 ones require duckdb==1.4.4 (a 1.4.5 DuckDB would refuse to load them).
DUCKDB_EXT_VERSION=1.4.4.20260205
# The newest release: its reader knows reader/writer protocols up to 3/7 with
# table features (timestampNtz among them).
DELTALAKE_VERSION=1.6.6
# deltalake asks for pyarrow>=21; pinned so every machine reads alike.
PYARROW_VERSION=26.0.1
# The newest shell on PyPI (it starts at 1.4.4; no 1.4.2 build exists). It is
# a separate binary that does not load the extensions above: only the bench
# uses it.
DUCKDB_CLI_VERSION=1.5.6
# Distribution name -> wanted version, read from the installed metadata (no
# import: cheap, and a venv left by an older version of this script, with
# duckdb 1.4.2 and nothing else, fails it and is upgraded in place).
wanted="{'duckdb': '$DUCKDB_VERSION', 'duckdb-ext-delta': '$DUCKDB_EXT_VERSION',
  'duckdb-ext-httpfs': '$DUCKDB_EXT_VERSION', 'deltalake': '$DELTALAKE_VERSION',
  'pyarrow': '$PYARROW_VERSION'}"
if ! "$DUCKDB_VENV/bin/python" -c "
import sys
from importlib.metadata import version
sys.exit(any(version(name) != want for name, want in $wanted.items()))" 2>/dev/null; then
  python3 -m venv "$DUCKDB_VENV" >&2
  "$DUCKDB_VENV/bin/pip" install -q --disable-pip-version-check "duckdb==$DUCKDB_VERSION" \
    "duckdb-ext-delta==$DUCKDB_EXT_VERSION" "duckdb-ext-httpfs==$DUCKDB_EXT_VERSION" \
    "deltalake[pyarrow]==$DELTALAKE_VERSION" "pyarrow==$PYARROW_VERSION" >&2
fi
# The extension file as the wheel's RECORD lists it
# (duckdb_ext/extensions/v1.4.4/<platform>/NAME.duckdb_extension in site-packages).
extension() {
  "$DUCKDB_VENV/bin/python" -c "
from importlib.metadata import files
print(*[f.locate() for f in files('duckdb-ext-$1') if f.name == '$1.duckdb_extension'])"
}
case "${1:-}" in
  "") echo "$DUCKDB_VENV/bin/python"; exit 0 ;;
  --delta-extension) extension delta; exit 0 ;;
  --httpfs-extension) extension httpfs; exit 0 ;;
  --cli) ;;
  *) echo "usage: $0 [--cli|--delta-extension|--httpfs-extension]" >&2; exit 2 ;;
esac
cli() {
  "$DUCKDB_VENV/bin/python" -c "import duckdb_cli, os; print(os.path.join(os.path.dirname(duckdb_cli.__file__), 'duckdb'))" 2>/dev/null
}
if ! { path=$(cli) && "$path" --version 2>/dev/null | grep -q "^v$DUCKDB_CLI_VERSION "; }; then
  "$DUCKDB_VENV/bin/pip" install -q --disable-pip-version-check "duckdb-cli==$DUCKDB_CLI_VERSION" >&2
  path=$(cli)
fi
echo "$path"

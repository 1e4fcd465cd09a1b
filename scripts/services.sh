#!/usr/bin/env bash
# Starts (up) or stops (down) every service the tests need, and prints the
# environment the tests read (WT_TEST_*):
#   - PostgreSQL with wal_level=logical          (port 55440)
#   - PostgreSQL with wal_level=replica          (port 55441; for check's failure tests)
#   - SeaweedFS S3 with an admin and a PutObject-only identity (port 8333)
#   - a headless-capable Chromium for the console test (installed if missing,
#     see chromium.sh; `down` leaves it installed)
#   - the readers we did not write, in one venv (installed if missing or at
#     another version, see duckdb.sh): DuckDB's Python package, which the
#     compact test reads Parquet with, with DuckDB's delta and httpfs
#     extensions (wheels, loaded offline), and the deltalake package with
#     pyarrow; tests/readers/delta.py reads Delta tables with them
#   - moto, an AWS (STS and S3 with IAM checks) that tests/credentials.rs
#     starts per test (installed if missing, see moto.sh)
#   - PySpark in local mode (installed if missing, see spark.sh), which
#     tests/readers/spark.py reads the archive with
# Usage: eval "$(scripts/services.sh up)"; ...; scripts/services.sh down
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
base=${TMPDIR:-/tmp}
case "${1:-}" in
  up)
    pg=$(PG_ROOT=$base/waltail-pg PG_PORT=55440 "$here/pg-start.sh")
    pg_replica=$(PG_ROOT=$base/waltail-pg-replica PG_PORT=55441 PG_WAL_LEVEL=replica "$here/pg-start.sh")
    S3_ROOT=$base/waltail-s3 "$here/s3-start.sh" >&2
    # Without a browser the other tests can still run; the console test then
    # fails and says why (it is never skipped).
    chromium=$("$here/chromium.sh") || {
      echo "warning: no Chromium: the console test (tests/console.rs) will fail" >&2
      chromium=
    }
    duckdb_python=$("$here/duckdb.sh")
    moto_python=$("$here/moto.sh")
    spark_python=$("$here/spark.sh")
    cat <<ENV
export WT_TEST_PG='$pg'
export WT_TEST_PG_REPLICA='$pg_replica'
export WT_TEST_S3_ENDPOINT='http://127.0.0.1:8333'
export WT_TEST_S3_BUCKET='waltail-test'
export WT_TEST_S3_KEY='waltail-test-key'
export WT_TEST_S3_SECRET='waltail-test-secret'
export WT_TEST_S3_PUT_KEY='waltail-put-only-key'
export WT_TEST_S3_PUT_SECRET='waltail-put-only-secret'
export WT_TEST_S3_ROOT='$base/waltail-s3'
export WT_TEST_CHROMIUM='$chromium'
export WT_TEST_DUCKDB_PYTHON='$duckdb_python'
export WT_TEST_MOTO_PYTHON='$moto_python'
export WT_TEST_SPARK_PYTHON='$spark_python'
ENV
    ;;
  down)
    S3_ROOT=$base/waltail-s3 "$here/s3-stop.sh" || true
    PG_ROOT=$base/waltail-pg-replica "$here/pg-stop.sh" || true
    PG_ROOT=$base/waltail-pg "$here/pg-stop.sh" || true
    ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac

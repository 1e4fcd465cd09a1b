#!/usr/bin/env python3
"""Reads a Delta Lake table with a reader we did not write, for the Rust tests.

Run it with the python of scripts/duckdb.sh's venv (WT_TEST_DUCKDB_PYTHON),
which has every engine below installed from PyPI:

    python tests/readers/delta.py ENGINE TABLE-URI [--version N] [--sql-order-by COLS]
    python tests/readers/delta.py ENGINE TABLE-URI --count-loop SECONDS

ENGINE
  duckdb             DuckDB's delta_scan, its Delta extension loaded offline from
                     the duckdb-ext-delta wheel (LOAD '<file>': the extension
                     repository is not reachable, and a reader must never depend
                     on it); --version N goes through ATTACH (TYPE delta, VERSION N),
                     DuckDB's only way to read an older version
  deltalake          delta-rs's own engine: DeltaTable.scan(), the read 1.x
                     recommends (column mapping too; deletion vectors by its docs)
  deltalake-pyarrow  DeltaTable.to_pyarrow_table(): delta-rs picks the files,
                     pyarrow reads them, as many pyarrow/pandas users do. No
                     judge of column-mapped tables: deltalake 1.6.6 reads their
                     columns as all NULL there, without an error
TABLE-URI
  a local folder (or file:// URI) or s3://bucket/prefix. For S3 the server and
  credentials come from WT_S3_ENDPOINT (http://host:port), WT_S3_KEY,
  WT_S3_SECRET and WT_S3_REGION (default us-east-1); addressing is path-style.

Output (stdout), so that two engines' outputs compare line by line:
  - one JSON object: {"version": the table version read, "columns": [names in
    table order], "protocol": [minReaderVersion, minWriterVersion] or null}.
    DuckDB tells neither: its protocol is null, and its version is the
    --version asked for, or else the newest commit or checkpoint in _delta_log,
    listed just before and just after the read (equal, so it is the one read;
    null if a commit landed in between).
  - one JSON array per row, each value encoded the same whatever the engine:
    integers as numbers, decimals as strings ("12.30", the column's scale),
    timestamps as ISO-8601 with microseconds (tz-aware ones converted to UTC,
    "+00:00"), dates as YYYY-MM-DD, binary as hex, booleans as true/false,
    NULL as null, floats as numbers ("NaN", "Infinity", "-Infinity" as strings),
    structs as objects, lists as arrays, maps as arrays of [key, value].
    Rows are sorted by their cells' encoded strings (column by column), or,
    with --sql-order-by "a, b DESC", by those columns' values first (NULLs
    last, as DuckDB orders by default; ties by the encoded strings). The order
    is applied here, in Python, the same for every engine.

--count-loop SECONDS reads the table again and again (each read from a new
snapshot of the log: a new DuckDB query, a new DeltaTable) until SECONDS have
passed, at least once, and prints one line per read: its row count. It is for a
test that reads a table while it is being replaced: every read must succeed.

Any read that fails ends the script with exit code 1 and the engine's error on
stderr (after the counts already printed, in --count-loop). Bad arguments exit 2.
"""

import argparse
import datetime
import decimal
import json
import math
import os
import re
import sys
import time
from importlib.metadata import files

ENGINES = ("duckdb", "deltalake", "deltalake-pyarrow")


def usage_error(message):
    print(f"delta.py: {message}", file=sys.stderr)
    sys.exit(2)


def s3_env():
    """The S3 server and credentials from the environment, or exit 2 if unset."""
    missing = [v for v in ("WT_S3_ENDPOINT", "WT_S3_KEY", "WT_S3_SECRET") if not os.environ.get(v)]
    if missing:
        usage_error(f"an s3:// table needs {', '.join(missing)} set")
    return (
        os.environ["WT_S3_ENDPOINT"].rstrip("/"),
        os.environ["WT_S3_KEY"],
        os.environ["WT_S3_SECRET"],
        os.environ.get("WT_S3_REGION") or "us-east-1",
    )


def is_s3(uri):
    return uri.startswith(("s3://", "s3a://"))


# --- DuckDB --------------------------------------------------------------------


def extension_file(name):
    """The NAME.duckdb_extension file that the duckdb-ext-NAME wheel installed
    (duckdb_ext/extensions/v<duckdb>/<platform>/ in site-packages), found
    through the wheel's file list, so no path or platform is spelled here."""
    found = [f.locate() for f in files(f"duckdb-ext-{name}") or [] if f.name == f"{name}.duckdb_extension"]
    if not found:
        raise RuntimeError(f"duckdb-ext-{name} has no {name}.duckdb_extension: run scripts/duckdb.sh")
    return str(found[0])


def sql_string(s):
    return "'" + s.replace("'", "''") + "'"


def duckdb_connect(uri):
    import duckdb

    # Never fetch anything: an extension that is not loaded here is an error,
    # not a download.
    con = duckdb.connect(
        config={"autoinstall_known_extensions": False, "autoload_known_extensions": False}
    )
    # No progress bar: a query slower than two seconds (on a loaded machine)
    # prints one on stdout, into the JSON read from there.
    con.execute("SET enable_progress_bar = false")
    # Arrow then carries TIMESTAMPTZ as UTC, as deltalake does.
    con.execute("SET TimeZone = 'UTC'")
    con.execute(f"LOAD {sql_string(extension_file('delta'))}")
    if is_s3(uri):
        # delta_scan reads the log through the Delta kernel and the Parquet
        # files through DuckDB's own file system, which for s3:// is httpfs's.
        # Both take the server and credentials from this secret.
        con.execute(f"LOAD {sql_string(extension_file('httpfs'))}")
        endpoint, key, secret, region = s3_env()
        use_ssl = not endpoint.startswith("http://")
        host = re.sub(r"^https?://", "", endpoint)
        con.execute(
            f"""CREATE SECRET waltail_s3 (TYPE s3, KEY_ID {sql_string(key)},
                SECRET {sql_string(secret)}, REGION {sql_string(region)},
                ENDPOINT {sql_string(host)}, URL_STYLE 'path', USE_SSL {str(use_ssl).lower()})"""
        )
    return con


def duckdb_latest_version(con, uri):
    """The newest version in _delta_log, listed with DuckDB's glob: the highest
    commit (N.json) or checkpoint (N.checkpoint[.*].parquet|json) file."""
    row = con.execute(
        r"""SELECT max(CAST(regexp_extract(file, '/(\d{20})\.(json|checkpoint(\.[^/]*)?\.(parquet|json))$', 1) AS BIGINT))
            FROM glob(?) WHERE regexp_matches(file, '/(\d{20})\.(json|checkpoint(\.[^/]*)?\.(parquet|json))$')""",
        [uri.rstrip("/") + "/_delta_log/*"],
    ).fetchone()
    return row[0]


def duckdb_read(con, uri, version):
    if version is not None:
        con.execute(f"ATTACH {sql_string(uri)} AS t (TYPE delta, VERSION {int(version)})")
        try:
            return version, None, con.sql("SELECT * FROM t").fetch_arrow_table()
        finally:
            con.execute("DETACH t")
    before = duckdb_latest_version(con, uri)
    table = con.sql(f"SELECT * FROM delta_scan({sql_string(uri)})").fetch_arrow_table()
    after = duckdb_latest_version(con, uri)
    return (before if before == after else None), None, table


# --- deltalake (delta-rs) ------------------------------------------------------


def deltalake_storage_options(uri):
    if not is_s3(uri):
        return None
    endpoint, key, secret, region = s3_env()
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": region,
        "AWS_ALLOW_HTTP": "true",
        # Path-style (http://host:port/bucket/key), as SeaweedFS serves it.
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
        # Reading needs no locking: AWS_S3_ALLOW_UNSAFE_RENAME is not set.
    }


def deltalake_read(uri, version, engine):
    import pyarrow as pa
    from deltalake import DeltaTable

    dt = DeltaTable(uri, version=version, storage_options=deltalake_storage_options(uri))
    protocol = dt.protocol()
    if engine == "deltalake":
        # An arro3 RecordBatchReader; pyarrow takes it over the Arrow C stream.
        table = pa.RecordBatchReader.from_stream(dt.scan()).read_all()
    else:
        table = dt.to_pyarrow_table()
    return dt.version(), [protocol.min_reader_version, protocol.min_writer_version], table


class Reader:
    """read() -> (version read or None, [minReader, minWriter] or None, pyarrow.Table)."""

    def __init__(self, engine, uri, version):
        self.engine, self.uri, self.version = engine, uri, version
        # One DuckDB connection for every read: loading the extension takes a
        # quarter of a second, and each delta_scan query takes a new snapshot
        # of the log anyway (it sees commits made since the last query).
        self.con = duckdb_connect(uri) if engine == "duckdb" else None

    def read(self):
        if self.con is not None:
            return duckdb_read(self.con, self.uri, self.version)
        return deltalake_read(self.uri, self.version, self.engine)


# --- output --------------------------------------------------------------------


def encode(v):
    """One value as plain JSON data, the same for every engine (see the top)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "Infinity" if v > 0 else "-Infinity"
        return v
    if isinstance(v, decimal.Decimal):
        return format(v, "f")  # never exponent notation: 0.00, not 0E-2
    if isinstance(v, datetime.datetime):
        if v.tzinfo is not None:
            v = v.astimezone(datetime.timezone.utc)
        return v.isoformat(timespec="microseconds")
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, dict):
        return {k: encode(x) for k, x in v.items()}
    if isinstance(v, tuple):  # a map entry (pyarrow gives maps as [(key, value)])
        return [encode(x) for x in v]
    if isinstance(v, list):
        return [encode(x) for x in v]
    return str(v)


def dumps(v):
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def parse_order_by(text, columns):
    """'a, b DESC' -> [(index of a, False), (index of b, True)]."""
    keys = []
    for part in text.split(","):
        words = part.split()
        if not words or len(words) > 2 or (len(words) == 2 and words[1].upper() not in ("ASC", "DESC")):
            usage_error(f"--sql-order-by: cannot read {part.strip()!r} (want: column [ASC|DESC], ...)")
        name = words[0].strip('"')
        if name not in columns:
            usage_error(f"--sql-order-by: no column {name!r} in {columns}")
        keys.append((columns.index(name), len(words) == 2 and words[1].upper() == "DESC"))
    return keys


def sorted_rows(rows, order_by):
    """Rows (lists of Python values) sorted by their encoded strings, then
    stably by the --sql-order-by columns, last key first (NULLs last)."""
    rows.sort(key=lambda r: [dumps(encode(v)) for v in r])
    for index, desc in reversed(order_by):
        present = [r for r in rows if r[index] is not None]
        nulls = [r for r in rows if r[index] is None]
        present.sort(key=lambda r: r[index], reverse=desc)
        rows[:] = present + nulls
    return rows


def print_table(version, protocol, table, order_by_text):
    columns = table.column_names
    order_by = parse_order_by(order_by_text, columns) if order_by_text else []
    columns_py = [c.to_pylist() for c in table.columns]
    rows = [list(r) for r in zip(*columns_py)] if columns_py else []
    out = [dumps({"version": version, "columns": columns, "protocol": protocol})]
    out += [dumps([encode(v) for v in r]) for r in sorted_rows(rows, order_by)]
    sys.stdout.write("\n".join(out) + "\n")


def main():
    p = argparse.ArgumentParser(description="Read a Delta table with a reader we did not write.")
    p.add_argument("engine", choices=ENGINES)
    p.add_argument("uri", metavar="table-uri")
    p.add_argument("--version", type=int, help="read this table version (default: the newest)")
    p.add_argument("--sql-order-by", metavar="COLS", help='order rows by these columns first: "a, b DESC"')
    p.add_argument("--count-loop", type=float, metavar="SECONDS", help="print row counts of repeated reads")
    args = p.parse_args()
    uri = args.uri
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    try:
        reader = Reader(args.engine, uri, args.version)
        if args.count_loop is None:
            print_table(*reader.read(), args.sql_order_by)
            return 0
        deadline = time.monotonic() + args.count_loop
        while True:
            _, _, table = reader.read()
            print(table.num_rows, flush=True)
            if time.monotonic() >= deadline:
                return 0
    except SystemExit:
        raise
    except Exception as e:  # the engine's error, whatever its class
        print(f"delta.py: {args.engine} could not read {args.uri}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

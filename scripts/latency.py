#!/usr/bin/env python3
"""Commit-to-object latency of archived changes, for the benchmarks.

Each NDJSON line's `data.at` (clock_timestamp() at insert) is compared with
its object's arrival: the time recorded for its key in ROOT/arrivals (lines
"<key> <epoch seconds>", written from waltail's "archived" log lines for an
S3 store) or else the file's mtime (the folder store writes a staging file
and renames it). Prints p50, p99 and max, and warns when the lines counted
are not ROWS.

Usage: latency.py ROOT ROWS [TABLE [T0 T1]]
  TABLE   count only inserts into this table (e.g. public.lat)
  T0 T1   and only those committed between these epoch seconds
"""
import datetime
import json
import os
import sys

root, rows = sys.argv[1], int(sys.argv[2])
table = sys.argv[3] if len(sys.argv) > 3 else None
t0, t1 = (float(sys.argv[4]), float(sys.argv[5])) if len(sys.argv) > 5 else (None, None)
arrivals = {}
if os.path.exists(os.path.join(root, "arrivals")):
    for line in open(os.path.join(root, "arrivals")):
        key, t = line.split()
        arrivals[os.path.basename(key)] = float(t)
lat = []
for d, _, files in os.walk(root):
    for f in files:
        if not f.endswith(".ndjson"):
            continue
        p = os.path.join(d, f)
        arrived = arrivals.get(f, os.stat(p).st_mtime_ns / 1e9)
        with open(p) as fh:
            for line in fh:
                e = json.loads(line)
                if table and (e.get("table") != table or e.get("op") != "insert"):
                    continue
                at = datetime.datetime.fromisoformat(e["data"]["at"]).timestamp()
                if t0 is not None and not t0 <= at <= t1:
                    continue
                lat.append(arrived - at)
lat.sort()
pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000
note = "" if len(lat) == rows else f" (WARNING: {len(lat)} lines for {rows} rows)"
print(f"p50 {pct(0.50):.0f} ms, p99 {pct(0.99):.0f} ms, max {lat[-1] * 1000:.0f} ms over {len(lat)} changes{note}")

#!/usr/bin/env bash
# Stops the SeaweedFS started by s3-start.sh, by its recorded pid only (also
# when it was SIGSTOPped: it is continued after the SIGTERM so it can exit).
set -euo pipefail
S3_ROOT=${S3_ROOT:-${TMPDIR:-/tmp}/waltail-s3}
# Gone, or exited and not yet reaped by its (re)parent.
alive() { kill -0 "$1" 2>/dev/null && [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" != Z ]; }
if [ -f "$S3_ROOT/weed.pid" ]; then
  pid=$(cat "$S3_ROOT/weed.pid")
  if alive "$pid"; then
    kill "$pid"
    kill -CONT "$pid" 2>/dev/null || true
    for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && kill -9 "$pid" || true
    for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
  fi
  rm -f "$S3_ROOT/weed.pid"
fi

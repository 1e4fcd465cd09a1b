#!/usr/bin/env bash
# Stops the SeaweedFS started by s3-start.sh, by its recorded pid only.
set -euo pipefail
S3_ROOT=${S3_ROOT:-${TMPDIR:-/tmp}/waltail-s3}
if [ -f "$S3_ROOT/weed.pid" ]; then
  pid=$(cat "$S3_ROOT/weed.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" || true
  fi
  rm -f "$S3_ROOT/weed.pid"
fi

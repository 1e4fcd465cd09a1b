#!/usr/bin/env bash
# Installs moto (PyPI, pinned) into a venv under ~/.cache if it is missing or
# at another version, and prints the venv's python. tests/credentials.rs runs
# `python -m moto.server` per test as the AWS we did not write: its STS
# issues the assumed-role credentials and, with INITIAL_NO_AUTH_ACTION_COUNT
# set, its S3 checks every request's signature and IAM policy, so a PUT signed
# with the wrong credentials is refused as AWS would refuse it.
#   MOTO_VENV  the venv (default ~/.cache/waltail-moto-venv)
set -euo pipefail
MOTO_VENV=${MOTO_VENV:-$HOME/.cache/waltail-moto-venv}
MOTO_VERSION=5.2.5
BOTO3_VERSION=1.44.8
installed() {
  "$MOTO_VENV/bin/python" - "$@" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
for want in sys.argv[1:]:
    name, v = want.split("==")
    if version(name) != v:
        sys.exit(1)
PY
}
wanted=("moto==$MOTO_VERSION" "boto3==$BOTO3_VERSION")
if ! installed "${wanted[@]}"; then
  python3 -m venv "$MOTO_VENV" >&2
  "$MOTO_VENV/bin/pip" install -q --disable-pip-version-check \
    "moto[server]==$MOTO_VERSION" "boto3==$BOTO3_VERSION" >&2
  installed "${wanted[@]}" || { echo "moto.sh: the install did not give ${wanted[*]}" >&2; exit 1; }
fi
echo "$MOTO_VENV/bin/python"

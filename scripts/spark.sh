#!/usr/bin/env bash
# Installs PySpark (PyPI, pinned; it bundles Spark itself and runs in local
# mode on the machine's Java 17 or newer) into a venv under ~/.cache if it is
# missing or at another version, and prints the venv's python.
# tests/readers/spark.py reads the archive with it as a Spark user would.
# Without a `java`, Debian's openjdk-17-jre-headless is installed when we are
# root (CI runs as root on a clean machine); otherwise this fails with the
# command to run.
#   SPARK_VENV  the venv (default ~/.cache/waltail-spark-venv)
set -euo pipefail
SPARK_VENV=${SPARK_VENV:-$HOME/.cache/waltail-spark-venv}
PYSPARK_VERSION=4.0.1
installed() {
  "$SPARK_VENV/bin/python" -c "from importlib.metadata import version; import sys; sys.exit(version('pyspark') != '$PYSPARK_VERSION')" 2>/dev/null
}
if ! installed; then
  if ! command -v java >/dev/null; then
    if [ "$(id -u)" != 0 ]; then
      echo "spark.sh: Spark needs Java 17 or newer: run \`sudo apt-get install -y openjdk-17-jre-headless\`" >&2
      exit 1
    fi
    echo "installing Debian's openjdk-17-jre-headless (Spark runs on it)..." >&2
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine may have no package lists yet.
    if ! apt-get install -y --no-install-recommends openjdk-17-jre-headless >&2; then
      apt-get update >&2
      apt-get install -y --no-install-recommends openjdk-17-jre-headless >&2
    fi
  fi
  python3 -m venv "$SPARK_VENV" >&2
  "$SPARK_VENV/bin/pip" install -q --disable-pip-version-check "pyspark==$PYSPARK_VERSION" >&2
  installed || { echo "spark.sh: the install did not give pyspark $PYSPARK_VERSION" >&2; exit 1; }
fi
echo "$SPARK_VENV/bin/python"

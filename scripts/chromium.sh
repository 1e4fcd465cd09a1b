#!/usr/bin/env bash
# Makes sure a headless-capable Chromium is installed (the console test drives
# it) and prints its path. Debian's `chromium` package is installed with
# apt-get when it is missing and we are root (CI runs as root on a clean
# machine); otherwise this fails with the command to run, so the console test
# fails loudly instead of being skipped.
#   CHROMIUM  a browser binary to use instead (e.g. /usr/bin/google-chrome)
set -euo pipefail
find_browser() {
  if [ -n "${CHROMIUM:-}" ]; then command -v "$CHROMIUM"; return; fi
  command -v chromium || command -v chromium-browser
}
if browser=$(find_browser 2>/dev/null); then
  echo "$browser"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "Chromium is not installed: run \`sudo apt-get install -y chromium\` (the console test needs it)" >&2
  exit 1
fi
echo "installing Debian's chromium (the console test needs it)..." >&2
export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet.
if ! apt-get install -y --no-install-recommends chromium >&2; then
  apt-get update >&2
  apt-get install -y --no-install-recommends chromium >&2
fi
find_browser

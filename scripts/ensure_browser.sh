#!/usr/bin/env bash
# A headless Chromium for the book's layout test (tests/test_book.py lays every page out at 1400 px).
# Installs the distribution's `chromium` through apt when none is on the PATH and this user may install
# packages; otherwise says why, and the layout test fails with the same reason (it never skips).
set -euo pipefail
for name in chromium chromium-browser google-chrome; do
  if command -v "$name" >/dev/null 2>&1; then exit 0; fi
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (apt) for the layout test"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
  exit 0
fi
echo "warning: no Chromium on this host and no way to install it here (needs root and apt-get):" \
     "install chromium yourself, or the layout test fails" >&2

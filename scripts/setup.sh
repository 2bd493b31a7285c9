#!/usr/bin/env bash
# Create .venv (if needed) and install spotnb with everything the tests and the
# examples need. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -c constraints.txt -e '.[dev,torch,widgets]'
# tests/test_browser.py drives Debian's Chromium through Playwright (never a browser
# build of Playwright's own). Installed here where we may; the test skips without it.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
      >/dev/null || echo "setup: could not install chromium; the browser test will skip" >&2
  else
    echo "setup: chromium is not installed (apt-get install chromium as root);" \
         "the browser test will skip" >&2
  fi
fi

#!/usr/bin/env bash
# Create .venv (if needed) and install spotnb into it. Safe to run again.
#
#   bash scripts/setup.sh              everything the tests need (scripts/test.sh): the
#                                      development tools, every extra, and Debian's
#                                      Chromium for the browser test (as root)
#   bash scripts/setup.sh quickstart   only what notebooks/quickstart.ipynb uses
#                                      (scripts/quickstart.sh): spotnb with its torch,
#                                      widgets and examples extras; no system package
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-dev}
case "$profile" in
  dev) extras="dev,torch,widgets,examples,transformers,lightning,accelerate" ;;
  quickstart) extras="torch,widgets,examples" ;;
  *) echo "setup: unknown profile '$profile' (dev or quickstart)" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
if [ "$profile" = dev ]; then
  python -m pip install -q --upgrade pip
fi
# constraints.txt pins torch to its CPU build (an unpinned torch pulls a multi-GB CUDA one).
# No compiling of every installed module to bytecode (torch, transformers and lightning
# have thousands; it took half of a 6-minute set-up): Python compiles the ones a run
# imports, once, when it first imports them.
python -m pip install -q --no-compile -c constraints.txt -e ".[$extras]"
[ "$profile" = dev ] || exit 0
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

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
python -m pip install -q -c constraints.txt -e '.[dev,torch]'

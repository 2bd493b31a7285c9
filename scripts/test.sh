#!/usr/bin/env bash
# The README's test command: set up, lint, type-check, run the whole test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
echo "== ruff"; ruff check spotnb tests benchmarks || exit 1
echo "== mypy"; mypy || exit 1
echo "== pytest"
# Two workers (pytest-xdist): most of a test's time is waiting on real processes (boots,
# notices, uploads), so two at once finish the suite much sooner even on two cores.
# Tests go to whichever worker is free; a module marked xdist_group stays on one worker
# (its module fixtures are made once). -n 0: one process. The 30 slowest tests are
# listed at the end: what to look at when the run nears its 20-minute bound.
python -m pytest -n "${SPOTNB_TEST_WORKERS:-2}" --dist loadgroup --durations=30 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest ran no test: that is a failure here" >&2
  exit 1
fi
exit "$rc"

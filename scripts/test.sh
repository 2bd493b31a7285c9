#!/usr/bin/env bash
# The README's test command: set up, lint, type-check, run the whole test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
# Bytecode: setup installs with --no-compile, and an environment that sets
# PYTHONDONTWRITEBYTECODE (this machine's image does) would have every process of the
# run compile what it imports from source, each time: torch takes 5 CPU-s to import so
# instead of 2, IPython and ipykernel 1.2 instead of 0.3. Each module's first import
# writes its .pyc; the rest read it.
unset PYTHONDONTWRITEBYTECODE
echo "== ruff"; ruff check spotnb tests benchmarks || exit 1
# mypy (one core for ~30 s) runs beside the tests, not before them; its verdict is
# printed, and counts, once they end.
mypy_log=$(mktemp)
mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
echo "== pytest"
# pytest-xdist workers: most of a test's time is waiting on real processes (boots,
# notices, uploads), so several at once finish the suite much sooner even on two
# cores; three kept a 2-core machine's CPUs busy (1,226 s against two workers' 1,398 s,
# the same machine). Tests go to whichever worker is free; a module marked
# xdist_group stays on one worker (its module fixtures are made once). -n 0: one
# process. The 30 slowest tests are listed at the end: what to look at when the run
# nears its 20-minute bound.
python -m pytest -n "${SPOTNB_TEST_WORKERS:-3}" --dist loadgroup --durations=30 "$@"
rc=$?
echo "== mypy"
wait "$mypy_pid"
mypy_rc=$?
cat "$mypy_log"
rm -f "$mypy_log"
if [ "$rc" -eq 5 ]; then
  echo "pytest ran no test: that is a failure here" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"
exit "$mypy_rc"

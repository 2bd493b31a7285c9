#!/usr/bin/env bash
# The README's main job: set up .venv with only what the notebook uses (no development
# tools, no system package: scripts/test.sh installs the rest), then execute
# notebooks/quickstart.ipynb head-less on the local cloud (a PyTorch training run that is
# interrupted twice and resumes), write the executed notebook, and show its accuracy and
# cost lines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh quickstart
OUT=notebooks/quickstart.executed.ipynb
.venv/bin/spotnb run notebooks/quickstart.ipynb -o "$OUT"
echo
echo "== from the executed notebook ($OUT)"
.venv/bin/python - "$OUT" <<'PY'
import re
import sys

import nbformat

nb = nbformat.read(sys.argv[1], as_version=4)
wanted = re.compile(r"^(\[spotnb .*\] .*spot interruption notice.*|test accuracy .*|"
                    r"accuracy .* attempts|cost \$.*on-demand.*)$")
for cell in nb.cells:
    for out in cell.get("outputs", []):
        # printed lines, and the display's (the milestones are in its text form)
        text = out.get("text") if out.get("output_type") == "stream" else \
            out.get("data", {}).get("text/plain", "")
        for line in str(text or "").splitlines():
            if wanted.match(line):
                print(line)
PY
echo
echo "Open $OUT in Jupyter to see the whole run; spotnb jobs lists the job."

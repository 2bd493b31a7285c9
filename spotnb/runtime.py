"""``spotnb.runtime``: the path a cell names the runtime by (``from spotnb import runtime
as spot``, ``import spotnb.runtime as spot``). It is :mod:`spotnb.train.runtime` itself,
the same module object (its state, its ``spot.*``), not a copy.
"""

import sys

from spotnb.train import runtime

sys.modules[__name__] = runtime

"""``python -m spotnb.kernel_remote --job <store-uri>``: run the agent."""

import sys

from spotnb.kernel_remote.agent import main

sys.exit(main())

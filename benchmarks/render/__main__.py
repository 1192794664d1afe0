"""``python -m benchmarks.render``: the same as ``graftblock report``."""

import sys

from benchmarks.render import main

sys.exit(main())

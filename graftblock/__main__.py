"""``python -m graftblock <command>``: the same as the ``graftblock`` script (e.g. for ``ray job submit``)."""

import sys

from graftblock.cli import main

sys.exit(main())

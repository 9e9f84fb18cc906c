"""``python -m fullshard``: the ``fullshard`` command."""

import sys

from fullshard.cli import main

sys.exit(main())

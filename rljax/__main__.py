"""`python -m rljax`: the `rljax` command line."""

import sys

from rljax.cli import main

sys.exit(main())

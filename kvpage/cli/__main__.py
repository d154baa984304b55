"""`python -m kvpage.cli`: the `kvpage` command."""

import sys

from kvpage.cli import main

sys.exit(main())

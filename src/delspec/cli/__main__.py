"""`python -m delspec.cli`: the `delspec` command."""

import sys

from delspec.cli import main

sys.exit(main())

"""`python -m ridge ...` runs the `ridge` command: the same entry point as the console script, for
a checkout that is not pip-installed (or whose installed script points at another tree)."""
import sys

from ridge.cli import main

sys.exit(main())

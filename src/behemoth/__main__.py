"""``python -m behemoth ...``: the same as the ``behemoth`` command (see behemoth.cli)."""

import sys

from behemoth.cli import main

if __name__ == "__main__":
    sys.exit(main())

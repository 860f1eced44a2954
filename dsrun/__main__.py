"""``python -m dsrun ...``: the ``dsrun`` command, run by this interpreter
(the ranks then run it too: dsrun starts them with the launcher's Python)."""

import sys

from dsrun.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m vertumnus``: see ``vertumnus.cli``."""

from __future__ import annotations

import sys

from vertumnus.cli import main

if __name__ == "__main__":
    sys.exit(main())

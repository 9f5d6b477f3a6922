"""``python -m rowcache``: the same command line as the ``rowcache`` script."""

from __future__ import annotations

import sys

from rowcache.cli.app import main

sys.exit(main())

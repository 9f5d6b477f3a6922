"""``python -m bench.serve``: the serving judge (``bench.serve.run``)."""

import sys

from bench.serve.run import main

sys.exit(main())

"""``python -m etrain.api.cli``: the same command line as the ``etrain`` console script."""

import sys

from etrain.api.cli import main

sys.exit(main())

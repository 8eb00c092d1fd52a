"""``python -m rmqfast.bench``: the same as ``rmqfast bench``."""

import sys

from rmqfast.bench.cli import main

sys.exit(main())

"""``python -m rmqfast.testing``: build the jars and run a throw-away cluster until Ctrl-C."""

import sys

from rmqfast.testing.cluster import main

sys.exit(main())

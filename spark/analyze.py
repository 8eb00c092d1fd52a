"""spark-submit entry point: ``spark-submit spark/analyze.py RECORDS_DIR -o REPORT_DIR [--master ...]``.

The jobs live in the ``rmqfast.analytics`` package (also used by ``rmqfast analyze``); this
file only makes a source checkout importable when rmqfast is not installed on the driver.
Executors need nothing: the jobs use the DataFrame API only (no Python UDFs).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import rmqfast.analytics  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rmqfast.analytics.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="spark-submit spark/analyze.py"))

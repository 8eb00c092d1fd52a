"""One local SparkSession for all the Spark tests (imported as a fixture by the test modules)."""

from __future__ import annotations

import atexit
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Any:
    pytest.importorskip("pyspark")
    from rmqfast.analytics.spark import get_spark

    s = get_spark("local[2]", app="rmqfast-tests", driver_memory="1g")
    atexit.register(s.stop)
    return s

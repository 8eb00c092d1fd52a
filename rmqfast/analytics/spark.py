"""The Spark session used by the jobs (local mode by default, any ``--master`` works)."""

from __future__ import annotations

import logging
import os
from typing import Any

from rmqfast.records.parquet import Column

#: Settings for a small machine; on a cluster, spark-submit's own flags take precedence
#: for everything given there (``--driver-memory``, ``--conf ...``).
LOCAL_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.files.ignoreCorruptFiles": "true",  # second safety net after inputs.check
    "spark.sql.files.maxPartitionBytes": str(64 << 20),
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
    "spark.sql.adaptive.enabled": "true",
    # Spark 4 turned ANSI mode on by default: one record whose value overflows a cast (a
    # timestamp of inf from a damaged file) would then abort the whole report. The jobs are
    # written for Spark 3's semantics, where such a value becomes null and the record is left
    # out of the tables that need it: bad input never aborts the report (spark/README.md).
    "spark.sql.ansi.enabled": "false",
}


#: Inputs up to this many bytes (local files) are a small report: SMALL_CONF applies.
SMALL_INPUT_BYTES = 64 << 20

#: A small report is dominated by fixed costs per Spark job and per JVM start, not by data:
#: one shuffle partition (one task per stage), no adaptive re-planning (which adds a job per
#: shuffle stage), and a JVM that compiles with C1 only (short runs finish before C2 would
#: pay off) with the serial collector.  Measured on the demo's records: docs in spark/README.md.
SMALL_CONF = {
    "spark.sql.shuffle.partitions": "1",
    "spark.sql.adaptive.enabled": "false",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
}


def get_spark(master: str | None = None, app: str = "rmqfast-analyze", driver_memory: str = "2g",
              conf: dict[str, str] | None = None, small: bool = False) -> Any:
    """A SparkSession; ``master=None`` keeps what spark-submit set (or ``local[*]``).

    ``small=True`` (inputs of at most SMALL_INPUT_BYTES) applies SMALL_CONF in local mode.
    Starts offline: nothing is downloaded (pyspark ships its jars).
    """
    os.environ.setdefault("PYSPARK_PYTHON", os.environ.get("PYSPARK_PYTHON", "python3"))
    from pyspark.sql import SparkSession

    b = SparkSession.builder.appName(app)
    submitted = "SPARK_SUBMIT_OPTS" in os.environ or os.environ.get("PYSPARK_GATEWAY_PORT")
    if master:
        b = b.master(master)
    elif not submitted:
        b = b.master("local[*]")
    local = (master or "local").startswith("local") and not submitted
    if local:  # loopback only; also keeps Spark from warning that the host name resolves to it
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings = dict(LOCAL_CONF)
    if not local:  # on a cluster the driver must be reachable from the executors
        settings.pop("spark.driver.bindAddress")
        settings.pop("spark.driver.host")
        settings["spark.sql.shuffle.partitions"] = "64"
    if not submitted:
        settings["spark.driver.memory"] = driver_memory
    if small and local:
        settings.update(SMALL_CONF)
    settings.update(conf or {})
    for k, v in settings.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    # py4j says at INFO every time it drops a gateway connection; when the JVM is already gone
    # at interpreter exit, its garbage-collection thread logs a traceback per Java object left
    # (into whatever stream the root logger had, often closed by then).  Its warnings stay.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    # One of those goes through the root logger itself (``logging.info`` in java_gateway.py's
    # send_command retry), which the level above does not reach: a filter on the root logger.
    root = logging.getLogger()
    if not any(isinstance(f, Py4jRootInfo) for f in root.filters):
        root.addFilter(Py4jRootInfo())
    return spark


class Py4jRootInfo(logging.Filter):
    """Drops the records below WARNING that py4j's own modules log on the root logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not _in_py4j(record.pathname)


def _in_py4j(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return len(parts) >= 2 and parts[-2] == "py4j"


def struct_type(columns: tuple[Column, ...] | list[Column]) -> Any:
    from pyspark.sql import types as T

    kinds = {"int32": T.IntegerType(), "int64": T.LongType(), "double": T.DoubleType(), "string": T.StringType()}
    return T.StructType([T.StructField(c.name, kinds[c.kind], True) for c in columns])

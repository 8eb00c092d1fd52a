"""py4j's retry message on the root logger is dropped (it printed a traceback into a closed
stream at interpreter exit); py4j's warnings and everybody else's records pass."""

from __future__ import annotations

import logging
from pathlib import Path

import py4j.java_gateway

from rmqfast.analytics.spark import Py4jRootInfo


def record(path: str, level: int) -> logging.LogRecord:
    return logging.LogRecord("root", level, path, 1056, "Exception while sending command.", None, None)


def test_py4j_info_on_the_root_logger_is_dropped_and_the_rest_kept() -> None:
    f = Py4jRootInfo()
    gateway = py4j.java_gateway.__file__  # the file whose logging.info printed the traceback
    assert not f.filter(record(gateway, logging.INFO))
    assert not f.filter(record(gateway, logging.DEBUG))
    assert f.filter(record(gateway, logging.WARNING))
    assert f.filter(record(gateway, logging.ERROR))
    assert f.filter(record(str(Path(__file__)), logging.INFO))
    assert f.filter(record("/srv/app/not_py4j/java_gateway.py", logging.INFO))


def test_the_filter_on_the_root_logger_stops_the_record() -> None:
    root = logging.getLogger()
    f = Py4jRootInfo()
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, r: logging.LogRecord) -> None:
            seen.append(r)

    h = Keep()
    old = root.level
    root.addHandler(h)
    root.addFilter(f)
    root.setLevel(logging.INFO)
    try:
        root.handle(record(py4j.java_gateway.__file__, logging.INFO))
        root.handle(record(__file__, logging.INFO))
    finally:
        root.removeFilter(f)
        root.removeHandler(h)
        root.setLevel(old)
    assert [r.pathname for r in seen] == [__file__]

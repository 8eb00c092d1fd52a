"""Structured logging: one JSON object a line (default) or a human-readable format.

Call sites pass machine-readable context through ``extra={"ctx": {...}}``; the JSON
formatter merges it into the record, the human formatter appends it as ``key=value``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        ctx = getattr(record, "ctx", None)
        if ctx:
            out.update(ctx)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class HumanFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{ts} {record.levelname:<7} [{record.process}] {record.name}: {record.getMessage()}"
        ctx = getattr(record, "ctx", None)
        if ctx:
            line += " " + " ".join(f"{k}={v}" for k, v in ctx.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(fmt: str = "json", level: str = "info") -> None:
    """Configure the root logger of this process (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else HumanFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS.get(level, logging.INFO))
    os.environ["RMQFAST_LOG_FORMAT"] = fmt
    os.environ["RMQFAST_LOG_LEVEL"] = level


def ctx(**fields: Any) -> dict[str, Any]:
    """``logger.info("...", extra=ctx(peer=..., code=...))``"""
    return {"ctx": fields}

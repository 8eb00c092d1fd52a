"""Spark jobs over traffic records and benchmark results (``rmqfast analyze``, ``spark/analyze.py``)."""

from __future__ import annotations

from rmqfast.analytics.report import analyze

__all__ = ["analyze"]

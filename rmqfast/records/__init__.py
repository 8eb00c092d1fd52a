"""Traffic records: per-second aggregates and sampled per-request records (docs/records.md)."""

from __future__ import annotations

from rmqfast.records.recorder import StatsDelta, TrafficRecorder
from rmqfast.records.schema import (
    AGG_COLUMNS,
    AGG_VERSION,
    LAT_BOUNDS_US,
    LAT_COLUMNS,
    SAMPLE_COLUMNS,
    SAMPLE_VERSION,
    AggRow,
)

__all__ = [
    "AGG_COLUMNS", "AGG_VERSION", "LAT_BOUNDS_US", "LAT_COLUMNS", "SAMPLE_COLUMNS", "SAMPLE_VERSION",
    "AggRow", "StatsDelta", "TrafficRecorder",
]

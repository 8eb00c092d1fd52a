"""What every analytics job returns: :class:`Result` (tables of rows, notes, problems, counts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Rows = list[dict[str, Any]]


@dataclass
class Result:
    tables: dict[str, Rows] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    bucket_s: dict[str, int] = field(default_factory=dict)


def rows_of(df: Any) -> Rows:
    return [r.asDict() for r in df.collect()]



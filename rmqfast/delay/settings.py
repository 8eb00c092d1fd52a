"""``[delay]``: which topics the proxy holds delayed messages for, and the bounds.

```toml
[delay]
topics = ["orders", "delay-*"]   # a topic, a prefix ending in '*', or '*'; [] (default): off
max_pending_bytes = 1073741824   # per worker; a delayed send past it is refused (SYSTEM_BUSY)
max_delay = "400d"               # longest delay accepted; longer: MESSAGE_ILLEGAL
levels = { 19 = "1d", 20 = "7d" } # delay levels the proxy holds (others go to the broker)
release_in_flight = 256          # sends in flight to the brokers per worker while releasing
queue_window = 1                 # sends in flight per broker queue: 1 = stored strictly in due order;
                                 # more = faster release, messages within a window in any order
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rmqfast.errors import ConfigError
from rmqfast.settings.base import toml_value as _t
from rmqfast.settings.engine import parse_section, section, setting

_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_MAX_DELAY_LIMIT = 100 * 365 * 86_400_000


def parse_duration(key: str, value: Any) -> int:
    """Milliseconds of ``"90s"``, ``"5m"``, ``"2h"``, ``"365d"``, ``"250ms"`` or an integer of seconds."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value * 1000
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return int(m.group(1)) * _UNITS[m.group(2)]
    raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a duration such as \"500ms\", \"30s\", "
                      "\"5m\", \"2h\", \"365d\" (or an integer of seconds)")


def _topics(key: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ConfigError(f"{key}: {_t(v)} is not allowed; expected a list of topics "
                          "(a name, a prefix ending in '*', or '*')")
    for x in v:
        if "*" in x[:-1]:
            raise ConfigError(f"{key}: {_t(x)} is not allowed; '*' may only end a prefix")
    return list(v)


def _max_delay_ms(key: str, v: Any) -> int:
    ms = parse_duration(key, v)
    if not 1000 <= ms <= _MAX_DELAY_LIMIT:
        raise ConfigError(f"{key}: {_t(v)} is not allowed; expected from 1s to 36500d")
    return ms


def _levels(key: str, lv: Any) -> dict[str, Any]:
    """Level -> duration as written; checked against ``max_delay`` in :meth:`DelaySection.check`."""
    if not isinstance(lv, dict):
        raise ConfigError(f"{key}: {_t(lv)} is not allowed; expected a table of level = duration, "
                          "e.g. { 19 = \"1d\" }")
    return dict(lv)


@section("delay", "Which topics the proxy holds delayed messages for, and the bounds.")
@dataclass
class DelaySection:
    topics: list[str] = setting(factory=list, parse=_topics, expect="a list of topics (a name, a prefix ending in "
                                "'*', or '*')", doc="topics held by the proxy; [] (default): off")
    max_pending_bytes: int = setting(1 << 30, kind="size", lo=1 << 20, hi=1 << 50,
                                     doc="per worker; a delayed send past it is refused (SYSTEM_BUSY)")
    max_delay_ms: int = setting(400 * 86_400_000, key="max_delay", parse=_max_delay_ms, kind="duration", unit="ms",
                                expect='a duration from "1s" to "36500d"', doc="longest delay accepted; longer: "
                                "MESSAGE_ILLEGAL (stored in ms)")
    levels: dict[str, int] = setting(factory=dict, parse=_levels, expect='a table of level = duration, e.g. '
                                     '{ 19 = "1d" }', doc="delay levels the proxy holds (others go to the broker)")
    release_in_flight: int = setting(256, lo=1, hi=4096, doc="sends in flight to the brokers per worker while "
                                     "releasing")
    queue_window: int = setting(1, lo=1, hi=1024, what=" (each queue in strict due order)",
                                doc="sends in flight per broker queue: 1 = stored strictly in due order")

    @property
    def enabled(self) -> bool:
        return bool(self.topics)

    def level_ms(self) -> dict[int, int]:
        return {int(k): v for k, v in self.levels.items()}

    def covers(self, topic: str) -> bool:
        for t in self.topics:
            if t == "*" or t == topic or (t.endswith("*") and topic.startswith(t[:-1])):
                return True
        return False

    def check(self) -> list[str]:
        """The levels as durations within ``max_delay``, stored as level (text, JSON keys) -> ms."""
        errs: list[str] = []
        raw, self.levels = self.levels, {}
        for k, v in raw.items():
            try:
                if not str(k).isdigit() or not 1 <= int(k) <= 1000:
                    raise ConfigError(f"delay.levels.{k}: the level must be an integer from 1 to 1000")
                ms = parse_duration(f"delay.levels.{k}", v)
                if not 1 <= ms <= self.max_delay_ms:
                    raise ConfigError(f"delay.levels.{k}: {_t(v)} is not allowed; expected from 1ms to "
                                      "delay.max_delay")
                self.levels[str(int(k))] = ms
            except ConfigError as exc:
                errs.append(str(exc))
        return errs


def parse_delay(raw: Any) -> DelaySection:
    """Validate the ``[delay]`` table; every problem is reported (ConfigErrors for several)."""
    return parse_section(DelaySection, "delay", raw)

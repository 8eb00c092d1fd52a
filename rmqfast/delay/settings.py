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
from dataclasses import dataclass, field
from typing import Any

from rmqfast.errors import ConfigError
from rmqfast.settings.base import ConfigErrors
from rmqfast.settings.base import toml_value as _t

KNOWN = {"topics", "max_pending_bytes", "max_delay", "levels", "release_in_flight", "queue_window"}
_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_MAX_DELAY_LIMIT = 100 * 365 * 86_400_000


@dataclass
class DelaySection:
    topics: list[str] = field(default_factory=list)
    max_pending_bytes: int = 1 << 30
    max_delay_ms: int = 400 * 86_400_000
    levels: dict[str, int] = field(default_factory=dict)  # level (as text, JSON keys) -> ms
    release_in_flight: int = 256
    queue_window: int = 1

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


def _topics(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ConfigError(f"delay.topics: {_t(v)} is not allowed; expected a list of topics "
                          "(a name, a prefix ending in '*', or '*')")
    for x in v:
        if "*" in x[:-1]:
            raise ConfigError(f"delay.topics: {_t(x)} is not allowed; '*' may only end a prefix")
    return list(v)


def _max_pending_bytes(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not (1 << 20) <= v <= (1 << 50):
        raise ConfigError(f"delay.max_pending_bytes: {_t(v)} is not allowed; expected an integer from "
                          f"{1 << 20} (1 MiB) to {1 << 50}")
    return v


def _max_delay_ms(v: Any) -> int:
    ms = parse_duration("delay.max_delay", v)
    if not 1000 <= ms <= _MAX_DELAY_LIMIT:
        raise ConfigError(f"delay.max_delay: {_t(v)} is not allowed; expected from 1s to 36500d")
    return ms


def _release_in_flight(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4096:
        raise ConfigError(f"delay.release_in_flight: {_t(v)} is not allowed; expected an integer from 1 to 4096")
    return v


def _queue_window(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1024:
        raise ConfigError(f"delay.queue_window: {_t(v)} is not allowed; expected an integer from 1 (each queue in "
                          "strict due order) to 1024")
    return v


#: (key, DelaySection attribute, parser): the keys with one value, in the order they are checked.
_FIELDS = (("topics", "topics", _topics), ("max_pending_bytes", "max_pending_bytes", _max_pending_bytes),
           ("max_delay", "max_delay_ms", _max_delay_ms), ("release_in_flight", "release_in_flight", _release_in_flight),
           ("queue_window", "queue_window", _queue_window))


def _parse_levels(lv: Any, d: DelaySection, errs: list[str]) -> None:
    if not isinstance(lv, dict):
        errs.append(f"delay.levels: {_t(lv)} is not allowed; expected a table of level = duration, "
                    "e.g. {{ 19 = \"1d\" }}")
        return
    for k, v in lv.items():
        try:
            if not str(k).isdigit() or not 1 <= int(k) <= 1000:
                raise ConfigError(f"delay.levels.{k}: the level must be an integer from 1 to 1000")
            ms = parse_duration(f"delay.levels.{k}", v)
            if not 1 <= ms <= d.max_delay_ms:
                raise ConfigError(f"delay.levels.{k}: {_t(v)} is not allowed; expected from 1ms to "
                                  "delay.max_delay")
            d.levels[str(int(k))] = ms
        except ConfigError as exc:
            errs.append(str(exc))


def parse_delay(raw: Any) -> DelaySection:
    """Validate the ``[delay]`` table; every problem is reported (ConfigErrors for several)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"delay: {_t(raw)} is not allowed; expected a table")
    errs: list[str] = []
    d = DelaySection()
    for k in raw:
        if k not in KNOWN:
            errs.append(f"delay.{k}: unknown key; expected one of {', '.join(sorted(KNOWN))}")
    for key, attr, parse in _FIELDS:
        if key in raw:
            try:
                setattr(d, attr, parse(raw[key]))
            except ConfigError as exc:
                errs.append(str(exc))
    if "levels" in raw:
        _parse_levels(raw["levels"], d, errs)
    if len(errs) == 1:
        raise ConfigError(errs[0])
    if errs:
        raise ConfigErrors(errs)
    return d

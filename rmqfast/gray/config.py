"""``[gray]``: gray (canary) releases per consumer group."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from rmqfast.errors import ConfigError
from rmqfast.settings.engine import section


@dataclass
class GrayGroup:
    """One ``[[gray.group]]`` table: a consumer group whose topics are split."""

    group: str  # the consumer group
    topics: list[str]  # topics whose queues are split (exact names)
    gray_queues: int = 1  # per broker: the last N queue ids of each topic are the gray queues
    clients: list[str] = field(default_factory=list)  # client id globs (ip@instanceName[@unitName])
    cidrs: list[str] = field(default_factory=list)  # client IP networks (the IP of the client id; a
    # producer's connection address)
    producer_groups: list[str] = field(default_factory=list)  # sends of these producer groups are gray
    property: str = ""  # "KEY=VALUE": sends carrying this user property are gray ("" = none)


@section("gray", "Gray (canary) releases (docs/gray.md).", parse=lambda raw: parse_gray(raw))
@dataclass
class GraySection:
    settle: float = 8.0  # seconds from promote/abort to the gray queues changing hands (a promote: at least)
    grace: float = 30.0  # seconds without a live gray consumer before normal consumers take the gray queues
    drain_timeout: float = 120.0  # a promote waits for its drain (committed offsets at its marks), at most this long
    backlog_interval: float = 5.0  # seconds between backlog reads (metric, drains); 0: none (drains by time)
    handover: float = 2.0  # seconds each phase change holds the group's pulls while its consumers rebalance (0: off)
    state_file: str = ""  # promote/abort commands shared by the workers; default <state_dir>/gray.json
    groups: list[GrayGroup] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.groups)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GraySection:
        d = dict(d)
        d["groups"] = [GrayGroup(**g) for g in d.get("groups", [])]
        return cls(**d)

    def group(self, name: str) -> GrayGroup | None:
        for g in self.groups:
            if g.group == name:
                return g
        return None


_GROUP_KEYS = {"group", "topics", "gray_queues", "clients", "cidrs", "producer_groups", "property"}


def _strs(key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise ConfigError(f"{key}: {value!r} is not allowed; expected a list of non-empty strings")
    return list(value)


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 3600:
        raise ConfigError(f"{key}: {value!r} is not allowed; expected seconds from 0 to 3600")
    return float(value)


def _parse_group(key: str, raw: Any) -> GrayGroup:
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected a table, got {type(raw).__name__}")
    unknown = set(raw) - _GROUP_KEYS
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}: unknown key; expected one of {', '.join(sorted(_GROUP_KEYS))}")
    name = raw.get("group")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{key}.group: {name!r} is not allowed; expected a consumer group name")
    g = GrayGroup(group=name, topics=_strs(f"{key}.topics", raw.get("topics")))
    if not g.topics:
        raise ConfigError(f"{key}.topics: expected at least one topic whose queues are split")
    n = raw.get("gray_queues", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
        raise ConfigError(f"{key}.gray_queues: {n!r} is not allowed; expected an integer from 1 to 1024 "
                          "(gray queues per broker; a topic needs more queues than that on each broker)")
    g.gray_queues = n
    g.clients = _strs(f"{key}.clients", raw.get("clients", []))
    g.cidrs = _strs(f"{key}.cidrs", raw.get("cidrs", []))
    for c in g.cidrs:
        try:
            ipaddress.ip_network(c, strict=False)
        except ValueError:
            raise ConfigError(f"{key}.cidrs: {c!r} is not an IP network (e.g. 10.1.0.0/16)") from None
    g.producer_groups = _strs(f"{key}.producer_groups", raw.get("producer_groups", []))
    prop = raw.get("property", "")
    if not isinstance(prop, str) or (prop and ("=" not in prop or prop.startswith("="))):
        raise ConfigError(f"{key}.property: {prop!r} is not allowed; "
                          "expected \"KEY=VALUE\" (e.g. \"gray=true\") or \"\"")
    g.property = prop
    if not (g.clients or g.cidrs or g.producer_groups or g.property):
        raise ConfigError(f"{key}: names no gray client (set clients, cidrs, producer_groups or property)")
    return g


def _handover(value: Any) -> float:
    v = _seconds("gray.handover", value)
    if 0 < v < 0.5 or v > 60:
        raise ConfigError(f"gray.handover: {v:g} is not allowed; expected 0 (no hand-over fence or notification "
                          "at a phase change) or 0.5 to 60 seconds (longer than the consumers need to rebalance)")
    return v


def parse_gray(raw: Any) -> GraySection:
    """The ``[gray]`` table, checked; a :class:`ConfigError` names the bad key and what is allowed."""
    if not isinstance(raw, dict):
        raise ConfigError(f"gray: expected a table, got {type(raw).__name__}")
    allowed = {"settle", "grace", "drain_timeout", "backlog_interval", "handover", "state_file", "group"}
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"gray.{sorted(unknown)[0]}: unknown key; expected one of {', '.join(sorted(allowed))}")
    out = GraySection()
    if "settle" in raw:
        out.settle = _seconds("gray.settle", raw["settle"])
    if "grace" in raw:
        out.grace = _seconds("gray.grace", raw["grace"])
    if "drain_timeout" in raw:
        out.drain_timeout = _seconds("gray.drain_timeout", raw["drain_timeout"])
    if out.drain_timeout < out.settle:
        raise ConfigError(f"gray.drain_timeout: {out.drain_timeout:g} is not allowed; expected at least "
                          f"gray.settle ({out.settle:g} s): a promote waits for its drain after the settle")
    if "backlog_interval" in raw:
        out.backlog_interval = _seconds("gray.backlog_interval", raw["backlog_interval"])
        if 0 < out.backlog_interval < 0.2:
            raise ConfigError(f"gray.backlog_interval: {out.backlog_interval:g} is not allowed; expected 0 "
                              "(no backlog reads) or at least 0.2 seconds")
    out.handover = _handover(raw.get("handover", out.handover))
    sf = raw.get("state_file", "")
    if not isinstance(sf, str):
        raise ConfigError(f"gray.state_file: {sf!r} is not allowed; expected a path")
    out.state_file = sf
    groups = raw.get("group", [])
    if not isinstance(groups, list):
        raise ConfigError("gray.group: expected [[gray.group]] tables")
    seen: set[str] = set()
    topics: dict[str, str] = {}
    for i, g in enumerate(groups):
        grp = _parse_group(f"gray.group[{i}]", g)
        if grp.group in seen:
            raise ConfigError(f"gray.group[{i}].group: {grp.group!r} is configured twice")
        seen.add(grp.group)
        for t in grp.topics:  # a topic's queues are split once: sends do not name a consumer group
            if t in topics:
                raise ConfigError(f"gray.group[{i}].topics: {t!r} is split by group {topics[t]!r} already "
                                  "(a topic belongs to one gray group)")
            topics[t] = grp.group
        out.groups.append(grp)
    return out

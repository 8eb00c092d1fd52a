"""``[limits]``: per-topic / per-tag / global send limits, as configured and as the limiter sees them.

A rule names a topic (``orders``), a topic prefix (``orders-*``) or every topic (``*``),
optionally one tag, and limits it in messages per second and/or bytes per second with a burst.
``mode`` switches a rule at runtime: ``limit`` applies the rates, ``reject`` answers every send
with SYSTEM_BUSY (a circuit breaker), ``open`` lets everything through, ``shape`` applies the rates
but commits over-limit sends to the worker's spill and releases them later at the rule's rate
(:mod:`rmqfast.limits.shaper`).  A send must conform to
its topic+tag rule (if one matches its tag), its best topic rule (exact name, else the longest
prefix, else ``*``) and the global limit.

Each rule owns a slot in the shared bucket memory (:mod:`rmqfast.limits`): the global limit
slot 0, every configured rule a slot of its own in 1..1023, tied to its identity (topic pattern
and tag), not to its position.  A freshly parsed configuration numbers its rules in order; every
later change (SIGHUP reload: :meth:`LimitsSection.inherit_slots`, admin PUT/DELETE:
:func:`upsert` / :func:`remove`) keeps the slot of every rule whose topic and tag it keeps and
gives a new rule a free slot: never one a rule of the previous configuration held while
another is free (a worker that has not reloaded yet may still charge it), and the first above
every slot in use, so a slot freed by a recent change is reused last.  The supervisor passes
the slots to the workers with the rules (``config.json``), so every worker charges the same
buckets; it resets the buckets whose rule is new, changed or gone
(:func:`rmqfast.limits.reset_changed`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rmqfast.errors import ConfigError
from rmqfast.settings.engine import section

MODES = ("limit", "reject", "open", "shape")
# The limiter sees a shape rule as a limit; the relay shapes what it refuses (rmqfast.limits.shaper).
MODE_CODES = {"limit": 0, "reject": 1, "open": 2, "shape": 0}
MODE_REJECT_CODE = MODE_CODES["reject"]
MAX_RULES = 1023
_TOPIC_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_%|")


@dataclass
class LimitRule:
    topic: str
    tag: str | None = None
    rate: float = 0.0  # messages per second (0: no message limit)
    burst: float = 0.0  # messages; 0: rate / 10, at least 1
    bytes_rate: float = 0.0  # bytes per second (0: no byte limit)
    bytes_burst: float = 0.0  # bytes; 0: bytes_rate / 10, at least 64 KiB
    mode: str = "limit"
    #: shared bucket slot (1..MAX_RULES), kept while the rule's topic and tag stay; 0: not yet given
    slot: int = 0

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.topic, self.tag)

    def covers_topic(self, topic: str) -> bool:
        """Whether this rule's topic pattern names ``topic`` (the tag aside)."""
        if self.topic.endswith("*"):
            return topic.startswith(self.topic[:-1])
        return topic == self.topic

    def effective_burst(self) -> float:
        return self.burst or max(1.0, self.rate / 10)

    def effective_bytes_burst(self) -> float:
        return self.bytes_burst or max(65536.0, self.bytes_rate / 10)

    def describe(self) -> str:
        what = f"topic {self.topic}" + (f" tag {self.tag}" if self.tag is not None else "")
        if self.topic == "":
            what = "the proxy's global send limit"
        if self.mode == "reject":
            return f"{what} is switched to reject"
        parts = []
        if self.rate:
            parts.append(f"{self.rate:g} msg/s (burst {self.effective_burst():g})")
        if self.bytes_rate:
            parts.append(f"{self.bytes_rate:g} B/s (burst {self.effective_bytes_burst():g})")
        return f"{what} is over its limit of {' and '.join(parts)}"


@section("limits", "Send limits and peak shaving (docs/limits.md).", parse=lambda raw: parse_limits(raw))
@dataclass
class LimitsSection:
    global_rate: float = 0.0
    global_burst: float = 0.0
    global_bytes_rate: float = 0.0
    global_bytes_burst: float = 0.0
    rules: list[LimitRule] = field(default_factory=list)

    def global_rule(self) -> LimitRule | None:
        if not self.global_rate and not self.global_bytes_rate:
            return None
        return LimitRule("", None, self.global_rate, self.global_burst, self.global_bytes_rate,
                         self.global_bytes_burst)

    def all_rules(self) -> list[LimitRule]:
        """The rules in slot order minus one: configured rules, then the global one (if any)."""
        g = self.global_rule()
        return [*self.rules, *([g] if g else [])]

    def inherit_slots(self, previous: LimitsSection) -> None:
        """Give this (new) configuration's rules the slots ``previous`` gave the same topic+tag;
        new rules get free slots (see the module docstring)."""
        assign_slots(self.rules, previous.rules)

    def limiter_rules(self) -> list[tuple[bytes, bytes | None, float, float, float, float, int, int]]:
        """The tuples ``Limiter.configure`` takes (the global limit in slot 0)."""
        if any(r.slot == 0 for r in self.rules):
            assign_slots(self.rules, [])  # a section built in code: fill in the missing slots
        check_slots(self.rules)
        out = []
        for r in self.rules:
            out.append((r.topic.encode(), None if r.tag is None else r.tag.encode(), r.rate, r.effective_burst(),
                        r.bytes_rate, r.effective_bytes_burst(), MODE_CODES[r.mode], r.slot))
        g = self.global_rule()
        if g is not None:
            out.append((b"", None, g.rate, g.effective_burst(), g.bytes_rate, g.effective_bytes_burst(), 0, 0))
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LimitsSection:
        d = dict(d)
        d["rules"] = [LimitRule(**r) for r in d.get("rules", [])]
        return cls(**d)


def check_slots(rules: list[LimitRule]) -> None:
    """Every rule has its own slot in 1..MAX_RULES (a shared bucket is never two rules')."""
    seen: dict[int, LimitRule] = {}
    for r in rules:
        if not 1 <= r.slot <= MAX_RULES:
            raise ConfigError(f"limit rule topic {r.topic!r} tag {r.tag!r}: bucket slot {r.slot} "
                              f"outside 1..{MAX_RULES}")
        other = seen.setdefault(r.slot, r)
        if other is not r:
            raise ConfigError(f"limit rules topic {other.topic!r} tag {other.tag!r} and topic {r.topic!r} tag "
                              f"{r.tag!r} share bucket slot {r.slot}; each rule needs its own")


def assign_slots(rules: list[LimitRule], previous: list[LimitRule]) -> None:
    """Set ``slot`` of every rule in ``rules``: the slot of the same topic+tag in ``previous``,
    else its own slot if it has one no other rule keeps and no rule of ``previous`` held, else
    a free slot, the first above every slot in use (wrapping around), one no rule of
    ``previous`` held if there is one.  Rules are updated in place."""
    before = {r.key: r.slot for r in previous if r.slot}
    held_before = set(before.values())
    taken: set[int] = set()
    pending: list[LimitRule] = []
    for r in rules:
        s = before.get(r.key, 0)
        if s and s not in taken:
            r.slot = s
            taken.add(s)
        else:
            pending.append(r)
    # a rule that already carries a slot (e.g. from config.json) keeps it unless another rule
    # above kept it; the rest take free slots
    for r in list(pending):
        if r.key not in before and 1 <= r.slot <= MAX_RULES and r.slot not in taken and r.slot not in held_before:
            taken.add(r.slot)
            pending.remove(r)
    if not pending:
        return
    # slots above every slot in use first (round-robin-like: a slot freed by a recent change is
    # reused last, while a worker that has not reloaded may still charge it), then the rest
    hi = max(held_before | taken | {0})
    order = [*range(hi + 1, MAX_RULES + 1), *range(1, hi + 1)]
    fresh = (s for s in order if s not in taken and s not in held_before)
    reuse = (s for s in order if s not in taken and s in held_before)
    for r in pending:
        s = next(fresh, 0) or next(reuse, 0)
        if not s:
            raise ConfigError(f"limits.rule: more than {MAX_RULES} rules")
        r.slot = s
        taken.add(s)


def _num(key: str, value: Any, lo: float = 0.0, hi: float = 1e12) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ConfigError(f"{key}: {value!r} is not allowed; expected a number from {lo:g} to {hi:g}")
    return float(value) + 0.0  # (-0.0 reads as 0)


# The limiter keeps time in int64 nanoseconds (a bucket's next free time, a message's cost): a
# rate so small, or a burst so large against its rate, that those overflow would make it admit
# everything.  Far beyond any real limit, so refused with the reason.
MIN_RATE = 0.001  # messages per second (one per 1,000 s)
MIN_BYTES_RATE = 1.0  # bytes per second
MAX_BURST_SECONDS = 1e6  # burst / rate: how long the burst would last at the rate (11.6 days)


def _check_pair(key: str, rate_key: str, burst_key: str, rate: float, burst: float, lowest: float) -> None:
    """A (rate, burst) pair the limiter can hold; ``rate`` 0 is no limit (and any burst is unused)."""
    if not rate:
        return
    if rate < lowest:
        raise ConfigError(f"{key}.{rate_key}: {rate:g} is not allowed; expected 0 (no limit) or at least {lowest:g}")
    if burst / rate > MAX_BURST_SECONDS:
        raise ConfigError(f"{key}.{burst_key}: {burst:g} is not allowed with {rate_key} {rate:g}; "
                          f"{burst_key} / {rate_key} must be at most {MAX_BURST_SECONDS:g} seconds")


def parse_rule(key: str, raw: Any) -> LimitRule:
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: {raw!r} is not allowed; expected a table")
    unknown = set(raw) - {"topic", "tag", "rate", "burst", "bytes_rate", "bytes_burst", "mode"}
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {', '.join(sorted(unknown))}; "
                          "allowed: topic, tag, rate, burst, bytes_rate, bytes_burst, mode")
    topic = raw.get("topic")
    body = topic[:-1] if isinstance(topic, str) and topic.endswith("*") else topic
    if not isinstance(topic, str) or not topic or not set(body) <= _TOPIC_CHARS or len(topic) > 255:
        raise ConfigError(f"{key}.topic: {topic!r} is not allowed; expected a topic name, a prefix ending in '*' "
                          "or '*' (letters, digits, - _ % |; at most 255)")
    tag = raw.get("tag")
    if tag is not None and (not isinstance(tag, str) or not tag or not _utf8(tag) or len(tag.encode()) > 255
                            or "|" in tag):
        raise ConfigError(f"{key}.tag: {tag!r} is not allowed; expected one tag (no '||'), at most 255 bytes of "
                          "Unicode text")
    mode = raw.get("mode", "limit")
    if mode not in MODES:
        raise ConfigError(f"{key}.mode: {mode!r} is not allowed; expected one of {', '.join(MODES)}")
    rule = LimitRule(
        topic=topic, tag=tag,
        rate=_num(f"{key}.rate", raw.get("rate", 0)), burst=_num(f"{key}.burst", raw.get("burst", 0)),
        bytes_rate=_num(f"{key}.bytes_rate", raw.get("bytes_rate", 0)),
        bytes_burst=_num(f"{key}.bytes_burst", raw.get("bytes_burst", 0)), mode=mode,
    )
    if mode in ("limit", "shape") and not rule.rate and not rule.bytes_rate:
        raise ConfigError(f"{key}: mode {mode!r} needs rate and/or bytes_rate above 0 "
                          "(or mode = 'reject' / 'open')")
    _check_pair(key, "rate", "burst", rule.rate, rule.effective_burst(), MIN_RATE)
    _check_pair(key, "bytes_rate", "bytes_burst", rule.bytes_rate, rule.effective_bytes_burst(), MIN_BYTES_RATE)
    return rule


def _utf8(text: str) -> bool:
    """Encodable as UTF-8 (a JSON body can carry a lone surrogate such as \\ud800)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def parse_limits(raw: Any) -> LimitsSection:
    """Validate ``[limits]`` (a TOML table) into a :class:`LimitsSection`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"limits: {raw!r} is not allowed; expected a table")
    known = {"global_rate", "global_burst", "global_bytes_rate", "global_bytes_burst", "rule"}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"limits: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(known))}")
    sec = LimitsSection(**{k: _num(f"limits.{k}", raw[k]) for k in known - {"rule"} if k in raw})
    g = sec.global_rule()
    if g is not None:
        _check_pair("limits", "global_rate", "global_burst", g.rate, g.effective_burst(), MIN_RATE)
        _check_pair("limits", "global_bytes_rate", "global_bytes_burst", g.bytes_rate, g.effective_bytes_burst(),
                    MIN_BYTES_RATE)
    rules = raw.get("rule", [])
    if not isinstance(rules, list):
        raise ConfigError(f"limits.rule: {rules!r} is not allowed; expected an array of tables ([[limits.rule]])")
    seen: dict[tuple[str, str | None], int] = {}
    for i, r in enumerate(rules):
        rule = parse_rule(f"limits.rule[{i}]", r)
        if rule.key in seen:
            raise ConfigError(f"limits.rule[{i}]: topic {rule.topic!r} tag {rule.tag!r} is already limited by "
                              f"limits.rule[{seen[rule.key]}]; merge the two")
        seen[rule.key] = i
        rule.slot = i + 1  # a fresh configuration numbers its rules in order
        sec.rules.append(rule)
    if len(sec.rules) > MAX_RULES:
        raise ConfigError(f"limits.rule: {len(sec.rules)} rules; at most {MAX_RULES}")
    return sec


def upsert(sec: LimitsSection, rule: LimitRule) -> LimitsSection:
    """A copy of ``sec`` with ``rule`` replacing the rule of the same topic and tag (or added)."""
    rules = [r for r in sec.rules if r.key != rule.key]
    if len(rules) >= MAX_RULES:
        raise ConfigError(f"limits.rule: at most {MAX_RULES} rules")
    rule = replace(rule, slot=0)
    out = LimitsSection(sec.global_rate, sec.global_burst, sec.global_bytes_rate, sec.global_bytes_burst,
                        [*rules, rule])
    assign_slots(out.rules, sec.rules)  # the replaced rule keeps its slot, a new one gets a free one
    return out


def remove(sec: LimitsSection, topic: str, tag: str | None) -> LimitsSection:
    rules = [r for r in sec.rules if r.key != (topic, tag)]
    if len(rules) == len(sec.rules):
        raise ConfigError(f"no limit rule for topic {topic!r} tag {tag!r}")
    return LimitsSection(sec.global_rate, sec.global_burst, sec.global_bytes_rate, sec.global_bytes_burst, rules)

"""Pure-Python twin of the compiled ``Limiter`` (ext/limiter.pxi): same GCRA, same rules.

The compiled limiter updates the shared buckets with a 64-bit compare-and-swap; Python has no
atomic operations on shared memory, so this twin does each read-modify-write under an
``flock`` of the shared file (``lock_fd``) when several processes share it.  Read the
compiled limiter's section comment for the theory.  The two must never share buckets (a CAS
does not wait for an flock): the shared file's header names the twin it was made for and each
limiter refuses the other's (:func:`rmqfast._args.check_shared_header`).  Both twins validate
``configure`` and ``admit`` arguments alike (:mod:`rmqfast._args`).
"""

from __future__ import annotations

import fcntl
import struct
import time
from typing import Any

from rmqfast._args import SHM_HEADER_BYTES, c_int, check_shared_header, limit_rules
from rmqfast.codec._header_py import props_tag
from rmqfast.codec.tables import (  # noqa: F401 - re-exported beside the twin that uses them
    MAX_COST_NS,
    MAX_RULES,
    MODE_LIMIT,
    MODE_OPEN,
    MODE_REJECT,
    SHM_BYTES,
    SLOT_BYTES,
    SLOT_WORDS,
)

IMPLEMENTATION = "python"
_Q = struct.Struct("<q")  # native little-endian int64, as the C side sees it on x86-64 / arm64


class Limiter:
    def __init__(self, shm: Any, lock_fd: int | None = None) -> None:
        if memoryview(shm).readonly:
            raise BufferError("Object is not writable.")  # what the compiled twin's buffer request says
        check_shared_header(shm, IMPLEMENTATION, SHM_BYTES)
        self._shm = shm
        self._lock_fd = lock_fd
        self.rules: list[dict[str, Any]] = []
        self.global_rule = -1
        self.active = False
        self.admitted: list[int] = []
        self.rejected: list[int] = []
        self._cache: dict[bytes, tuple[int, bool]] = {}

    @property
    def nrules(self) -> int:
        return len(self.rules)

    def configure(self, rules: list[tuple[Any, ...]]) -> None:
        checked = limit_rules(rules)  # the same checks (and errors) as the compiled twin, before any change
        out = []
        self.global_rule = -1
        for i, (topic, tag, rate, burst, brate, bburst, mode, slot) in enumerate(checked):
            prefix = topic.endswith(b"*")
            if prefix:
                topic = topic[:-1]
            interval = 1e9 / rate if rate > 0 else 0.0
            binterval = 1e9 / brate if brate > 0 else 0.0
            out.append({"topic": topic, "prefix": prefix, "tag": tag,
                        "interval": interval, "tolerance": burst * interval, "binterval": binterval,
                        "btolerance": bburst * binterval, "mode": mode, "slot": slot})
            if not topic and not prefix and tag is None:
                self.global_rule = i
        self.rules = out
        self.admitted = [0] * len(out)
        self.rejected = [0] * len(out)
        self.active = bool(out)
        self._cache = {}

    def counters(self) -> list[tuple[int, int, int]]:
        return [(i, self.admitted[i], self.rejected[i]) for i in range(len(self.rules))]

    def _topic_rule(self, t: bytes) -> tuple[int, bool]:
        best, best_len, has_tags = -1, -1, False
        for i, r in enumerate(self.rules):
            if i == self.global_rule:
                continue
            if r["prefix"]:
                if not t.startswith(r["topic"]):
                    continue
            elif r["topic"] != t:
                continue
            if r["tag"] is not None:
                has_tags = True
                continue
            if not r["prefix"]:
                best, best_len = i, 1 << 20
            elif len(r["topic"]) > best_len:
                best, best_len = i, len(r["topic"])
        return best, has_tags

    def _lookup(self, t: bytes) -> tuple[int, bool]:
        t = t[:255]
        hit = self._cache.get(t)
        if hit is None:
            hit = self._cache[t] = self._topic_rule(t)
        return hit

    def applies(self, topic: bytes) -> bool:
        if self.global_rule >= 0:
            return True
        rule, has_tags = self._lookup(topic)
        return rule >= 0 or has_tags

    def _gcra(self, off: int, now: int, interval: float, tolerance: float, n: int) -> int | None:
        """The cost charged, or None when the send does not conform."""
        if interval * n >= MAX_COST_NS:  # 146 years of the rate; past it int64 overflows (the C twin's rule)
            return None
        cost = int(interval * n + 0.5)
        tol = int(tolerance)
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            (tat,) = _Q.unpack_from(self._shm, off)
            base = tat if tat > now else now
            if base - now > tol - min(cost, tol):
                return None
            _Q.pack_into(self._shm, off, base + cost)
            return cost
        finally:
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _refund(self, off: int, cost: int) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            (tat,) = _Q.unpack_from(self._shm, off)
            _Q.pack_into(self._shm, off, tat - cost)
        finally:
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _tag_rule(self, t: bytes, tag: bytes | None) -> int:
        """The rule of topic ``t`` with tag ``tag`` (the first that matches), or -1."""
        if tag is None:
            return -1
        for i, r in enumerate(self.rules):
            if r["tag"] == tag and i != self.global_rule and (
                t.startswith(r["topic"]) if r["prefix"] else t == r["topic"]
            ):
                return i
        return -1

    def decide(self, t: bytes, props: bytes | None, esc: bool, msgs: int, nbytes: int, now: int) -> int:
        """-1: admitted; else the index of the rule that rejected the send."""
        topic_rule, has_tags = self._lookup(t)
        chain = []
        if has_tags and props is not None:
            tag_rule = self._tag_rule(t, props_tag(props, esc))
            if tag_rule >= 0:
                chain.append(tag_rule)
        if topic_rule >= 0:
            chain.append(topic_rule)
        if self.global_rule >= 0:
            chain.append(self.global_rule)
        charged: list[tuple[int, int]] = []
        for ri in chain:
            r = self.rules[ri]
            if r["mode"] == MODE_OPEN:
                continue
            base = SHM_HEADER_BYTES + r["slot"] * SLOT_BYTES
            ok = r["mode"] != MODE_REJECT
            if ok and r["interval"] > 0:
                c = self._gcra(base, now, r["interval"], r["tolerance"], msgs)
                ok = c is not None
                if ok:
                    charged.append((base, c))  # type: ignore[arg-type]
            if ok and r["binterval"] > 0:
                c = self._gcra(base + 8, now, r["binterval"], r["btolerance"], nbytes)
                ok = c is not None
                if ok:
                    charged.append((base + 8, c))  # type: ignore[arg-type]
            if not ok:
                for off, cost in charged:
                    if cost:
                        self._refund(off, cost)
                self.rejected[ri] += msgs
                return ri
        for ri in chain:
            self.admitted[ri] += msgs
        return -1

    def admit(self, topic: bytes, tag: bytes | None = None, msgs: int = 1, nbytes: int = 0, now_ns: int = -1) -> int:
        """One decision from Python (tests, benchmarks): -1 admitted, else the rejecting rule."""
        # the compiled twin's int64_t arguments: the same conversions and errors
        msgs, nbytes, now_ns = c_int("msgs", msgs), c_int("nbytes", nbytes), c_int("now_ns", now_ns)
        t = bytes(topic)
        props = b"TAGS\x01" + bytes(tag) + b"\x02" if tag is not None else b""
        return self.decide(t, props, False, msgs, nbytes, time.monotonic_ns() if now_ns < 0 else now_ns)

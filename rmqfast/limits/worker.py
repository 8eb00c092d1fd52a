"""A worker's side of the send limits: limiter instances over the shared buckets, and metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rmqfast import codec
from rmqfast.filters.api import Frame, Verdict, busy_answer, close, reply
from rmqfast.limits import open_limiter
from rmqfast.limits.rules import MODE_REJECT_CODE, LimitsSection


class WorkerLimits:
    """The limiter(s) of one worker process, reconfigured on reload.

    Sessions built with the compiled scanner need the compiled limiter; the pure-Python scanner
    takes the twin.  Only the twin the shared file was created for can attach (the other one
    raises :class:`rmqfast.errors.TwinMismatchError`): a worker runs the supervisor's twin.

    ``shape`` rules: while this worker holds a shaped backlog for a topic a shape rule covers,
    that rule is *held*: the scanners' limiters see it in ``reject`` mode, so every later send it
    covers is handed to the relay (and shaped behind the backlog, which keeps the order) instead
    of being admitted past it.  A held rule charges no tokens; the releaser takes them with a
    limiter of its own that never holds (:meth:`release_limiter`).
    """

    def __init__(self, shm_path: Path, section: LimitsSection) -> None:
        self.shm_path = shm_path
        self.section = section
        self._limiters: dict[bool, Any] = {}
        self._rules = section.all_rules()
        self.held: frozenset[tuple[str, str | None]] = frozenset()  # keys of held shape rules
        self._carry: dict[int, list[int]] = {}  # counts of limiters reconfigured by a hold change
        self._release: Any = None
        #: the worker's :class:`rmqfast.limits.shaper.Shaper` (None: no shaping in this worker)
        self.shaper: Any = None

    def _scanner_rules(self) -> list[tuple[Any, ...]]:
        rules = self.section.limiter_rules()
        if not self.held:
            return rules
        out = []
        for i, t in enumerate(rules):
            r = self.section.rules[i] if i < len(self.section.rules) else None
            if r is not None and r.mode == "shape" and r.key in self.held:
                t = (*t[:6], MODE_REJECT_CODE, t[7])
            out.append(t)
        return out

    def limiter_for(self, compiled: bool | None = None) -> Any:
        """The scanners' limiter of a twin (None: the twin this process runs, rmqfast.codec)."""
        if compiled is None:
            compiled = codec.IMPLEMENTATION == "compiled"
        lim = self._limiters.get(compiled)
        if lim is None:
            lim = open_limiter(self.shm_path, compiled)
            lim.configure(self._scanner_rules())
            self._limiters[compiled] = lim
        return lim

    def release_limiter(self) -> Any:
        """The releaser's limiter: the same shared buckets and rules, never held."""
        if self._release is None:
            self._release = open_limiter(self.shm_path)  # the twin the shared file was made for
            self._release.configure(self.section.limiter_rules())
        return self._release

    def configure(self, section: LimitsSection) -> None:
        self.section = section
        self._rules = section.all_rules()
        self._carry.clear()
        shaping = {r.key for r in section.rules if r.mode == "shape"}
        self.held = frozenset(k for k in self.held if k in shaping)
        for lim in self._limiters.values():
            lim.configure(self._scanner_rules())
        if self._release is not None:
            self._release.configure(section.limiter_rules())

    def set_held(self, keys: set[tuple[str, str | None]] | frozenset[tuple[str, str | None]]) -> bool:
        """Hold exactly these shape rules (by key); True when that changed the limiters."""
        keys = frozenset(keys)
        if keys == self.held:
            return False
        # the limiters' counts restart on configure: carry them so the published totals only grow
        for lim in self._limiters.values():
            for i, adm, rej in lim.counters():
                acc = self._carry.setdefault(i, [0, 0])
                acc[0] += adm
                acc[1] += rej
        self.held = keys
        for lim in self._limiters.values():
            lim.configure(self._scanner_rules())
        return True

    def is_shape(self, index: int) -> bool:
        return 0 <= index < len(self._rules) and self._rules[index].mode == "shape"

    def rule(self, index: int) -> Any:
        return self._rules[index] if 0 <= index < len(self._rules) else None

    def rule_description(self, index: int) -> str:
        if 0 <= index < len(self._rules):
            return self._rules[index].describe()
        return "a send limit"

    def answer(self, frame: Frame, index: int, upstream_addr: str, cmd: Any = None) -> Verdict:
        """The verdict on a send that rule ``index`` refused: shaped into the spill for a ``shape``
        rule, else SYSTEM_BUSY (the relay's filter and a send moved off a dead broker alike).
        ``cmd``: the send already decoded, else it is decoded from ``frame``."""
        if self.is_shape(index):
            from rmqfast.limits.shaper import shape_send  # the spill's modules load only when shaping

            return shape_send(self, frame, index, upstream_addr)
        if cmd is None:
            try:
                cmd = frame.command()
            except ValueError as exc:  # the scanner read its header strictly; decoding it should not fail
                return close(f"undecodable send over a limit: {exc}")
        return reply(busy_answer(cmd, f"rmqfast: {self.rule_description(index)}; retry later"))

    def counters(self) -> list[tuple[str, str, int, int]]:
        """``(topic, tag, admitted, rejected)`` per rule, summed over this worker's limiters.

        A shape rule's refusals are not rejections (the shaper counts what it shaped and what
        it had to answer SYSTEM_BUSY): its ``rejected`` is 0 here.
        """
        out: dict[int, list[int]] = {i: list(v) for i, v in self._carry.items()}
        for lim in self._limiters.values():
            for i, adm, rej in lim.counters():
                acc = out.setdefault(i, [0, 0])
                acc[0] += adm
                acc[1] += rej
        rows = []
        for i, (adm, rej) in sorted(out.items()):
            if i < len(self._rules):
                r = self._rules[i]
                rows.append((r.topic or "(global)", r.tag or "", adm, 0 if r.mode == "shape" else rej))
        return rows


class LimitsPublisher:
    """Adds the limiters' per-rule counts to Prometheus once a second (and before a reconfigure)."""

    def __init__(self, metrics: Any, limits: WorkerLimits) -> None:
        self.m = metrics
        self.limits = limits
        self._last: dict[tuple[str, str], tuple[int, int]] = {}

    def publish(self) -> None:
        for topic, tag, adm, rej in self.limits.counters():
            a0, r0 = self._last.get((topic, tag), (0, 0))
            if adm < a0 or rej < r0:  # the limiter was reconfigured: its counts restarted
                a0, r0 = 0, 0
            if adm != a0:
                self.m.limit_admitted.labels(topic, tag).inc(adm - a0)
            if rej != r0:
                self.m.limit_rejected.labels(topic, tag).inc(rej - r0)
            self._last[(topic, tag)] = (adm, rej)

    def reconfigure(self, section: LimitsSection) -> None:
        self.publish()
        self.limits.configure(section)
        self._last.clear()
        for r in section.all_rules():
            self.m.limit_rate.labels(r.topic or "(global)", r.tag or "", "messages").set(r.rate)
            self.m.limit_rate.labels(r.topic or "(global)", r.tag or "", "bytes").set(r.bytes_rate)

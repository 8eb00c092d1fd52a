"""A worker's side of the send limits: limiter instances over the shared buckets, and metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rmqfast.limits import open_limiter
from rmqfast.limits.rules import LimitsSection


class WorkerLimits:
    """The limiter(s) of one worker process, reconfigured on reload.

    Sessions built with the compiled scanner need the compiled limiter; the pure-Python scanner
    takes the twin.  Normally one of the two exists; tests may use both.
    """

    def __init__(self, shm_path: Path, section: LimitsSection) -> None:
        self.shm_path = shm_path
        self.section = section
        self._limiters: dict[bool, Any] = {}
        self._rules = section.all_rules()

    def limiter_for(self, compiled: bool) -> Any:
        lim = self._limiters.get(compiled)
        if lim is None:
            lim = open_limiter(self.shm_path, compiled)
            lim.configure(self.section.limiter_rules())
            self._limiters[compiled] = lim
        return lim

    def configure(self, section: LimitsSection) -> None:
        self.section = section
        self._rules = section.all_rules()
        for lim in self._limiters.values():
            lim.configure(section.limiter_rules())

    def rule_description(self, index: int) -> str:
        if 0 <= index < len(self._rules):
            return self._rules[index].describe()
        return "a send limit"

    def counters(self) -> list[tuple[str, str, int, int]]:
        """``(topic, tag, admitted, rejected)`` per rule, summed over this worker's limiters."""
        out: dict[int, list[int]] = {}
        for lim in self._limiters.values():
            for i, adm, rej in lim.counters():
                acc = out.setdefault(i, [0, 0])
                acc[0] += adm
                acc[1] += rej
        rows = []
        for i, (adm, rej) in sorted(out.items()):
            if i < len(self._rules):
                r = self._rules[i]
                rows.append((r.topic or "(global)", r.tag or "", adm, rej))
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

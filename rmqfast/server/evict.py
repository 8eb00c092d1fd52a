"""Making room at the worker's connection cap: a newcomer evicts an idle connection.

At ``proxy.max_connections`` a worker used to refuse every new connection; idle connections from
many addresses, each under its per-address cap, then locked every newcomer out (the hostile
benchmark of issue 30: both Remoting listeners answered nobody new for 7.9 s).  Like HAProxy,
Envoy and nginx under overload, a new connection now takes the place of an idle one:

* only a connection with **no request in flight** (its in-flight table empty) that has received
  **no bytes on either side for at least** :data:`MIN_IDLE` seconds may be evicted; a connection
  with a request in flight is never evicted;
* among those, the ones from the address that holds the **most connections** go first, and
  within an address the one **idle the longest**.

Candidates are ranked in one pass over the sessions and kept for :data:`RANK_TTL` seconds (or until
used up), each checked again just before it is closed: a flood of newcomers costs one ranking per
:data:`RANK_TTL`, not one pass over every session per accept.  Last activity is the relay's own
bookkeeping (``Session.idle_for``: the compiled pumps stamp each receive), nothing per frame.
When no connection may be evicted the newcomer is refused as before, and the worker reports that it
cannot admit (``/readyz`` false, with the reason) until a connection ends or becomes evictable.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from rmqfast.server.accept import client_key

#: seconds without a byte received before a connection may be evicted (a newcomer that was just
#: admitted and has not spoken yet is never the next newcomer's victim)
MIN_IDLE = 0.5
#: seconds a ranking of candidates is used before the sessions are ranked again
RANK_TTL = 0.25
#: candidates kept from one ranking
RANK_KEEP = 512


def evictable(session: Any, now: float) -> bool:
    """May ``session`` be evicted now: open, no request in flight, idle for at least MIN_IDLE?"""
    if session.closed:
        return False
    inflight = session.inflight
    if inflight is not None and len(inflight) > 0:
        return False
    return bool(session.idle_for(now) >= MIN_IDLE)


class Evictor:
    """Picks the connection a newcomer replaces (see the module's text), closes it, counts it, and
    tells the worker whether it can admit (``on_state(why)``; ``""`` once it can again)."""

    def __init__(self, sessions: Iterable[Any], caps: Any, metrics: Any, rate_log: Any,
                 on_state: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.sessions = sessions
        self.caps = caps  # rmqfast.server.accept.ConnectionCaps
        self.metrics = metrics  # rmqfast.server.accept.ListenMetrics (or None)
        self.rate_log = rate_log
        self.on_state = on_state
        self.clock = clock
        self._ranked: list[Any] = []
        self._ranked_at = float("-inf")
        self.evicted = 0
        self.blocked = ""

    def make_room(self) -> bool:
        """The worker is at its cap and a newcomer waits: close an idle connection for it (True),
        or report that the worker cannot admit (False: the newcomer is refused)."""
        victim = self.pick()
        if victim is None:
            self._state(f"worker connection cap reached ({self.caps.open} of proxy.max_connections = "
                        f"{self.caps.total}) and every connection has a request in flight or was "
                        f"active within {MIN_IDLE} s: new connections are refused")
            return False
        idle = victim.idle_for(self.clock())
        try:
            victim.close()  # called from the listener's accept: nothing here may raise into gevent
        except Exception as exc:
            self.rate_log(logging.ERROR, "evict failed", "could not evict an idle connection; refusing the newcomer",
                          role=victim.role, client=victim.client_addr, error=repr(exc))
            return False
        self.evicted += 1
        if self.metrics is not None:
            self.metrics.evicted.labels(victim.role).inc()
        self.rate_log(logging.WARNING, "evict", "idle connection evicted: worker connection cap reached",
                      role=victim.role, client=victim.client_addr, idle_s=round(idle, 1),
                      held_by_address=self.by_client(victim), limit=self.caps.total,
                      setting="proxy.max_connections",
                      what_to_do="raise proxy.max_connections (and the open-files limit), or lower "
                                 "proxy.max_connections_per_client")
        self._state("")
        return True

    def check(self) -> None:
        """Periodically (and when a connection ends): can a blocked worker admit again?"""
        if not self.blocked:
            if self._ranked and self.clock() - self._ranked_at > RANK_TTL:
                self.forget()  # the ranking holds sessions; let ended ones go
            return
        if not self.caps.full():
            self._state("")
            return
        now = self.clock()
        if now - self._ranked_at >= RANK_TTL:
            self._rank(now)
        if any(evictable(s, now) for s in self._ranked):
            self._state("")

    def by_client(self, session: Any) -> int:
        """Connections the session's client address holds."""
        return int(self.caps.by_client.get(client_key(session.client_addr.rpartition(":")[0]), 0))

    def pick(self) -> Any | None:
        """The session to close for a newcomer, or None when none may be evicted."""
        now = self.clock()
        while True:
            while self._ranked:
                s = self._ranked.pop()
                if evictable(s, now):
                    return s
            if now - self._ranked_at < RANK_TTL:
                return None  # ranked moments ago and nothing is left: do not rank on every accept
            self._rank(now)
            if not self._ranked:
                return None

    def _rank(self, now: float) -> None:
        self._ranked_at = now
        rows = []
        for i, s in enumerate(list(self.sessions)):
            if evictable(s, now):
                rows.append((self.by_client(s), s.idle_for(now), i, s))
        best = heapq.nlargest(RANK_KEEP, rows, key=lambda r: (r[0], r[1]))
        best.reverse()  # popped from the end: the best candidate last
        self._ranked = [r[3] for r in best]

    def _state(self, why: str) -> None:
        if why != self.blocked:
            self.blocked = why
            self.on_state(why)

    def forget(self) -> None:
        """Drop the ranking: it holds references to sessions."""
        self._ranked = []
        self._ranked_at = float("-inf")

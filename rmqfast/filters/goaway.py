"""GO_AWAY (1500) while a worker drains: clients reconnect instead of seeing a reset.

apache/rocketmq 5.3.2+ (``NettyRemotingAbstract.processRequestCommand``) answers every request
with ``ResponseCode.GO_AWAY`` while it shuts down, but only to clients whose request version is
above ``MQVersion.Version.V5_3_1`` (ordinal 475): those clients
(``NettyRemotingClient.invokeImpl``, ``enableReconnectForGoAway`` true by default) open a new
connection to the same address and send the same request again on it, once; sync, async and
oneway-less requests alike, to brokers and name servers.  Older clients (4.9.x, 5.0-5.3.1) would
see 1500 as an error (the 4.9.4 producer does not retry it), so their requests are relayed and
their connection is closed once nothing is in flight, as before.

A draining worker has closed its listeners, so the reconnect reaches another worker of the same
SO_REUSEPORT group (a planned restart) or, when the whole proxy stops, nothing (the client's
ordinary retry then applies).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from rmqfast.codec import CODE_SLOTS
from rmqfast.codec import codes as C
from rmqfast.filters.api import Filter, FilterChain, Frame, Session, Verdict, error_response, reply

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost

#: ``MQVersion.Version.V5_3_1.ordinal()``: clients above it reconnect on GO_AWAY.
V5_3_1 = 475
REMARK = "rmqfast: this proxy worker is restarting; reconnect and send again"


class GoAway(Filter):
    """Answer every two-way request of a GO_AWAY-aware client with GO_AWAY (drain only)."""

    name = "go-away"

    def __init__(self, on_go_away: Callable[[Session, int], None] | None = None) -> None:
        self.on_go_away = on_go_away

    def request_slots(self) -> set[int]:
        return set(range(CODE_SLOTS))

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        if frame.is_oneway:
            return None
        capable = frame.command().version > V5_3_1
        session.state["go_away_capable"] = capable
        if not capable:
            return None
        session.state["go_away"] = session.state.get("go_away", 0) + 1
        if self.on_go_away is not None:
            self.on_go_away(session, frame.code)
        return reply(error_response(frame, C.GO_AWAY, REMARK))


#: A draining session whose client has not shown its version yet stays open this long without
#: requests (its next request would get GO_AWAY) before it is closed.
QUIET = 0.5


def may_close(session: Session, idle: float) -> bool:
    """Whether a draining session with nothing in flight may be closed now.

    Closed at once: a client that got GO_AWAY (it reconnects), or one whose requests show it
    does not understand GO_AWAY (nothing better to do).  A client not heard from since the drain
    began is closed after :data:`QUIET` seconds without requests: closing while it writes a
    request is the race GO_AWAY avoids (4.9.4 would wait for that request's timeout).
    """
    st = session.state
    return bool(st.get("go_away")) or st.get("go_away_capable") is False or idle > QUIET


def draining(chain: FilterChain, go_away: GoAway) -> FilterChain:
    """``chain`` with :class:`GoAway` first: every request reaches Python while the worker drains."""
    return FilterChain([go_away, *chain.filters])


def go_away_from_now_on(sessions: Iterable[Any], go_away: GoAway) -> None:
    """Every open session's chain with ``go_away`` first (a draining worker).  Sessions share their
    role's chain: one draining chain is made per chain, not per session (a chain per session kept
    the event loop for seconds with 10,000 connections)."""
    made: dict[int, tuple[FilterChain, FilterChain]] = {}  # id(chain) -> (chain, its draining chain)
    for s in list(sessions):
        if s.closed:
            continue
        pair = made.get(id(s.chain))
        if pair is None:
            pair = made[id(s.chain)] = (s.chain, draining(s.chain, go_away))
        s.chain = pair[1]
        if s.c2u is not None:
            s.c2u.set_actions(s.chain.request_actions)


def build(host: ChainHost, role: str) -> Filter:
    """GO_AWAY counted per role in the health metrics (:data:`rmqfast.filters.registry.DRAINING`)."""
    return GoAway(lambda s, code: host.health_metrics.go_away.labels(s.role).inc())

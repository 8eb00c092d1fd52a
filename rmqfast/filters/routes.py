"""Route answers point at the proxy: the filter that rewrites broker addresses in routes.

Name-server answers to ``GET_ROUTEINFO_BY_TOPIC`` (105) and ``GET_BROKER_CLUSTER_INFO`` (106)
carry the real brokers' addresses; this filter byte-patches each one to the proxy endpoint that
serves it (:mod:`rmqfast.proxy.endpoints`), heals the routes of a dead master
(:mod:`rmqfast.proxy.health`) and teaches the route book that moves sends off it
(:mod:`rmqfast.proxy.failover`). The filter API it implements is :mod:`rmqfast.filters.api`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rmqfast.codec import codes as C
from rmqfast.codec.route import PERM_WRITE, BrokerAddr, parse_route, rewrite_broker_addrs
from rmqfast.filters.api import Filter, Frame, Session, Verdict, close, rewrite, slots_of
from rmqfast.log import ctx

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost
    from rmqfast.proxy.endpoints import EndpointRegistry
    from rmqfast.proxy.failover import RouteBook
    from rmqfast.proxy.health import BrokerHealth

log = logging.getLogger("rmqfast.policy")


class RewriteRoutes(Filter):
    """Point every broker address in route answers (105, 106) at this proxy's endpoints.

    The request is relayed unchanged; its opaque is remembered so the matching response
    can be rewritten, byte-patching only the addresses so the JSON dialect (legacy unquoted
    integer keys or standard JSON) and everything else stay exactly as the name server sent.

    With ``health`` (route healing), the queues of a master this worker sees dead lose
    ``PERM_WRITE`` in topic routes (105), while another master of the route is alive:
    producers stop choosing them, consumers keep them (``PERM_READ`` stays) and resume
    where they were once the broker is back.  With ``book``, every topic route seen is
    remembered for moving sends off a dead broker (:mod:`rmqfast.proxy.failover`).
    """

    name = "rewrite-routes"
    wants_responses = True
    CODES = (C.GET_ROUTEINFO_BY_TOPIC, C.GET_BROKER_CLUSTER_INFO)

    def __init__(
        self, registry: EndpointRegistry, on_rewrite: Callable[[Session, int], None] | None = None,
        *, health: BrokerHealth | None = None, book: RouteBook | None = None,
        on_heal: Callable[[str], None] | None = None,
    ) -> None:
        self.registry = registry
        self.on_rewrite = on_rewrite
        self.health = health
        self.book = book
        self.on_heal = on_heal

    def _heal(self, found: list[BrokerAddr], name: str, perm: int) -> int | None:
        """The ``perm`` of a QueueData of broker ``name``: without PERM_WRITE while its master is dead."""
        health = self.health
        if health is None or not perm & PERM_WRITE:
            return None
        masters = {b.broker_name: b.addr for b in found if b.broker_id == 0}
        addr = masters.get(name)
        if addr is None or not health.is_down(addr):
            return None
        if not any(n != name and not health.is_down(a) for n, a in masters.items()):
            return None  # no live master left: clients get the broker's own errors, not "no route"
        if self.on_heal is not None:
            self.on_heal(addr)
        return perm & ~PERM_WRITE

    def request_slots(self) -> set[int]:
        return slots_of(self.CODES)

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        if frame.code in self.CODES and not frame.is_oneway:
            pending: dict[int, int] = session.state.setdefault("route_opaques", {})
            # An answer whose opaque is not pending is relayed as it is, real broker addresses and
            # all: a second request on an opaque still pending (its answer would be the second one
            # back) and forgetting pending opaques would both let one through unrewritten.
            if frame.opaque in pending:
                return close(f"route request {frame.code} reuses opaque {frame.opaque} while a route request "
                             "with it is unanswered (its answer could not be told apart and rewritten)")
            if len(pending) >= 10000:  # a client that never reads answers; don't grow forever
                return close("more than 10000 route requests unanswered on one connection")
            pending[frame.opaque] = frame.code
            if self.book is not None and frame.code == C.GET_ROUTEINFO_BY_TOPIC:
                topics: dict[int, str] = session.state.setdefault("route_topics", {})
                if len(topics) > 10000:
                    topics.clear()
                topic = (frame.command().ext_fields or {}).get("topic")
                if topic:
                    topics[frame.opaque] = topic
        return None

    def on_response(self, session: Session, frame: Frame) -> Verdict | None:
        pending: dict[int, int] | None = session.state.get("route_opaques")
        if not pending or frame.opaque not in pending:
            return None
        req_code = pending.pop(frame.opaque)
        topics: dict[int, str] | None = session.state.get("route_topics")
        topic = topics.pop(frame.opaque, None) if topics else None
        if frame.code != C.SUCCESS:
            return None
        body = frame.body
        if not body:
            return None
        unmapped: list[str] = []

        def mapper(addr: str) -> str | None:
            if self.registry.is_proxy_address(addr):
                return None
            new = self.registry.advertised(addr)
            if new is None:
                unmapped.append(addr)
            return new

        heal = self._heal if self.health is not None and req_code == C.GET_ROUTEINFO_BY_TOPIC else None
        try:
            if topic is not None and self.book is not None:
                self.book.learn(topic, parse_route(body)[0])  # the real addresses, before the rewrite
            new_body, _ = rewrite_broker_addrs(body, mapper, perm=heal)
        except ValueError as exc:
            log.error(
                "cannot rewrite route answer; closing the connection rather than leak real broker addresses",
                extra=ctx(code=req_code, error=str(exc), client=session.client_addr),
            )
            return close(f"unparsable route answer: {exc}")
        if unmapped:
            log.warning("route keeps real broker addresses (no endpoint)", extra=ctx(brokers=unmapped))
        if self.on_rewrite is not None:
            self.on_rewrite(session, req_code)
        return rewrite(frame.with_body(new_body))


def build(host: ChainHost, role: str) -> Filter:
    """Route answers rewritten to the proxy's endpoints; healed from the health probes with
    ``[failover]`` ``heal_routes``."""
    fo = host.cfg.failover
    return RewriteRoutes(host.registry, host.on_rewritten,
                         health=host.health if fo.enabled and fo.heal_routes else None,
                         book=host.book if fo.enabled else None, on_heal=host.on_healed)

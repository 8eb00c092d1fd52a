"""What a filter's factory may ask of the worker that builds the chains (:class:`ChainHost`).

The factories (``build(host, role)`` in each filter's module) read the configuration and the
worker's services from here; the worker is the one implementation, a test may pass a stand-in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rmqfast.config import Config
    from rmqfast.filters.api import Session
    from rmqfast.limits.worker import WorkerLimits
    from rmqfast.proxy.endpoints import EndpointRegistry
    from rmqfast.proxy.failover import FailoverService, RouteBook
    from rmqfast.proxy.health import BrokerHealth


class ChainHost(Protocol):
    cfg: Config
    index: int
    registry: EndpointRegistry  # broker endpoints: route and message-address rewrites
    health: BrokerHealth
    health_metrics: Any  # HealthMetrics: GO_AWAY answers are counted there
    book: RouteBook
    failover: FailoverService
    limits: WorkerLimits | None  # [limits]: the shared buckets, None without rules
    delay: Any  # [delay]: the DelayService, None when nothing is held by the proxy
    gray: Any  # [gray]: the GrayFilter of the chains built last (a reload's carries its hand-over on), or None
    replication: Any  # cross-cloud copies: the ReplicationService (set when [clouds] has remotes)

    def on_denied(self, session: Session, code: int) -> None: ...

    def on_rewritten(self, session: Session, code: int) -> None: ...

    def on_healed(self, addr: str) -> None: ...

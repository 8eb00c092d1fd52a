"""A worker process: gevent, SO_REUSEPORT listeners, relay sessions.

Started by the supervisor as ``python -P -m rmqfast.server.worker --runtime DIR --index N
--status-fd FD``.  It reads the validated configuration from ``DIR/config.json``, binds every
listener with SO_REUSEPORT (all workers bind the same ports; the kernel spreads
connections), reports ``ready`` on the status pipe, and serves until SIGTERM.

Signals: SIGTERM stops accepting, lets in-flight requests finish (bounded by
``proxy.drain_timeout``) and exits 0; SIGHUP re-reads ``config.json`` and applies it without
dropping established connections.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gevent
import gevent.event
from gevent import socket

from rmqfast import config as config_mod
from rmqfast import log as log_mod
from rmqfast.codec import IMPLEMENTATION, ScanStats, code_slot, is_compiled, slot_code
from rmqfast.codec import codes as C
from rmqfast.codec.admincodes import preset_codes
from rmqfast.codec.command import decode_frame
from rmqfast.codec.tables import result_index
from rmqfast.config import Config, HostPort
from rmqfast.limits.filter import SendLimitFilter
from rmqfast.log import ctx
from rmqfast.proxy.acl import AclTopics
from rmqfast.proxy.addresses import RewriteMessageAddresses
from rmqfast.proxy.connect import to_gevent
from rmqfast.proxy.endpoints import Endpoint, EndpointRegistry
from rmqfast.proxy.failover import (
    RESEND_DEADLINE,
    FailoverService,
    KeepSendsInFlight,
    RouteBook,
    answer_in_flight,
    stalled_sends,
    wait_resends,
    with_requests,
)
from rmqfast.proxy.goaway import GoAway, draining, may_close
from rmqfast.proxy.health import BrokerHealth, HealthMetrics
from rmqfast.proxy.policy import DenyAdminCodes, Filter, FilterChain
from rmqfast.proxy.policy import Session as PolicySession
from rmqfast.proxy.relay import RelaySettings, Session, close_idle
from rmqfast.proxy.routes import RewriteRoutes
from rmqfast.proxy.tls import TlsContexts
from rmqfast.server.accept import (
    AcceptGuard,
    ConnectionCaps,
    ListenMetrics,
    RateLimitedLog,
    auto_max_connections,
    client_key,
    effective_caps,
    is_shortage,
)
from rmqfast.server.fdlimit import raise_nofile
from rmqfast.server.listener import Listener, RelayServer, bind_reuseport

if TYPE_CHECKING:
    from rmqfast.records import TrafficRecorder

log = logging.getLogger("rmqfast.worker")

EXIT_FATAL = 3  # startup failed for a reason a restart will not fix (bind error, bad state)
#: seconds between two reports of the listeners' state to the supervisor (a listener that flaps
#: between blocked and accepting must not flood the status pipe, whose writes block the worker)
LISTENERS_REPORT_PERIOD = 0.1


def spill_dir(state_dir: str | Path, index: int) -> Path:
    """``rmqfast.spill.store.worker_dir`` without importing the spill (a test keeps them equal)."""
    return Path(state_dir) / "spill" / f"worker-{index}"


class _SessionEnd:
    """``Worker._ended(session)`` as the session's end hook: 48 bytes, where a closure over the
    session took ~300 per connection (function, cells, their tuple)."""

    __slots__ = ("worker", "session")

    def __init__(self, worker: Worker, session: Session) -> None:
        self.worker = worker
        self.session = session

    def __call__(self) -> None:
        self.worker._ended(self.session)


class Worker:
    def __init__(
        self, cfg: Config, index: int, status: Callable[[dict], None], runtime: Path | None = None
    ) -> None:
        from rmqfast.limits import SHM_NAME
        from rmqfast.limits.worker import LimitsPublisher, WorkerLimits
        from rmqfast.metrics import Metrics, StatsPublisher

        self.cfg = cfg
        self.index = index
        self.status = status
        self.metrics = Metrics()
        self.stats = {"namesrv": ScanStats(), "broker": ScanStats()}
        self.publishers = [StatsPublisher(self.metrics, role, st) for role, st in self.stats.items()]
        # [limits]: buckets shared with the other workers through the supervisor's file
        self.limits: WorkerLimits | None = None
        self.limits_publisher: LimitsPublisher | None = None
        if runtime is not None and (runtime / SHM_NAME).exists():
            self.limits = WorkerLimits(runtime / SHM_NAME, cfg.limits)
            self.limits_publisher = LimitsPublisher(self.metrics, self.limits)
            self.limits_publisher.reconfigure(cfg.limits)
        self.records: TrafficRecorder | None = None  # [records]: traffic records for the Spark jobs
        # connection id -> client address, for sampled request records (ids kept one publish
        # period after their connection closed, so its last samples still find the address)
        self.clients: dict[int, str] = {}
        self._closed_ids: list[int] = []
        self._next_conn = 0
        if cfg.records.enabled:
            from rmqfast.records import StatsDelta, TrafficRecorder  # here: ~0.5 MiB a worker without records skips

            self.records = TrafficRecorder(cfg.records, index)
            self.record_deltas = [StatsDelta(role, st) for role, st in self.stats.items()]
            if cfg.records.sample_rate > 0:  # the scanners pick one request in N, in C
                for st in self.stats.values():
                    st.set_sampling(max(1, round(1 / cfg.records.sample_rate)))
        self.listeners: dict[HostPort, Listener] = {}
        # [proxy] max_connections, max_connections_per_client: admission on every Remoting listener
        self.caps = ConnectionCaps(*effective_caps(cfg.proxy.max_connections, cfg.proxy.max_connections_per_client))
        self.listen_metrics = ListenMetrics()
        self.rate_log = RateLimitedLog()
        #: listen address -> why this worker cannot accept there now (reported to the supervisor: /readyz)
        self.blocked: dict[str, str] = {}
        self._listeners_told: dict[str, str] = {}  # as last reported
        self._listeners_sent = 0.0
        self._listeners_report: Any = None  # the pending report's greenlet
        self.sessions: set[Session] = set()
        #: the sessions set up so far, by their in-flight table (``Session._setup`` adds, ``close``
        #: removes): the stalled-send sweep looks at the tables only (``with_requests``)
        self.tables: dict[Any, Session] = {}
        self.ns_preferred = 0
        self.draining = False
        self.settings = self._settings(cfg)
        self.tls = TlsContexts(cfg.tls)  # listener and upstream TLS (rmqfast.proxy.tls); the relay reads it
        self.tls.on_handshake = lambda role, side, ok: self.metrics.tls_handshakes.labels(
            role, side, "ok" if ok else "failed").inc()
        # [failover]: broker health probed in the background, routes healed, sends of clients of a
        # dead broker moved to another live master (rmqfast.proxy.health, rmqfast.proxy.failover)
        self.health_metrics = HealthMetrics()
        # the proxy's own upstream connections speak TLS where [tls.upstream] says so
        from rmqfast.clouds.remoting import Connection, ConnectionPool

        to_broker = self.tls.wrapper("broker", cfg.proxy.connect_timeout)
        self.health = BrokerHealth(cfg.failover, self.health_metrics,
                                   connect=lambda addr, t: Connection(addr, connect_timeout=t, wrap=to_broker))
        self.health.on_change(self._broker_changed)
        self.book = RouteBook(lambda: [str(u) for u in self.cfg.namesrv.upstreams])
        self.book._pool = ConnectionPool(self.book.timeout, wrap=self.tls.wrapper("namesrv", cfg.proxy.connect_timeout))
        self.failover = FailoverService(cfg.failover, self.health, self.book, self.health_metrics,
                                        max_frame=cfg.proxy.max_frame_size,
                                        pool=ConnectionPool(cfg.failover.probe_timeout, wrap=to_broker))
        self.failover.acl_denies_unsigned = cfg.acl.enabled and cfg.acl.unsigned == "deny"
        self.registry = EndpointRegistry(cfg, self._bind_endpoint)
        self._build_chains()
        self.shaper: Any = None  # [limits] mode "shape": peak shaving (rmqfast.limits.shaper)
        self._setup_shaper()

    # Configuration ---------------------------------------------------------------------------

    @staticmethod
    def _settings(cfg: Config) -> RelaySettings:
        p = cfg.proxy
        return RelaySettings(p.buffer_size, p.max_frame_size, p.max_header_size, p.connect_timeout, p.idle_timeout,
                             frame_timeout=p.frame_timeout, buffer_budget=p.buffer_budget,
                             first_frame_timeout=p.first_frame_timeout)

    def _build_chains(self) -> None:
        pol = self.cfg.policy
        fo = self.cfg.failover
        broker_filters: list[Filter] = []
        if self.cfg.replication_enabled:  # cross-cloud copies (rmqfast.replicate)
            from rmqfast.replicate import ReplicationService

            if getattr(self, "replication", None) is None:
                self.replication = ReplicationService(self.cfg, self.index)
            else:
                self.replication.reconfigure(self.cfg)
            broker_filters.append(self.replication.filter)
        self._setup_delay()
        if self.delay is not None:  # first: a held send is answered here and not copied
            broker_filters.insert(0, self.delay.filter)
        # sends the failover service moves take tokens and are held like relayed ones (rmqfast.proxy.failover)
        self.failover.limits, self.failover.delay = self.limits, self.delay
        # and are copied to remote clouds like relayed ones (the chain's copy filter never sees them)
        self.failover.replicate = self.replication.filter if self.cfg.replication_enabled else None
        # broker addresses inside messages -> proxy endpoints (last: the others see the frames first)
        self.message_addresses = RewriteMessageAddresses(self.registry, pol.message_addresses)
        self.failover.offset_ids = self.message_addresses.map_offset_ids  # moved sends' answers
        # [acl]: the per-AccessKey topic allowlist, before the filters that copy or hold sends
        acl: list[Filter] = [AclTopics(self.cfg.acl, self._denied)] if self.cfg.acl.enabled else []
        # [limits]: sends the scanner's limiter refused get SYSTEM_BUSY or are shaped, before the
        # filters that hold or copy sends (a refused send is neither held nor copied)
        limit: list[Filter] = [SendLimitFilter(self.limits)] if self.limits is not None else []
        # [gray]: canary releases (rmqfast.gray): consumer lists, pulls, offset commits and the queue
        # ids of sends of split topics; after the limits, before the filters that hold or copy sends
        gray: list[Filter] = [self._gray_filter()] if self.cfg.gray.enabled else []
        if not gray:
            self.failover.place = None
            self.gray = None
        # [failover] resend: copies of the sends in flight, for a resend when their broker dies (last:
        # what it keeps is what the broker was sent)
        keep: list[Filter] = ([KeepSendsInFlight(everything=fo.resend == "all")]
                              if fo.enabled and fo.resend != "off" else [])
        ns_allow = [*pol.allow_codes, *preset_codes(pol.preset, "namesrv")]
        broker_allow = [*pol.allow_codes, *preset_codes(pol.preset, "broker")]
        self.chains = {
            "namesrv": FilterChain(
                [
                    DenyAdminCodes(C.NAMESRV_DATA_PLANE_CODES, ns_allow, pol.deny_codes, self._denied,
                                   preset=pol.preset),
                    RewriteRoutes(self.registry, self._rewritten,
                                  health=self.health if fo.enabled and fo.heal_routes else None,
                                  book=self.book if fo.enabled else None, on_heal=self._healed),
                ]
            ),
            "broker": FilterChain(
                [
                    DenyAdminCodes(C.BROKER_DATA_PLANE_CODES, broker_allow, pol.deny_codes, self._denied,
                                   preset=pol.preset),
                    *acl,
                    *limit,
                    *gray,
                    *broker_filters,
                    self.message_addresses,
                    *keep,
                ]
            ),
        }

    def _gray_filter(self) -> Filter:
        from rmqfast.gray.filter import GrayFilter, gray_metrics
        from rmqfast.gray.state import Commands, state_path

        def queues(topic: str, broker: str) -> int | None:
            route = self.book.get(topic)  # cached; else asked of the name server (this greenlet waits)
            if route is None:
                return None
            return next((n for name, n, _ in route[1] if name == broker), None)

        def broker_name(addr: str, topic: str) -> str | None:
            self.book.get(topic)  # the route names the brokers
            return self.book.broker_name_of(addr)

        g = self.cfg.gray
        # every worker reads the file within 0.35 s (0.25 s + its 0.1 s tick) and switches 0.5 s after it was
        # written: all at the same instant (a client rebalancing meanwhile sees one phase everywhere)
        commands = Commands(state_path(g.state_file, self.cfg.proxy.state_dir), interval=0.25,
                            lead=0.5 if g.handover > 0 else 0.0)
        gray = GrayFilter(g, queues, commands, gray_metrics(), broker_name=broker_name)
        old = getattr(self, "gray", None)
        gray.handover.carry(old.handover if old is not None else None)  # a reload keeps the fences under way
        self.gray = gray
        self.failover.place = gray.place  # sends the failover service moves keep their share
        return gray

    def _setup_delay(self) -> None:
        """[delay]: proxy-held delayed messages, in the worker's spill (the replicator's when there is one)."""
        if getattr(self, "delay", None) is not None:
            self.delay.reconfigure(self.cfg.delay)
            return
        self.delay: Any = None
        repl = getattr(self, "replication", None)
        if not self.cfg.delay.enabled and repl is None and not spill_dir(self.cfg.proxy.state_dir, self.index).exists():
            return
        try:
            spill = repl.replicator.store if repl is not None else self._own_spill()
            from rmqfast.delay import open_delay

            self.delay = open_delay(self.cfg, self.index, spill)
            if self.delay is not None:  # released sends speak TLS where [tls.upstream] says so
                self.delay.releaser.pool.wrap = self.tls.wrapper("broker", self.cfg.proxy.connect_timeout)
        except Exception as exc:  # an unusable spill: delayed sends go to the broker as they are
            log.error("proxy-held delay unavailable: cannot open the spill",
                      extra=ctx(worker=self.index, error=str(exc)))
            return
        if self.delay is not None and getattr(self, "_started", False):
            self.delay.start()

    def _own_spill(self) -> Any:
        """The worker's own spill (no replicator), opened once and shared by [delay] and the
        shaper: one writer per RocksDB (a second open of it fails on its lock)."""
        if getattr(self, "own_spill", None) is None:
            from rmqfast.spill.store import SpillStore, worker_dir  # here: ~0.6 MiB a worker without a spill skips

            rp = self.cfg.replicate
            self.own_spill = SpillStore(
                worker_dir(self.cfg.proxy.state_dir, self.index), write_buffer_bytes=rp.write_buffer_bytes,
                block_cache_bytes=rp.block_cache_bytes, disk_cap_bytes=rp.disk_cap_bytes)
        return self.own_spill

    def _setup_shaper(self) -> None:
        """Start peak shaving when a shape rule exists or the spill may hold a shaped backlog.

        It shares the cross-cloud replicator's spill when there is one (one writer per RocksDB).
        """
        if self.limits is None or self.shaper is not None:
            return
        repl = getattr(self, "replication", None)
        if (repl is None and getattr(self, "own_spill", None) is None and not any(
                r.mode == "shape" for r in self.cfg.limits.rules)
                and not spill_dir(self.cfg.proxy.state_dir, self.index).exists()):
            return  # shaping_wanted's answer without importing the shaper and the spill (~1 MiB)
        from rmqfast.limits.shaper import Shaper, shaping_wanted

        if not shaping_wanted(self.cfg, self.index, repl.replicator.store if repl is not None
                              else getattr(self, "own_spill", None)):
            return
        try:
            shaper = Shaper(self.cfg, self.index, self.limits, metrics=self.metrics,
                            store=repl.replicator.store if repl is not None else self._own_spill(),
                            committer=repl.replicator.committer if repl is not None else None)
        except Exception as exc:  # an unusable spill: shape rules answer SYSTEM_BUSY instead
            log.error("peak shaving unavailable: cannot open the spill; sends over a shape rule get SYSTEM_BUSY",
                      extra=ctx(worker=self.index, error=str(exc)))
            return
        if not shaper.needed:
            shaper.close()
            return
        self.shaper = shaper
        self.limits.shaper = shaper
        shaper.pool.wrap = self.tls.wrapper("broker", self.cfg.proxy.connect_timeout)  # [tls.upstream]
        if getattr(self, "_started", False):
            shaper.start()

    def _denied(self, session: PolicySession, code: int) -> None:
        self.metrics.denied.labels(session.role, str(code)).inc()

    def _healed(self, addr: str) -> None:
        self.health_metrics.route_heals.labels(addr).inc()

    def _rewritten(self, session: PolicySession, code: int) -> None:
        self.metrics.route_rewrites.labels(str(code)).inc()

    # Listeners -------------------------------------------------------------------------------

    def start(self) -> None:
        allowed = auto_max_connections()
        if self.cfg.proxy.max_connections > allowed:
            log.warning("proxy.max_connections is above what the open-files limit allows: accepts may fail "
                        "with EMFILE; raise the limit (LimitNOFILE, ulimit -n) or lower the setting",
                        extra=ctx(worker=self.index, max_connections=self.cfg.proxy.max_connections,
                                  allowed=allowed))
        if getattr(self, "replication", None) is not None:
            self.replication.start()  # before serving: knows which remotes have consumers online
        self._started = True
        if self.shaper is not None:
            self.shaper.start()  # releases a shaped backlog left by the previous run
        if self.delay is not None:
            self.delay.start()  # releases what the previous run of this worker slot held
        ns = self.cfg.namesrv.listen
        assert ns is not None
        self._listen("namesrv", ns, None)
        self.registry.refresh()
        gevent.spawn(self._refresh_loop)
        gevent.spawn(self._publish_loop)
        gevent.spawn(self._idle_loop)
        gevent.spawn(self._stall_loop)
        gevent.spawn(self._gray_loop)
        if self.cfg.failover.enabled:
            self._watch_brokers()
        self.metrics.workers_up.set(1)
        log.info(
            "worker ready",
            extra=ctx(worker=self.index, codec=IMPLEMENTATION, listeners=[str(k) for k in self.listeners]),
        )

    def _listen(self, role: str, listen: HostPort, upstream: HostPort | None) -> None:
        try:
            sock = bind_reuseport(listen)
        except OSError as exc:
            self._listener_state(str(listen), f"{role} listener {listen}: cannot bind ({exc.strerror or exc})")
            raise
        self._listener_state(str(listen), "")
        server = RelayServer(sock, self._handler(role, upstream))
        server.max_accept = 16  # several workers share the port: don't hog the accept queue
        server.caps = self.caps
        server.guard = AcceptGuard(role, str(listen), self.listen_metrics,
                                   lambda why, at=str(listen): self._listener_state(at, why), self.rate_log)
        server.on_refused = lambda cap, addr, role=role: self._refused(role, cap, addr)
        server.start()
        self.listeners[listen] = Listener(role, listen, server, upstream)

    def _refused(self, role: str, cap: str, addr: tuple) -> None:
        """A connection past a cap was closed on accept: a counter, a rate-limited line."""
        self.listen_metrics.refused.labels(role, cap).inc()
        setting = "proxy.max_connections" if cap == "worker" else "proxy.max_connections_per_client"
        limit = self.caps.total if cap == "worker" else self.caps.per_client
        self.rate_log(logging.WARNING, f"cap {cap} {role}", "connection refused: cap reached",
                      role=role, cap=cap, client=addr[0], limit=limit, open=self.caps.open, setting=setting)

    def _listener_state(self, listen: str, why: str) -> None:
        """``listen`` cannot accept (``why``) or can again (""): told to the supervisor on change."""
        if self.blocked.get(listen, "") == why:
            return
        if why:
            self.blocked[listen] = why
        else:
            self.blocked.pop(listen, None)
        if self._listeners_report is None:  # one report per period at most, the state as it is then
            wait = self._listeners_sent + LISTENERS_REPORT_PERIOD - time.monotonic()
            self._listeners_report = gevent.spawn_later(max(0.0, wait), self._report_listeners)

    def _report_listeners(self) -> None:
        self._listeners_report = None
        self._listeners_sent = time.monotonic()
        if self.blocked != self._listeners_told:
            self._listeners_told = dict(self.blocked)
            self.status({"event": "listeners", "blocked": dict(self.blocked)})

    def _bind_endpoint(self, ep: Endpoint) -> None:
        if ep.listen in self.listeners:
            return
        self._listen("broker", ep.listen, ep.upstream)

    def _handler(self, role: str, upstream: HostPort | None) -> Callable[[socket.socket, tuple], None]:
        only = [upstream] if upstream is not None else []  # shared by this listener's sessions (read only)

        def handle(sock: Any, addr: tuple) -> None:
            """``sock``: a plain socket (RelayServer), this handler's to close on every path
            unless a session took it; its admission (``caps``) this handler's to release unless a
            session took that (``_ended`` releases it)."""
            owned: list[bool] = []  # a session took the admission (set just before it serves)
            try:
                if self.tls.listen_mode(role) != "disabled":  # the handshake waits with gevent's calls
                    sock = to_gevent(sock)
                try:
                    taken = start(sock, addr, owned)
                except BaseException:
                    sock.close()
                    raise
                if not taken:
                    sock.close()
            finally:
                if not owned:
                    self.caps.release(client_key(addr[0]))

        def start(sock: Any, addr: tuple, owned: list[bool]) -> bool:
            """Serve ``sock``; False when nothing took it (the caller closes it).  A session that
            serves it releases its admission when it ends (``owned`` says so)."""
            if self.draining:
                return False
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = f"{addr[0]}:{addr[1]}"
            sock = self.tls.accept(role, sock, client)  # the same socket unless this listener has TLS
            if sock is None:
                return True  # closed
            if upstream is not None:
                ups = only
            else:
                lst = self.cfg.namesrv.upstreams
                k = self.ns_preferred % len(lst)
                ups = lst[k:] + lst[:k]
            if upstream is not None and self._serve_failover(sock, client, upstream):
                return True
            session = Session(role, sock, client, ups, self.chains[role], self.stats[role], self.settings, self)
            self._next_conn += 1
            session.conn_id = self._next_conn
            if self.records is not None:  # sampled request records name the client (_record_samples)
                self.clients[session.conn_id] = client
            self.metrics.connections.labels(role).inc()
            self.metrics.connections_active.labels(role).inc()
            self.sessions.add(session)
            # Returns once the session's pumps are parked in the reactor (no greenlet waits for an
            # idle connection); ``_ended`` runs when both directions have ended.
            owned.append(True)  # from here on ``_ended`` releases the admission, whatever happens
            session.serve(_SessionEnd(self, session))  # the session closes the socket on every path
            return True

        return handle

    def _ended(self, session: Session) -> None:
        """A session's both directions have ended."""
        self.sessions.discard(session)
        self.caps.release(client_key(session.client_addr.rpartition(":")[0]))
        if session.role == "broker" and session.upstreams and not session.upstream_addr:  # connect failed: probe now
            if session.local_shortage:  # our own descriptors ran out: says nothing about the broker
                self.listen_metrics.local_shortage.labels("upstream_connect").inc()
            else:
                self.health.suspect(str(session.upstreams[0]), "a client's upstream connect failed")
        if self.records is not None:
            self._closed_ids.append(session.conn_id)
        self.metrics.connections_active.labels(session.role).dec()

    def _serve_failover(self, sock: Any, client: str, upstream: HostPort) -> bool:
        """Serve a client of a broker seen dead: its sends are moved (rmqfast.proxy.failover); True
        when it did (the socket is closed then)."""
        addr = str(upstream)
        if not self.cfg.failover.enabled or self.draining or not self.health.still_down(addr):
            return False
        self.upstream_error("broker")
        log.warning("upstream unreachable", extra=ctx(role="broker", client=client, errors=f"{addr}: broker seen dead",
                                                     failover="sends are moved to another master"))
        stats = self.stats["broker"]
        gauge = self.metrics.connections_active.labels("broker")
        self.metrics.connections.labels("broker").inc()
        gauge.inc()
        sock = to_gevent(sock)  # the failover service waits with gevent's calls
        try:
            self.failover.serve(sock, client, addr,
                                on_answer=lambda req, resp: stats.count_result(code_slot(req), result_index(resp)))
        finally:
            gauge.dec()
            sock.close()  # (again: serve closes it when it ends)
        return True

    def _watch_brokers(self) -> None:
        """Probe every broker this worker has an endpoint for (called again as endpoints appear)."""
        self.health.watch(str(ep.upstream) for ep in self.registry.endpoints() if not ep.vip)

    # Session events ----------------------------------------------------------------------------

    def upstream_lost(self, session: Session) -> None:
        """A broker connection ended on the broker's side: probe it now; answer what was in flight."""
        addr = session.upstream_addr
        if session.role != "broker" or not addr or not self.cfg.failover.enabled:
            return
        self.health.suspect(addr, "a relayed connection ended on the broker's side")
        self._answer_in_flight(session, addr, f"rmqfast: broker {addr} closed the connection with this request "
                                              "in flight (a send may have been stored); send it again")

    def _answer_in_flight(self, session: Session, addr: str, remark: str) -> None:
        """Answer what waits on ``session`` (its broker ``addr`` died): kept sends are resent to another
        live master and answered with its result, the rest SYSTEM_ERROR (rmqfast.proxy.failover)."""

        def resend(data: bytes) -> Any:
            # relayed: the send passed the filter chain (limits, delay) when the client sent it
            answer, _to = self.failover.move(decode_frame(data), addr, session.client_addr.rpartition(":")[0],
                                             relayed=True)
            return answer

        answered, sends, resent = answer_in_flight(session, remark, resend,
                                                   min(RESEND_DEADLINE, self.cfg.failover.send_timeout))
        if answered:
            log.info("requests in flight answered: the broker connection ended",
                     extra=ctx(broker=addr, client=session.client_addr, requests=answered, sends=sends,
                               resent=resent))
        if sends:
            self.health_metrics.possible_duplicates.labels(addr).inc(sends)
        if resent:
            self.health_metrics.resent.labels(addr).inc(resent)

    def _broker_changed(self, addr: str, up: bool) -> None:
        """A broker seen dead: its relayed connections (a hung broker keeps them open) are cut, the
        requests waiting on them answered (kept sends resent elsewhere, the rest SYSTEM_ERROR); their
        clients reconnect to failover."""
        if up or not self.cfg.failover.enabled:
            return
        cut = [s for s in self.sessions if s.role == "broker" and s.upstream_addr == addr and not s.closed]
        for s in cut:
            gevent.spawn(self._cut, s, addr)  # resends take a round trip: never in the prober's greenlet
        if cut:
            log.warning("connections to a dead broker cut", extra=ctx(broker=addr, connections=len(cut)))

    def _cut(self, s: Session, addr: str) -> None:
        remark = (f"rmqfast: broker {addr} stopped answering with this request in flight (a send may have been "
                  "stored); send it again")
        try:
            self._answer_in_flight(s, addr, remark)
            wait_resends(s)  # the relay's own answer_in_flight (upstream_lost) may be resending too
            if not s.closed:
                # what the client sent while the resends ran: answered now, with no yield before the close
                _, sends, _ = answer_in_flight(s, remark)
                if sends:
                    self.health_metrics.possible_duplicates.labels(addr).inc(sends)
        except Exception:  # answering is best effort; the cut is not
            log.exception("answering requests of a dead broker's connection failed", extra=ctx(broker=addr))
        finally:
            s.close()

    def upstream_error(self, role: str) -> None:
        self.metrics.upstream_errors.labels(role).inc()

    def upstream_ok(self, session: Session, hp: HostPort) -> None:
        if session.role == "namesrv":
            lst = self.cfg.namesrv.upstreams
            if hp in lst:
                self.ns_preferred = lst.index(hp)

    # Background loops ------------------------------------------------------------------------

    def _refresh_loop(self) -> None:
        while not self.draining:
            gevent.sleep(0.5)
            try:
                self.registry.refresh()
                if self.cfg.failover.enabled:
                    self._watch_brokers()
            except OSError as exc:
                if not is_shortage(exc):
                    log.exception("endpoint table refresh failed")
                    continue
                # out of descriptors: tried again next period, no traceback every half second
                self.rate_log(logging.ERROR, "refresh shortage", "endpoint table refresh failed: out of descriptors",
                              error=str(exc), worker=self.index)
            except Exception:
                log.exception("endpoint table refresh failed")

    def _stall_loop(self) -> None:
        """[failover]: tell broker health of relayed sends waiting with nothing read back (a hung
        broker is seen in well under a second when both that and its probe say so)."""
        while not self.draining:
            # a worker short of CPU sweeps late and may not have read answers that came: the prober
            # checks its own socket for an unread answer before it believes a stall
            gevent.sleep(min(0.1, self.cfg.failover.hang_timeout / 4))
            if not self.cfg.failover.enabled:
                continue
            try:
                now = time.monotonic()
                self.health.report_stalls(stalled_sends(with_requests(self.tables), now), now)
            except Exception:
                log.exception("stalled-send sweep failed")

    def _gray_loop(self) -> None:
        """[gray]: phase changes seen within 0.1 s, consumers notified, held pulls answered
        (:meth:`rmqfast.gray.filter.GrayFilter.tick`)."""
        while not self.draining:
            gevent.sleep(0.1)
            gray = getattr(self, "gray", None)
            if gray is None or not self.cfg.gray.enabled:
                continue
            try:
                gray.tick(self.sessions)
            except Exception:
                log.exception("gray hand-over tick failed")

    def _idle_loop(self) -> None:
        """Close connections idle for longer than ``proxy.idle_timeout`` (checked a few times per period)."""
        while True:
            limit = self.settings.idle_timeout
            fft = self.settings.first_frame_timeout or limit
            gevent.sleep(min(max(min(limit, fft) / 4, 0.05), 5.0))
            close_idle(self.sessions, limit)

    def _publish_loop(self) -> None:
        while True:
            gevent.sleep(1.0)
            self.publish()

    def publish(self) -> None:
        for p in self.publishers:
            p.publish()
        if self.limits_publisher is not None:
            self.limits_publisher.publish()
        if self.shaper is not None:
            self.shaper.publish()
        if self.delay is not None:
            self.delay.publish()
        if self.records is not None:
            self._record_samples()
            self.records.add_aggregates([row for d in self.record_deltas for row in d.take()])
        gone, self._closed_ids = self._closed_ids, []
        for cid in gone:
            self.clients.pop(cid, None)
        # Last: a reader that sees this count go up knows every counter above was written.
        self.metrics.publishes.labels(str(self.index)).inc()

    def _record_samples(self) -> None:
        """Sampled requests (picked and timed by the scanners in C) into per-request records."""
        assert self.records is not None
        wall, mono = time.time(), time.monotonic_ns()
        for role, st in self.stats.items():
            for t_ns, lat_ns, slot, resp_code, topic, conn, req_bytes, resp_bytes in st.take_samples():
                code = slot_code(slot)
                self.records.sample(
                    role=role, client=self.clients.get(conn, ""), code=-2 if code is None else code,
                    topic=topic.decode("utf-8", "replace"), req_size=req_bytes, resp_size=resp_bytes,
                    latency_us=lat_ns // 1000, resp_code=resp_code, result="ok" if resp_code == 0 else "error",
                    ts=wall - (mono - t_ns) / 1e9,
                )

    # Signals -----------------------------------------------------------------------------------

    def drain(self) -> None:
        """Stop accepting, wait (bounded) for in-flight requests, close everything."""
        if self.draining:
            return
        self.draining = True
        for lst in self.listeners.values():
            lst.server.close()
        deadline = time.monotonic() + self.cfg.proxy.drain_timeout
        log.info("draining", extra=ctx(worker=self.index, sessions=len(self.sessions)))
        self.failover.stopping = True
        if self.cfg.failover.go_away:  # requests arriving from now on: GO_AWAY to clients that reconnect on it
            go_away_from_now_on(self.sessions, GoAway(lambda s, code: self.health_metrics.go_away.labels(s.role).inc()))
        go = self.cfg.failover.go_away
        while self.sessions and time.monotonic() < deadline:
            now = time.monotonic()
            for s in list(self.sessions):
                if s.in_flight == 0 and (not go or may_close(s, s.idle_for(now))):
                    s.close()
            gevent.sleep(0.05)
        left = len(self.sessions)
        for s in list(self.sessions):
            s.close()
        self.publish()
        _close_services(self)
        log.info("worker stopped", extra=ctx(worker=self.index, cut_sessions=left))

    def reload(self, cfg: Config) -> None:
        old = self.cfg
        self.cfg = cfg
        log_mod.setup(cfg.log.format, cfg.log.level)
        self.settings.__dict__.update(self._settings(cfg).__dict__)
        self.caps.set_limits(*effective_caps(cfg.proxy.max_connections, cfg.proxy.max_connections_per_client))
        self.tls.reload(cfg.tls)  # certificate files read again; new connections use them
        self.registry.reconfigure(cfg)
        self.health.cfg = self.failover.cfg = cfg.failover  # probes and moved sends follow [failover]
        self.failover.acl_denies_unsigned = cfg.acl.enabled and cfg.acl.unsigned == "deny"
        if self.limits_publisher is not None:
            self.limits_publisher.reconfigure(cfg.limits)  # live sessions see it at once
        self._build_chains()
        self._setup_shaper()
        if self.shaper is not None:
            self.shaper.reconfigure()  # holds follow the new shape rules
        for s in list(self.sessions):
            if s.c2u is not None:
                s.c2u.set_actions(self.chains[s.role].request_actions)
                s.c2u.delay_topics = self.chains[s.role].delay_topics
                s.c2u.policy_topics = self.chains[s.role].policy_topics
            u2c = getattr(s, "u2c", None)
            if u2c is not None:  # the new chain's store-host map (a records answer's other half)
                u2c.address_map = self.chains[s.role].address_map(is_compiled(u2c))
            s.chain = self.chains[s.role]
        wanted = {cfg.namesrv.listen} | {ep.listen for ep in self.registry.endpoints()}
        for hp in list(self.listeners):
            if hp not in wanted:
                self.listeners.pop(hp).server.close()
                self.registry.forget_bound(hp)
                self._listener_state(str(hp), "")
        if cfg.namesrv.listen not in self.listeners:
            assert cfg.namesrv.listen is not None
            try:
                self._listen("namesrv", cfg.namesrv.listen, None)
            except OSError as exc:
                log.error(
                    "cannot bind the new namesrv.listen", extra=ctx(listen=str(cfg.namesrv.listen), error=str(exc))
                )
        self.registry.bind_all()
        log.info("configuration reloaded", extra=ctx(worker=self.index, was_workers=old.proxy.workers))



def go_away_from_now_on(sessions: Iterable[Session], go_away: GoAway) -> None:
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


def _close_services(w: Any) -> None:
    """A draining worker's records, shaper, delay, spill and replication, in that order, once
    its sessions are closed."""
    if w.records is not None:
        w.records.close()
    if w.shaper is not None:
        w.shaper.close()  # before the replicator: they may share its spill
    if getattr(w, "delay", None) is not None:
        w.delay.close()
    if getattr(w, "own_spill", None) is not None:
        w.own_spill.close()
    if getattr(w, "replication", None) is not None:
        w.replication.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rmqfast-worker")
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--status-fd", type=int, default=-1)
    args = ap.parse_args(argv)
    runtime = Path(args.runtime)
    from rmqfast.metrics import light_prometheus

    light_prometheus()  # the metric classes only: a worker never serves /metrics (~6 MiB less RSS)
    cfg = config_mod.from_json((runtime / "config.json").read_text())
    log_mod.setup(cfg.log.format, cfg.log.level)
    # two descriptors per client connection: the soft limit (often 1024) would cap a worker at ~500
    raise_nofile(args.index)
    status_file = os.fdopen(args.status_fd, "w", buffering=1) if args.status_fd >= 0 else None

    def status(msg: dict) -> None:
        if status_file is not None:
            try:
                status_file.write(json.dumps(msg) + "\n")
            except OSError:
                pass

    try:
        worker = Worker(cfg, args.index, status, runtime)
        worker.start()
    except Exception as exc:  # bind errors, unreadable endpoint table...
        log.error("worker cannot start", extra=ctx(worker=args.index, error=str(exc)))
        status({"event": "fatal", "error": str(exc)})
        return EXIT_FATAL
    # [grpc]: this worker's gRPC front, a process of its own (rmqfast.grpcfront.server); it ends with
    # the worker (its lifeline pipe closes)
    grpc_front = None
    if cfg.grpc.enabled:
        from rmqfast.grpcfront.keeper import FrontKeeper

        grpc_front = FrontKeeper(runtime)
        grpc_front.start()
    done = gevent.event.Event()

    def on_term() -> None:
        gevent.spawn(lambda: (worker.drain(), done.set()))

    def on_hup() -> None:
        try:
            new = config_mod.from_json((runtime / "config.json").read_text())
        except Exception as exc:
            log.error("reload failed; keeping the running configuration", extra=ctx(error=str(exc)))
            return
        worker.reload(new)
        status({"event": "reloaded"})

    gevent.signal_handler(signal.SIGTERM, on_term)
    gevent.signal_handler(signal.SIGINT, on_term)
    gevent.signal_handler(signal.SIGHUP, on_hup)
    from rmqfast.server.spawn import identity

    # what the set-up made (modules, configuration, tables) lives as long as the worker: kept out of
    # the collector's scans, a full collection pauses the event loop only for what came since
    gc.freeze()
    # version, codec twin and package directory: the supervisor refuses a worker that differs
    status({"event": "ready", "worker_pid": os.getpid(), **identity()})
    done.wait()
    if grpc_front is not None:
        grpc_front.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A worker: gevent, SO_REUSEPORT listeners, relay sessions (the process around it, its
arguments, status pipe and signals: :mod:`rmqfast.server.workerproc`).

The worker binds every listener with SO_REUSEPORT (all workers bind the same ports; the kernel
spreads connections), builds its filter chains from the filter registry
(:mod:`rmqfast.filters.registry`) after the services they front (:mod:`rmqfast.server.services`),
serves, drains on SIGTERM and applies a reloaded configuration without dropping established
connections.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gevent
import gevent.event
from gevent import socket

from rmqfast import log as log_mod
from rmqfast.codec import IMPLEMENTATION, ScanStats, code_slot, slot_code
from rmqfast.codec.command import decode_frame
from rmqfast.codec.tables import result_index
from rmqfast.config import Config, HostPort
from rmqfast.filters.api import Session as PolicySession
from rmqfast.filters.goaway import build as goaway_filter
from rmqfast.filters.goaway import go_away_from_now_on, may_close
from rmqfast.filters.registry import adopt_chains, build_chains
from rmqfast.heap import Trimmer
from rmqfast.log import ctx
from rmqfast.proxy.connect import to_gevent
from rmqfast.proxy.endpoints import Endpoint, EndpointRegistry
from rmqfast.proxy.failover import (
    RESEND_DEADLINE,
    FailoverService,
    RouteBook,
    answer_in_flight,
    stalled_sends,
    wait_resends,
    with_requests,
)
from rmqfast.proxy.health import BrokerHealth, HealthMetrics
from rmqfast.proxy.relay import RelaySettings, Session, close_idle
from rmqfast.proxy.tls import TlsContexts
from rmqfast.server import services
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
from rmqfast.server.evict import Evictor
from rmqfast.server.listener import Listener, RelayServer, bind_reuseport

if TYPE_CHECKING:
    from rmqfast.records import TrafficRecorder

log = logging.getLogger("rmqfast.worker")

#: seconds between two reports of the listeners' state to the supervisor (a listener that flaps
#: between blocked and accepting must not flood the status pipe, whose writes block the worker)
LISTENERS_REPORT_PERIOD = 0.1


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
        self.evictor = Evictor(self.sessions, self.caps, self.listen_metrics, self.rate_log,  # at the cap a newcomer
                               lambda why: self._listener_state("admission", why))  # evicts an idle connection
        self.trimmer = Trimmer()  # the C heap back to the system after a peak of connections
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
        services.setup_shaper(self)

    # Configuration ---------------------------------------------------------------------------

    @staticmethod
    def _settings(cfg: Config) -> RelaySettings:
        p = cfg.proxy
        return RelaySettings(p.buffer_size, p.max_frame_size, p.max_header_size, p.connect_timeout, p.idle_timeout,
                             frame_timeout=p.frame_timeout, buffer_budget=p.buffer_budget,
                             first_frame_timeout=p.first_frame_timeout)

    def _build_chains(self) -> None:
        """The services the filters front (replication, delay), then the chains from the filter
        registry (:mod:`rmqfast.filters.registry`), then what the failover service borrows of them."""
        if self.cfg.replication_enabled:  # cross-cloud copies (rmqfast.replicate)
            services.setup_replication(self)
        services.setup_delay(self)
        self.chains, built = build_chains(self)
        fo = self.failover
        # sends the failover service moves take tokens, are held and copied to remote clouds like
        # relayed ones (the chain's copy filter never sees them), keep their gray share, and their
        # answers get the message-address rewrite
        fo.limits, fo.delay = self.limits, self.delay
        fo.replicate = self.replication.filter if self.cfg.replication_enabled else None
        self.message_addresses = built["addresses"]
        fo.offset_ids = self.message_addresses.map_offset_ids
        self.gray = built.get("gray")  # [gray]: its hand-over ticks (_gray_loop); a reload's carries the fences on
        fo.place = self.gray.place if self.gray is not None else None

    def on_denied(self, session: PolicySession, code: int) -> None:
        self.metrics.denied.labels(session.role, str(code)).inc()

    def on_healed(self, addr: str) -> None:
        self.health_metrics.route_heals.labels(addr).inc()

    def on_rewritten(self, session: PolicySession, code: int) -> None:
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
        gevent.spawn(services.gray_loop, self)
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
        server.make_room = self.evictor.make_room
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
        if self.evictor.blocked:
            self.evictor.check()
        self.trimmer.maybe_trim(self.caps.open, self.caps)
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

    def _idle_loop(self) -> None:
        """Close connections idle for longer than ``proxy.idle_timeout`` (checked a few times per period)."""
        while True:
            limit = self.settings.idle_timeout
            fft = self.settings.first_frame_timeout or limit
            gevent.sleep(min(max(min(limit, fft) / 4, 0.05), 5.0))
            close_idle(self.sessions, limit,
                       counted=lambda role, why: self.listen_metrics.deadline_closes.labels(role, why).inc())
            self.evictor.check()

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
            go_away_from_now_on(self.sessions, goaway_filter(self, ""))
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
        services.close_services(self)
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
        services.setup_shaper(self)
        if self.shaper is not None:
            self.shaper.reconfigure()  # holds follow the new shape rules
        adopt_chains(self.sessions, self.chains)  # live sessions: their scanners read the new chains
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


if __name__ == "__main__":  # the supervisor's ``python -P -m rmqfast.server.worker``
    # this module is the Worker the process runs: not executed a second time by the import below
    sys.modules.setdefault("rmqfast.server.worker", sys.modules[__name__])
    from rmqfast.server.workerproc import main

    sys.exit(main())

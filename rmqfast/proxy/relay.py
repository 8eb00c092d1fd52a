"""The relay: one upstream connection per downstream connection, two pumps per pair.

Each pump reads whole receive buffers (``recv_into`` a reusable buffer), lets the frame
scanner say how far the bytes may be forwarded unchanged, and forwards that span with one
``sendall``.  Only frames a policy filter asked for become Python objects.  Partial frames
are forwarded as they arrive unless a policy needs them whole, so the relay adds no
store-and-forward delay to large messages.

Because the client and its upstream connection are paired 1:1, opaques, heartbeats,
oneway frames and broker-to-client requests (transaction check-back 39, consumer ids
changed 40, running info 307, consume directly 309...) need no bookkeeping at all.

What the session decides about a frame handed to Python (filters, verdicts, local answers at
frame boundaries, in-flight accounting) is :class:`rmqfast.proxy.core.SessionCore`, without
sockets; this module adds the sockets, the watchers and the two pumps.
The session is split by concept, one module each (this one keeps the sockets, the lifecycle and
the choice of pump, and re-exports the names the rest of the code and the tests use):
:mod:`rmqfast.proxy.writer` (the one writer of each socket), :mod:`rmqfast.proxy.pump_c` (the
compiled pump driver and the reactor), :mod:`rmqfast.proxy.pump_py` (its pure-Python twin),
:mod:`rmqfast.proxy.session_connect` (connect, TLS upstream, refusal),
:mod:`rmqfast.proxy.session_end` (how a direction's end ends the session),
:mod:`rmqfast.proxy.session_health` (liveness for the control plane, the idle sweep),
:mod:`rmqfast.proxy.budget` (the worker's buffer budget).


An idle connection costs no greenlet: with the compiled pumps parked in the worker's reactor,
:meth:`Session.serve` returns once both are parked, and a greenlet is made only when a pump's
step needs Python (a policy frame, a wait for the destination, the end), for as long as it does.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gevent
from gevent.event import Event
from gevent.lock import Semaphore

from rmqfast import codec
from rmqfast.codec import FrameScanner, Pump
from rmqfast.filters.api import FilterChain
from rmqfast.proxy import budget, pump_c, session_end
from rmqfast.proxy.budget import BUDGET, DEFAULT_BUFFER_BUDGET, PyBufferBudget, pin_mmap_threshold
from rmqfast.proxy.connect import connect_plain
from rmqfast.proxy.core import SessionCore
from rmqfast.proxy.pump_c import REACTOR_REPOLL, USE_REACTOR, USE_URING, CompiledPumps, reactor_of
from rmqfast.proxy.pump_py import PythonPumps, RecvBuffer
from rmqfast.proxy.session_connect import UpstreamConnect
from rmqfast.proxy.session_end import UPSTREAM_END_WAIT, SessionEnd
from rmqfast.proxy.session_health import SessionHealth, close_idle
from rmqfast.proxy.tls import is_tls
from rmqfast.proxy.writer import Sock, SocketWriter

if TYPE_CHECKING:
    from rmqfast.codec import ScanStats
    from rmqfast.settings.hostport import HostPort

if Pump is not None:
    from rmqfast._speedups import BufferBudget  # type: ignore[attr-defined]  # noqa: F401  (re-exported)

__all__ = [
    "BUDGET", "DEFAULT_BUFFER_BUDGET", "DEFAULT_FIRST_FRAME_TIMEOUT", "DEFAULT_FRAME_TIMEOUT", "REACTOR_REPOLL",
    "UPSTREAM_END_WAIT", "USE_REACTOR", "USE_URING", "PyBufferBudget", "RecvBuffer", "RelaySettings", "Session",
    "Sock", "SocketWriter", "close_idle", "connect_plain", "pin_mmap_threshold", "reactor_of",
]

log = logging.getLogger("rmqfast.relay")

#: Default of ``proxy.frame_timeout``: seconds a started frame may wait for its next bytes.
DEFAULT_FRAME_TIMEOUT = 30.0
#: Default of ``proxy.first_frame_timeout``: seconds a new connection may take to send its first frame.
DEFAULT_FIRST_FRAME_TIMEOUT = 10.0


class RelaySettings:
    """The part of the configuration a relay session needs (shared, updated on reload)."""

    def __init__(
        self,
        buffer_size: int,
        max_frame: int,
        max_header: int,
        connect_timeout: float,
        idle_timeout: float,
        frame_timeout: float = DEFAULT_FRAME_TIMEOUT,
        buffer_budget: int = DEFAULT_BUFFER_BUDGET,
        first_frame_timeout: float = DEFAULT_FIRST_FRAME_TIMEOUT,
    ) -> None:
        self.buffer_size = buffer_size
        self.max_frame = max_frame
        self.max_header = max_header
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.frame_timeout = frame_timeout  # 0: no frame-completion deadline
        self.first_frame_timeout = first_frame_timeout  # 0: no first-frame deadline
        self.buffer_budget = buffer_budget
        budget.BUDGET.limit = buffer_budget  # the process-wide budget follows the (re)loaded config


class Session(CompiledPumps, PythonPumps, UpstreamConnect, SessionEnd, SessionHealth, SessionCore):
    """A client connection and its upstream connection: the sockets and pumps around a
    :class:`rmqfast.proxy.core.SessionCore`.  Send limits come with the chain (its
    :class:`rmqfast.limits.filter.SendLimitFilter` gives the scanner its limiter)."""

    # Slots for the socket side's own attributes: with SessionCore's and those filters add, an
    # instance dict would pass the 30 keys CPython shares between instances and cost ~1.6 KB
    # per connection instead of its inline values.
    __slots__ = ("client", "upstreams", "settings", "events", "upstream", "last_activity", "_heard", "conn_id", "hub",
                 "_watchers", "_reactor", "_live", "_on_end", "_lost", "_end_wait", "started", "local_shortage")

    def __init__(
        self,
        role: str,
        client: Sock,
        client_addr: str,
        upstreams: list[HostPort],
        chain: FilterChain,
        stats: ScanStats,
        settings: RelaySettings,
        events: Any,
    ) -> None:
        super().__init__(role, client_addr, chain, stats)
        self.client = client
        self.upstreams = upstreams
        self.settings = settings
        self.events = events  # worker-level hooks: counters, session registry
        self.upstream: Sock | None = None
        self.last_activity = self.started = time.monotonic()
        # the upstream connect failed for the proxy's own lack of descriptors (not the upstream's fault)
        self.local_shortage = False
        # when the Python pumps last received from the upstream (broker health: hangs; see ``heard``)
        self._heard = self.last_activity
        self.conn_id = 0  # set by the worker; carried into sampled request records
        self.hub = gevent.get_hub()
        # socket -> (read watcher, write watcher), on the raw file descriptors (a dict from the first one on)
        self._watchers: dict[Sock, tuple[Any, Any]] | None = None
        self._reactor: Any = None  # the reactor the compiled pumps wait in (set by _pump_c)
        self._live = 0  # pumps serving without a greenlet that have not ended (serve)
        self._on_end: Callable[[], None] | None = None
        self._lost = False  # _upstream_lost ran (it runs once)
        self._end_wait: Any = None  # the greenlet that ends the session if the upstream pump does not

    @property
    def client_lock(self) -> Semaphore:
        """The client socket's write lock (made on first use; the session must be set up)."""
        out = self.to_client
        assert isinstance(out, SocketWriter)
        return out.lock

    @property
    def upstream_lock(self) -> Semaphore:
        """The upstream socket's write lock (made on first use; the session must be set up)."""
        out = self.to_upstream
        assert isinstance(out, SocketWriter)
        return out.lock

    def _out_of(self, sock: Sock | None) -> SocketWriter | None:
        """The one writer of ``sock`` (the pump forwarding into it and the local answers it waits
        for), once the session set them up."""
        if sock is None:
            return None
        if sock is self.client:
            return self.to_client  # type: ignore[return-value]
        if sock is self.upstream:
            return self.to_upstream  # type: ignore[return-value]
        return None

    @property
    def _outs(self) -> dict[Sock, SocketWriter]:
        """socket -> its writer (a view for inspection; the relay uses :meth:`_out_of`)."""
        return {sock: out for sock in (self.client, self.upstream) if (out := self._out_of(sock)) is not None}


    def _new_scanner(self, **kwargs: Any) -> FrameScanner:
        """A client-side scanner of the twin this module runs (``FrameScanner``: a test may swap it)."""
        return FrameScanner(self.stats, **kwargs)

    # Lifecycle ------------------------------------------------------------------------------

    def run(self) -> None:
        """Relay until both directions have ended."""
        done = Event()
        self.serve(done.set)
        done.wait()

    def serve(self, on_end: Callable[[], None]) -> None:
        """Relay; ``on_end()`` once both directions have ended.  With the compiled pumps in the
        reactor (no TLS) this returns as soon as both are parked there, and no greenlet waits for
        the connection; otherwise it returns when the connection has ended."""
        parked = False
        try:
            pin_mmap_threshold()
            upstream = self._connect()
            if upstream is None:
                return
            if self.closed:  # closed while the connect was under way (a drain, the idle sweep)
                upstream.close()
                return
            self.upstream = upstream
            self._setup(upstream)
            reactor = reactor_of(self.hub)
            if (reactor is not None and codec.is_compiled(self.c2u) and not (is_tls(self.client) or is_tls(upstream))
                    and not self.closed):
                self._reactor = reactor
                self._on_end = on_end
                self._live = 2
                parked = True
                self._launch(upstream, self.client, self.u2c, "upstream", False)
                self._launch(self.client, upstream, self.c2u, "client", True)
                return
            back = gevent.spawn(self._pump, upstream, self.client, self.u2c, "upstream", False)
            try:
                self._pump(self.client, upstream, self.c2u, "client", True)
                if not self.closed:  # a send to the upstream failed: its pump ends the session (_await_upstream_end)
                    back.join(timeout=session_end.UPSTREAM_END_WAIT)
                    if self._lost:
                        back.join()  # its end is under way (resends, answers): it closes when done
                    else:
                        self._end_after_upstream_wait()
            finally:
                self.close()
                back.join(timeout=5)
        finally:
            if not parked:
                self.close()  # (again) the client socket is the session's to close on every path
                on_end()

    def _setup(self, upstream: Sock) -> None:
        """The scanners, watchers and writers of both directions."""
        s = self.settings
        compiled = codec.is_compiled(FrameScanner)  # the limiter and in-flight table of the same twin
        self.inflight = codec.twin_of(FrameScanner, "InFlight")()
        tables = getattr(self.events, "tables", None)  # the worker's sessions by in-flight table
        if tables is not None:
            tables[self.inflight] = self
        self.c2u = FrameScanner(
            self.stats,
            actions=self.chain.request_actions,
            response_policy=False,
            max_frame_size=s.max_frame,
            max_header_size=s.max_header,
            inflight=self.inflight,
            direction=0,
            limiter=self.chain.limiter(compiled),
        )
        self.c2u.conn_id = self.conn_id
        self.c2u.delay_topics = self.chain.delay_topics  # [delay]: delayed sends of those topics go to policy
        self.c2u.policy_topics = self.chain.policy_topics  # every send of those topics goes to policy ([gray])
        # Requests from the broker to the client (39, 40, 307, 309...) are always relayed.
        self.u2c = FrameScanner(
            self.stats,
            response_policy=self.chain.response_policy,
            max_frame_size=s.max_frame,
            max_header_size=s.max_header,
            inflight=self.inflight,
            direction=1,
        )
        self.u2c.conn_id = self.conn_id
        self.u2c.address_map = self.chain.address_map(compiled)  # store hosts of records answers, in C
        self.to_client = SocketWriter(self.client, self)
        self.to_upstream = SocketWriter(upstream, self)

    def close(self) -> None:
        """Close both connections; a pump waiting on one of them wakes with EBADF and ends."""
        if self.closed:
            return
        self.closed = True
        if self.inflight is not None:
            self.inflight.abandon(self.stats)  # what was not answered by now never will be
            tables = getattr(self.events, "tables", None)
            if tables is not None:
                tables.pop(self.inflight, None)
        self.chain.on_close(self)
        self._detach_pumps()
        end_wait = self._end_wait
        if end_wait is not None:  # (not when it is what closes: it cleared the field first)
            self._end_wait = None
            end_wait.kill(block=False)
        watchers = [w for pair in self._watchers.values() for w in pair] if self._watchers else []
        self._watchers = None
        # Thrown into a pump waiting on one of these watchers (a fresh one: it carries a traceback).
        closed = OSError(errno.EBADF, "connection closed by the other side of the relay")
        self.hub.cancel_waits_close_and_then(watchers, closed, self._close_sockets)

    def _detach_pumps(self) -> None:
        """Take the pumps out of the reactor before the sockets close (the descriptor numbers
        are reused at once); a greenlet parked there wakes and sees the session closed."""
        reactor = self._reactor
        if reactor is None:
            return
        for out in (self.to_client, self.to_upstream):
            pump = out.pump if out is not None else None
            if pump is None:
                continue
            waiter = reactor.detach(pump)
            if waiter is not None:
                self.hub.loop.run_callback(waiter.switch, pump_c.P_EOF)

    def _close_sockets(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    # The pump -------------------------------------------------------------------------------
    #
    # The pumps talk to the raw non-blocking sockets under gevent's socket objects and wait on
    # libev watchers of their own: gevent's socket methods cost a getsockopt per sendall and a
    # Timeout object per recv, which was most of the relay's time.  Idle connections are found
    # by the worker's sweep (``last_activity``), not by per-call timeouts; ``close`` wakes any
    # pump waiting on a watcher.  With the compiled pump the watchers give way to the process's
    # reactor (``reactor_of``, ext/reactor.pxi): a pump waiting for its source is parked in one
    # epoll set that the hub steps in C once per event-loop turn, and its greenlet runs only for
    # the statuses that need Python.
    #
    # One writer per socket: a pump forwards into its destination; the answers the proxy makes
    # itself go out only at a frame boundary of that forwarded stream (``SessionCore.answer``), so
    # a local answer never lands inside a frame being forwarded (e.g. a large PULL answer).

    def _pump(
        self,
        src: Sock,
        dst: Sock,
        scanner: FrameScanner,
        side: str,
        from_client: bool,
    ) -> None:
        try:
            out = self._out_of(dst)
            if self.closed or out is None:
                return  # closed before this pump started (a connect-and-close health probe)
            if Pump is not None and codec.is_compiled(scanner) and not (is_tls(src) or is_tls(dst)):
                self._pump_c(src, dst, scanner, side, out, from_client)
            else:
                self._pump_py(src, dst, scanner, side, out, from_client)
        except OSError as exc:
            self._ended_by(exc, side)
        finally:
            out = self._out_of(dst)
            self._direction_ended(out, from_client, waited_by_run=True)
            if out is not None:
                self._forget_pump(out)  # its buffers (and budget share) go now, not when the session is collected

    def _watcher(self, sock: Sock, kind: int) -> Any:
        """The read (0) or write (1) watcher of ``sock``, made on first use (a pump parked in the
        reactor needs none)."""
        if self.closed:  # close() dropped them: the file descriptor may already be someone else's
            raise OSError(errno.EBADF, "connection closed by the other side of the relay")
        watchers = self._watchers
        if watchers is None:
            watchers = self._watchers = {}
        w = watchers.get(sock)
        if w is None:
            fd = sock.fileno()
            loop = self.hub.loop
            w = watchers[sock] = (loop.io(fd, 1), loop.io(fd, 2))
        return w[kind]

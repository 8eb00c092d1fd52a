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

An idle connection costs no greenlet: with the compiled pumps parked in the worker's reactor,
:meth:`Session.serve` returns once both are parked, and a greenlet is made only when a pump's
step needs Python (a policy frame, a wait for the destination, the end), for as long as it does.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import operator
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gevent
from gevent import socket
from gevent.event import Event
from gevent.lock import Semaphore
from greenlet import greenlet

from rmqfast import codec
from rmqfast.codec import EV_FORWARD, EV_POLICY, FrameScanner, Pump, code_slot
from rmqfast.codec import codes as C
from rmqfast.codec.tables import R_ONEWAY, result_index
from rmqfast.log import ctx
from rmqfast.proxy.connect import connect_plain, connect_tcp, to_gevent
from rmqfast.proxy.core import PumpState, SessionCore, Writer
from rmqfast.proxy.policy import FilterChain, Frame, error_response
from rmqfast.proxy.tls import is_tls

if TYPE_CHECKING:
    from rmqfast.codec import ScanStats
    from rmqfast.settings.hostport import HostPort

log = logging.getLogger("rmqfast.relay")

if Pump is not None:
    from rmqfast._speedups import (  # type: ignore[attr-defined]
        P_BOUNDARY,
        P_EOF,
        P_OS_ERROR,
        P_OVER_BUDGET,
        P_POLICY,
        P_WAIT_LOCK,
        P_WAIT_READ,
        P_WAIT_WRITE,
        P_YIELD,
        BufferBudget,
        Reactor,
    )

#: A connection's socket: a plain non-blocking socket (``_socket.socket``: what the worker accepts
#: and :func:`rmqfast.proxy.connect.connect_plain` opens), a gevent socket, or a TLS connection
#: (``rmqfast.proxy.tls.TlsSocket``).
Sock = Any

#: Default of ``proxy.buffer_budget``: bytes per worker for frames held whole beyond the base buffers.
DEFAULT_BUFFER_BUDGET = 64 * 1024 * 1024
#: Default of ``proxy.frame_timeout``: seconds a started frame may wait for its next bytes.
DEFAULT_FRAME_TIMEOUT = 30.0
#: Default of ``proxy.first_frame_timeout``: seconds a new connection may take to send its first frame.
DEFAULT_FIRST_FRAME_TIMEOUT = 10.0
#: connect errors that are the proxy's own shortage of descriptors or buffers (EMFILE, ENFILE,
#: ENOBUFS, ENOMEM): never the upstream's fault (rmqfast.server.accept.SHORTAGE_ERRNOS)
_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

#: After a send to the upstream failed, how long the session waits for the upstream-reading pump to
#: meet the end of the broken connection (milliseconds, normally) before it ends the session itself.
UPSTREAM_END_WAIT = 5.0


class PyBufferBudget:
    """The pure-Python twin of ``_speedups.BufferBudget`` (same two attributes)."""

    def __init__(self, limit: int = DEFAULT_BUFFER_BUDGET) -> None:
        self.limit = limit
        self.used = 0


#: One budget per process (a worker): every pump of every session reserves from it.
BUDGET: Any = BufferBudget(DEFAULT_BUFFER_BUDGET) if Pump is not None else PyBufferBudget()

#: Whether compiled pumps wait in the process's reactor (``_speedups.Reactor``: one epoll set
#: stepped in C per event-loop turn) rather than on a libev watcher each.
#: ``RMQFAST_RELAY_REACTOR=0`` turns it off (a comparison aid).
USE_REACTOR = os.environ.get("RMQFAST_RELAY_REACTOR", "1") != "0"
#: Extra ``epoll_wait`` calls a reactor turn makes while the previous one found several sources
#: ready (``Reactor.repoll``): the sources that became ready meanwhile are stepped without the
#: hub's wait, libev's getpid and the callback into the turn.  ``RMQFAST_REACTOR_REPOLL=0``: one
#: poll per turn (a comparison aid).
REACTOR_REPOLL = int(os.environ.get("RMQFAST_REACTOR_REPOLL", "4") or 0)

#: Whether a reactor issues its pumps' receives and sends through io_uring, one
#: ``io_uring_enter`` for all the pumps a poll found ready (``Reactor(uring=...)``; the reactor
#: falls back to plain system calls where the kernel or a seccomp profile refuses io_uring, and
#: logs why).  ``RMQFAST_URING=0`` turns it off.
USE_URING = os.environ.get("RMQFAST_URING", "1") != "0"

_reactors: dict[Any, Any] = {}  # hub -> (Reactor, its libev watcher)


def reactor_of(hub: Any) -> Any:
    """The reactor of ``hub``'s event loop (made and watched on first use), or None when the
    compiled pump is not there or the reactor is turned off."""
    if Pump is None or not USE_REACTOR:
        return None
    entry = _reactors.get(hub)
    if entry is None:
        reactor = Reactor(uring=USE_URING)
        reactor.repoll = REACTOR_REPOLL
        if reactor.uring:
            log.info("relay reactor uses io_uring")
        else:
            log.info("relay reactor uses plain system calls", extra=ctx(io_uring=reactor.uring_off))
        watcher = hub.loop.io(reactor.fileno(), 1)
        watcher.start(reactor.turn)
        entry = _reactors[hub] = (reactor, watcher)
    return entry[0]


class _Heard:
    """``Session.heard``, made when asked for (the failover sweep, for sessions with a send in
    flight): ``[0]`` is when bytes last came from the upstream (seconds, monotonic), the later of
    what the Python pumps stored and the last receive of the compiled pump reading the upstream
    (one parked in the reactor receives without Python); storing into ``[0]`` moves it on."""

    __slots__ = ("session",)

    def __init__(self, session: Session) -> None:
        self.session = session

    def __getitem__(self, i: int) -> float:
        return self.session.heard_at()

    def __setitem__(self, i: int, value: float) -> None:
        self.session._heard = value


_malloc_pinned = False


def pin_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at 128 KiB (once per process).

    glibc raises the threshold to the size of the largest mapped block freed (up to 32 MiB);
    from then on big buffers (the Python pump's, policy frames copied for filters) come from
    the heap and stay resident after hostile traffic (bench/relay_memory.py, Python pump: 73 MiB
    instead of 27-35 MiB after 200 connections sent 1 MiB of a big policy frame each).  Setting
    it fixes it at the default.
    """
    global _malloc_pinned
    if _malloc_pinned:
        return
    _malloc_pinned = True
    try:
        ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (glibc; a no-op elsewhere)
    except (OSError, AttributeError):
        pass


def _skip_reader(scanner: Any) -> Callable[[Any], int]:
    """How to read a scanner's ``_skip`` (bytes of the current frame still to come)."""
    if codec.is_compiled(scanner):  # asks rmqfast.codec; never loads the extension itself
        from rmqfast._speedups import scanner_skip  # type: ignore[attr-defined]

        return scanner_skip  # type: ignore[no-any-return]
    return operator.attrgetter("_skip")


@functools.lru_cache(maxsize=1024)  # a worker's upstreams are few
def _addr_text(hp: HostPort) -> str:
    """``str(hp)``, one string per upstream shared by its sessions (not 64 bytes per connection)."""
    return str(hp)


def _raw(sock: Any) -> Any:
    """What a pump reads and writes without waiting: the plain socket under a gevent socket (or
    the TLS connection's non-blocking I/O), or ``sock`` itself when it is a plain socket."""
    return getattr(sock, "_sock", sock)


class _Out(Writer):
    """The one writer of a socket (:class:`rmqfast.proxy.core.Writer`): ``lock`` is held by
    whoever must wait in the middle of a write.  It is made when first asked for (most
    connections never have a write that waits: ~230 bytes per connection for the two locks and
    the reactor's view of them); until then no one holds it."""

    __slots__ = ("sock", "_lock", "session", "failed")

    def __init__(self, sock: Sock, session: Session) -> None:
        super().__init__()
        self.sock = sock
        self._lock: Semaphore | None = None
        self.session = session
        self.failed = False  # a write raised (the peer reset the connection, say)

    @property
    def lock(self) -> Semaphore:
        """The write lock, made on first use.  A compiled pump forwarding into this socket is told
        at once (``pump.locked``; it checks before every send), before anyone can hold it."""
        lock = self._lock
        if lock is None:
            lock = self._lock = Semaphore()
            pump = self.pump
            if pump is not None and not isinstance(pump, PumpState):
                pump.locked = lock.locked
        return lock

    def locked(self) -> bool:
        lock = self._lock
        return lock is not None and lock.locked()

    # As the wake-up of the compiled pump forwarding into this socket while it is parked in the
    # reactor (the session serves without a greenlet): what that pump's greenlet needs when the
    # reactor hands it a status for Python.  The reactor calls :meth:`switch` (in the hub) where
    # it would wake a parked greenlet's Waiter; no object of its own per pump.

    @property
    def from_client(self) -> bool:
        """Whether the pump forwarding into this socket reads from the client."""
        return self is self.session.to_upstream

    @property
    def scanner(self) -> Any:
        session = self.session
        return session.c2u if self is session.to_upstream else session.u2c

    @property
    def side(self) -> str:
        """The side the pump forwarding into this socket reads from (as ``_pump``'s ``side``)."""
        return "client" if self is self.session.to_upstream else "upstream"

    def switch(self, st: int) -> None:
        """A status for Python: a greenlet runs the pump from it until the pump parks again or ends
        (called in the hub: by the reactor's turn, or by a callback the session scheduled)."""
        session = self.session
        greenlet(session._drive, parent=session.hub).switch(self, st)

    def write_at_boundary(self, data: Any) -> bool:
        """Write a frame the proxy made itself, for which the caller found the stream at a frame
        boundary; False (nothing written) when another writer held the lock and the pump
        forwarding into this socket left the boundary before the lock came free: the lock's
        release does not stop the pump (``locked()`` is False before a waiter wakes), so it may
        send the head of its next frame first.  The caller then queues the frame for the next
        boundary (``hold``)."""
        lock = self._lock
        if lock is None or not lock.locked():
            self.write(data)  # a write that must wait keeps the lock from its first byte on
            return True
        with lock:
            if not self.at_boundary():
                return False
            raw = _raw(self.sock)
            wwatch = self.session._watcher(self.sock, 1)
            rest = memoryview(data)
            while rest:
                try:
                    n = raw.send(rest)
                except BlockingIOError:
                    self.session.hub.wait(wwatch)
                    continue
                except OSError:
                    self.failed = True
                    raise
                rest = rest[n:]
        return True

    def write(self, data: Any) -> None:
        """Write all of ``data``; greenlets writing the same socket never interleave.

        Most writes complete in one ``send`` without yielding, and greenlets only switch when
        one yields, so the lock is taken only when a write must wait for buffer space.
        """
        raw = _raw(self.sock)
        lock = self._lock
        if lock is None or not lock.locked():
            try:
                n = raw.send(data)
            except BlockingIOError:
                n = 0
            except OSError:
                self.failed = True
                raise
            if n == len(data):
                return
            data = memoryview(data)[n:]
        session = self.session
        wwatch = session._watcher(self.sock, 1)
        with self.lock:
            while data:
                try:
                    n = raw.send(data)
                except BlockingIOError:
                    session.hub.wait(wwatch)
                    continue
                except OSError:
                    self.failed = True
                    raise
                data = data[n:]


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
        BUDGET.limit = buffer_budget  # the process-wide budget follows the (re)loaded config


def close_idle(sessions: Any, limit: float, now: float | None = None,
               counted: Callable[[str, str], None] | None = None) -> int:
    """Close every session with no bytes received on either side for ``limit`` seconds, and
    every session whose peer stopped sending in the middle of a frame for longer than the
    ``frame_timeout`` of its settings (slowloris: a half-sent frame may hold a grown buffer).
    ``counted(role, reason)`` is told of each close (reason ``idle``, ``first_frame`` or
    ``frame_stalled``: the worker's ``rmqfast_deadline_closes_total``)."""
    now = time.monotonic() if now is None else now
    count = counted if counted is not None else _not_counted
    now_ns = int(now * 1e9)
    closed = 0
    for s in list(sessions):
        if s.closed:
            continue
        if s.idle_for(now) > limit:
            log.info("closing idle connection", extra=ctx(role=s.role, client=s.client_addr))
            s.close()
            count(s.role, "idle")
            closed += 1
            continue
        fft = s.settings.first_frame_timeout
        if fft > 0 and now - s.started > fft and not _sent_a_frame(s):
            # half-open and slowloris clients: a connection that never sent a frame holds a cap's slot
            log.info("closing connection: no first frame in time",
                     extra=ctx(role=s.role, client=s.client_addr, first_frame_timeout=fft))
            s.close()
            count(s.role, "first_frame")
            closed += 1
            continue
        ft = s.settings.frame_timeout
        if ft > 0:
            side, stalled = s.stalled_for(now_ns)
            if stalled > ft:
                log.warning(
                    "closing connection: a frame stopped arriving",
                    extra=ctx(role=s.role, side=side, client=s.client_addr, seconds=round(stalled, 1),
                              frame_timeout=ft),
                )
                s.close()
                count(s.role, "frame_stalled")
                closed += 1
    return closed


def _not_counted(role: str, reason: str) -> None:
    pass


def _sent_a_frame(s: Session) -> bool:
    """Has the client sent the head of a whole frame (a request or an answer) yet?  (Not judged
    while the session is still connecting upstream: ``connect_timeout`` bounds that.)"""
    c2u = s.c2u
    return c2u is None or c2u.requests > 0 or c2u.responses > 0


class Session(SessionCore):
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
        assert isinstance(out, _Out)
        return out.lock

    @property
    def upstream_lock(self) -> Semaphore:
        """The upstream socket's write lock (made on first use; the session must be set up)."""
        out = self.to_upstream
        assert isinstance(out, _Out)
        return out.lock

    def _out_of(self, sock: Sock | None) -> _Out | None:
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
    def _outs(self) -> dict[Sock, _Out]:
        """socket -> its writer (a view for inspection; the relay uses :meth:`_out_of`)."""
        return {sock: out for sock in (self.client, self.upstream) if (out := self._out_of(sock)) is not None}

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
                    back.join(timeout=UPSTREAM_END_WAIT)
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
        self.to_client = _Out(self.client, self)
        self.to_upstream = _Out(upstream, self)

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
                self.hub.loop.run_callback(waiter.switch, P_EOF)

    @property
    def heard(self) -> _Heard:
        """``[0]``: when bytes last came from the upstream (see :class:`_Heard`)."""
        return _Heard(self)

    def heard_at(self) -> float:
        """When bytes last came from the upstream (seconds, monotonic)."""
        at = self._heard
        out = self.to_client  # the writer the upstream-reading pump forwards into
        pump = out.pump if out is not None else None
        if pump is not None and not isinstance(pump, PumpState):
            got = pump.last_receive / 1e9  # a compiled pump (-1 ns: nothing received yet)
            if got > at:
                return got
        return at

    @property
    def _parked(self) -> list[Any]:
        """The compiled pumps attached to the reactor (none once the session closed)."""
        if self._reactor is None or self.closed:
            return []
        return [out.pump for out in (self.to_client, self.to_upstream) if out is not None and out.pump is not None]

    def _close_sockets(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    def idle_for(self, now: float) -> float:
        last = self.last_activity
        for pump in self._parked:  # pumps in the reactor note their receives themselves
            got = pump.last_receive / 1e9
            if got > last:
                last = got
        return now - last

    def stalled_for(self, now_ns: int) -> tuple[str, float]:
        """(side, seconds) of the longest wait for the rest of a frame a peer started sending."""
        worst, side = 0.0, ""
        for name, sock in (("client", self.upstream), ("upstream", self.client)):  # the pump writing to sock
            out = self._out_of(sock)
            since = out.pump.stalled_since if out is not None and out.pump is not None else 0
            if since > 0 and (now_ns - since) / 1e9 > worst:
                worst, side = (now_ns - since) / 1e9, name
        return side, worst

    def _connect(self) -> Sock | None:
        errors = []
        tls = getattr(self.events, "tls", None)
        for hp in self.upstreams:
            try:
                if tls is not None and tls.upstream_enabled(self.role):  # rmqfast.proxy.tls: on a gevent socket
                    sock = connect_tcp(hp.host, hp.port, self.settings.connect_timeout)
                    sock = tls.connect(self.role, sock, hp.host, self.settings.connect_timeout)
                else:
                    sock = connect_plain(hp.host, hp.port, self.settings.connect_timeout)
            except OSError as exc:
                errors.append(f"{hp}: {exc.strerror or exc}")
                if exc.errno in _SHORTAGE:  # the proxy's own shortage: the next upstream would fail alike
                    self.local_shortage = True
                    break
                self.events.upstream_error(self.role)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.upstream_addr = _addr_text(hp)
            self.events.upstream_ok(self, hp)
            return sock
        reason = "; ".join(errors)
        log.warning("upstream unreachable", extra=ctx(role=self.role, client=self.client_addr, errors=reason))
        self._refuse(f"rmqfast: upstream unreachable ({reason}); retry later")
        return None

    def _refuse(self, remark: str) -> None:
        """Answer what the client sends in the next moment with SYSTEM_ERROR, then close."""
        scanner = FrameScanner(self.stats, actions=bytes([1]) * len(self.chain.request_actions))
        if self.closed:  # closed while the connect was under way: nothing to answer
            return
        buf = bytearray(65536)
        filled = 0
        self.client = to_gevent(self.client)  # this path waits with gevent's blocking calls
        self.client.settimeout(1.0)
        try:
            while True:
                n = self.client.recv_into(memoryview(buf)[filled:])
                if n == 0:
                    break
                filled += n
                pos = 0
                while True:
                    ev, a, b = scanner.scan(buf, pos, filled)
                    if ev != EV_POLICY:
                        break
                    frame = Frame(bytes(buf[a:b]), scanner.code, scanner.flag, scanner.opaque)
                    slot = code_slot(frame.code)
                    if frame.is_oneway:
                        self.stats.count_result(slot, R_ONEWAY)
                    else:
                        self.stats.count_result(slot, result_index(C.SYSTEM_ERROR))
                        self.client.sendall(error_response(frame, C.SYSTEM_ERROR, remark))
                    pos = b
                if ev != EV_FORWARD or filled - pos >= len(buf) - 1024:
                    break
                buf[0 : filled - pos] = buf[pos:filled]
                filled -= pos
        except (OSError, ValueError):
            pass
        finally:
            self.close()

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

    def _ended_by(self, exc: OSError, side: str) -> None:
        if self.closed or exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.EBADF, errno.ENOTCONN, None):
            log.debug("connection ended", extra=ctx(role=self.role, side=side, client=self.client_addr,
                                                     error=str(exc)))
        else:
            log.info("connection error", extra=ctx(role=self.role, side=side, client=self.client_addr, error=str(exc)))

    def _forget_pump(self, out: _Out) -> None:
        """The pump writing to ``out`` ended: its buffers (and budget share) go now, not when the
        session is collected; ``heard`` keeps the upstream pump's last receive, not the pump."""
        if out is self.to_client:
            self._heard = self.heard_at()
        out.pump = None

    def _direction_ended(self, out: _Out | None, from_client: bool, waited_by_run: bool = False) -> None:
        """The pump forwarding into ``out`` ended: the session ends with it (after answering what
        is in flight when the upstream ended), unless the client's direction ended on a failed
        send to the upstream (:meth:`_await_upstream_end`)."""
        if from_client and out is not None and self._upstream_send_failed(out):
            self._await_upstream_end(out, waited_by_run)
            return
        if not from_client and not self.closed:
            self._upstream_lost()
        self.close()

    def _upstream_send_failed(self, out: _Out) -> bool:
        """Whether the client's direction (forwarding into ``out``) ended because a send to the
        upstream failed: the broker's side broke (a reset, say), not the client's."""
        if self.closed or out is not self.to_upstream:
            return False
        pump = out.pump
        return out.failed or (pump is not None and not isinstance(pump, PumpState) and pump.send_failed)

    def _await_upstream_end(self, out: _Out, waited_by_run: bool = False) -> None:
        """The client's direction ended on a failed send to the upstream.  Closing now would drop
        the answers the broker sent before it broke (still to be read) and the requests in flight
        (never answered: a client may wait out its whole timeout).  So only that direction ends:
        the upstream-reading pump relays what is left and meets the end itself, which answers what
        is still in flight (:meth:`_upstream_lost`) and closes.  Bounded by UPSTREAM_END_WAIT
        (``run`` waits for that pump itself when the client's direction ran in its greenlet)."""
        pump = out.pump
        if self._reactor is not None and pump is not None and not isinstance(pump, PumpState):
            self._reactor.detach(pump)  # the client's bytes are not read any more
        log.debug("send to the upstream failed; waiting for the upstream's end",
                  extra=ctx(role=self.role, client=self.client_addr, upstream=self.upstream_addr))
        if not waited_by_run:
            self._end_wait = gevent.spawn_later(UPSTREAM_END_WAIT, self._end_after_upstream_wait)

    def _end_after_upstream_wait(self) -> None:
        self._end_wait = None
        # The upstream pump did not end by itself: end the session as it would (unless its end is
        # under way: _upstream_lost may be waiting for resends, and closing now would drop them).
        if not self.closed and not self._lost:
            self._upstream_lost()
            self.close()

    def _upstream_lost(self) -> None:
        """The upstream connection ended first: the worker hears of it (broker health) and may answer
        the client's requests still waiting (rmqfast.proxy.failover.answer_in_flight) before the close."""
        if self._lost:
            return
        self._lost = True
        hook = getattr(self.events, "upstream_lost", None)
        if hook is None:
            return
        try:
            hook(self)
        except Exception:  # bookkeeping must never break the close
            log.exception("upstream_lost hook failed", extra=ctx(role=self.role, client=self.client_addr))

    def _protocol_error(self, side: str, scanner: FrameScanner) -> None:
        # One log line (the scanner counted it); only this connection closes.
        log.warning(
            "protocol error; closing connection",
            extra=ctx(role=self.role, side=side, client=self.client_addr, upstream=self.upstream_addr,
                      error=scanner.error),
        )

    def _over_budget(self, side: str, need: int) -> None:
        log.warning(
            "frame too large for the worker's buffer budget; closing connection",
            extra=ctx(role=self.role, side=side, client=self.client_addr, frame_bytes=need,
                      budget=BUDGET.limit, in_use=BUDGET.used,
                      hint="frames that policy reads whole (admin codes, limited sends, batches) are held in "
                           "memory; raise proxy.buffer_budget if legitimate clients send frames this large"),
        )

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

    def _pump_c(
        self,
        src: Sock,
        dst: Sock,
        scanner: FrameScanner,
        side: str,
        out: _Out,
        from_client: bool,
    ) -> None:
        """The compiled pump on libev watchers of its own (the reactor is off): C receives, scans
        and forwards; Python waits and does policy.  With the reactor, :meth:`_launch` and
        :meth:`_drive` run the same loop.

        ``self.closed`` is checked before every step: once closed, the file descriptor
        numbers may already belong to other connections.
        """
        pump = Pump(scanner, src.fileno(), dst.fileno(), self.settings.buffer_size, BUDGET)
        out.pump = pump
        rwatch = self._watcher(src, 0)
        wwatch = self._watcher(dst, 1)
        dst_lock = out.lock
        wait = self.hub.wait
        step = pump.step
        locked = dst_lock.locked
        policy = self.policy
        heard = not from_client
        st = step(not locked())
        while not self.closed:
            if st == P_WAIT_READ:
                wait(rwatch)
                self.last_activity = now = time.monotonic()
                if heard:
                    self._heard = now
            elif st == P_WAIT_WRITE or st == P_WAIT_LOCK:
                with dst_lock:
                    while not self.closed:
                        st = step(True)
                        if st != P_WAIT_WRITE:
                            break
                        wait(wwatch)
                continue
            elif st == P_BOUNDARY:
                self.flush_answers(out)
            elif st == P_POLICY:
                frame = Frame(pump.frame(), scanner.code, scanner.flag, scanner.opaque, scanner.limited,
                              scanner.records)
                pump.consume()
                if not policy(out, frame, from_client):
                    return
            elif st == P_YIELD:
                self.last_activity = now = time.monotonic()
                if heard:
                    self._heard = now
                gevent.sleep(0)
            else:
                self._pump_ended(st, pump, scanner, side)
                return
            if self.closed:
                return
            st = step(not locked())

    # Pumps parked in the reactor without a greenlet ------------------------------------------
    #
    # ``_launch`` attaches a compiled pump and parks it with the writer of its destination
    # (``_Out``) as its wake-up: while the pump only waits for its source, the reactor steps it in C
    # and no greenlet exists for it.  A status that needs Python makes a greenlet (``_Out.switch``)
    # that runs ``_drive`` from that status, the same loop as ``_pump_c``, until the pump parks
    # again (the greenlet ends) or ends (``_pump_done``; the session's ``on_end`` once both have).
    # Edges that arrive while the greenlet runs are kept by the reactor (``ready_in``) and stepped
    # by the ``park`` that ends it.

    def _launch(self, src: Sock, dst: Sock, scanner: Any, side: str, from_client: bool) -> None:
        """Start one direction parked in the reactor (never raises: a failure ends it)."""
        out = self._out_of(dst)
        assert out is not None and out.scanner is scanner and out.side == side and out.from_client == from_client
        if self.closed:  # the other direction failed to start: attach nothing any more
            self._pump_done(out)
            return
        try:
            out.pump = pump = Pump(scanner, src.fileno(), dst.fileno(), self.settings.buffer_size, BUDGET)
            lock = out._lock  # None: the pump sends freely until a lock is made (_Out.lock tells it)
            self._reactor.attach(pump, lock.locked if lock is not None else None)
            try:
                st = self._reactor.park(pump, out)
            except Exception:
                st = P_YIELD  # the greenlet steps again itself and meets the error there
        except Exception as exc:
            log.warning("relay direction failed to start",
                        extra=ctx(role=self.role, side=side, client=self.client_addr, error=str(exc)))
            self._pump_done(out)
            return
        if st >= 0:  # Python must act at once: from a callback in the hub, not this greenlet
            self.hub.loop.run_callback(out.switch, st)

    def _drive(self, out: _Out, st: int) -> None:
        """The greenlet of a parked pump (the one forwarding into ``out``), from a status that needs
        Python; nothing escapes it (its parent is the hub)."""
        try:
            if self._drive_loop(out, st):
                return  # parked again: this greenlet ends
        except OSError as exc:
            self._ended_by(exc, out.side)
        except BaseException:
            log.exception("relay direction failed", extra=ctx(role=self.role, side=out.side, client=self.client_addr))
        self._pump_done(out)

    def _drive_loop(self, out: _Out, st: int) -> bool:
        """``_pump_c``'s loop for a pump in the reactor; True when it is parked again."""
        pump = out.pump
        locked = out.locked  # the lock may be made in this loop (a write that waits)
        step = pump.step
        park = self._reactor.park
        while not self.closed:
            if st == P_WAIT_READ:
                st = park(pump, out)
                if st < 0:
                    return True
                continue
            if st == P_WAIT_WRITE or st == P_WAIT_LOCK:
                wwatch = self._watcher(out.sock, 1)
                with out.lock:
                    while not self.closed:
                        st = step(True)
                        if st != P_WAIT_WRITE:
                            break
                        self.hub.wait(wwatch)
                continue
            if st == P_BOUNDARY:
                self.flush_answers(out)
            elif st == P_POLICY:
                scanner = out.scanner
                frame = Frame(pump.frame(), scanner.code, scanner.flag, scanner.opaque, scanner.limited,
                              scanner.records)
                pump.consume()
                if not self.policy(out, frame, out.from_client):
                    return False
            elif st == P_YIELD:
                gevent.sleep(0)
            else:
                self._pump_ended(st, pump, out.scanner, out.side)
                return False
            if self.closed:
                return False
            st = step(not locked())
        return False

    def _pump_done(self, out: _Out) -> None:
        """A parked pump (the one forwarding into ``out``) ended: what ``_pump`` does when its loop
        ends; ``on_end`` after the last."""
        try:
            self._direction_ended(out, out.from_client)
            self._forget_pump(out)
        finally:
            self._live -= 1
            if self._live == 0 and self._on_end is not None:
                on_end, self._on_end = self._on_end, None
                try:
                    on_end()
                except Exception:
                    log.exception("session end hook failed", extra=ctx(role=self.role, client=self.client_addr))

    def _pump_ended(self, st: int, pump: Any, scanner: FrameScanner, side: str) -> None:
        """The compiled pump stopped for good (end of stream, error, over budget): say why."""
        if st == P_OS_ERROR:
            raise OSError(pump.errno_value, os.strerror(pump.errno_value))
        if st == P_OVER_BUDGET:
            self._over_budget(side, pump.need)
        elif st != P_EOF:  # P_PROTOCOL_ERROR
            self._protocol_error(side, scanner)

    def _pump_py(
        self,
        src: Sock,
        dst: Sock,
        scanner: FrameScanner,
        side: str,
        out: _Out,
        from_client: bool,
    ) -> None:
        """The same loop in Python, for the pure-Python scanner (and as the C pump's reference)."""
        state = PumpState()
        out.pump = state
        rb = _RecvBuffer(self.settings.buffer_size)
        skip_of = _skip_reader(scanner)
        wait = self.hub.wait
        rwatch = self._watcher(src, 0)
        raw = _raw(src)
        recv_into = raw.recv_into
        monotonic_ns = time.monotonic_ns
        heard = not from_client
        readable = True  # try a read before waiting for readiness
        try:
            while not self.closed:
                if state.hold and skip_of(scanner) == 0:
                    self.flush_answers(out)
                if not readable:
                    wait(rwatch)
                try:
                    n = recv_into(rb.view[rb.filled:])
                except BlockingIOError:
                    readable = False
                    continue
                if n == 0:
                    return
                # A short read drained the socket: wait for readiness first next time (saves a
                # failing recv per message when clients send one request at a time).
                readable = n == len(rb.buf) - rb.filled or getattr(raw, "eof_pending", False)
                now = monotonic_ns()
                self.last_activity = at = now / 1e9
                if heard:
                    self._heard = at
                state.stalled_since = 0
                rb.filled += n
                need = self._relay_received(rb, scanner, skip_of, out, from_client)
                if need is None:
                    return
                if need < 0:
                    self._protocol_error(side, scanner)
                    return
                if not rb.fit(need):
                    self._over_budget(side, need)
                    return
                if rb.filled or skip_of(scanner):
                    state.stalled_since = now
        finally:
            rb.release()

    def _relay_received(
        self, rb: _RecvBuffer, scanner: FrameScanner, skip_of: Callable[[Any], int], out: _Out, from_client: bool
    ) -> int | None:
        """Forward what the buffer holds up to the last frame boundary (whole policy frames
        through :meth:`policy`), keep the rest at its start.  Returns the bytes the scanner
        needs in the buffer next (0: any), -1 on a protocol error, None when policy closes."""
        state = out.pump
        buf, view, filled = rb.buf, rb.view, rb.filled
        write = out.write
        scan = scanner.scan
        start = pos = 0
        while True:
            end = filled
            if state.hold:  # a local answer waits: scan no further than the current frame
                skip = skip_of(scanner)
                if skip == 0:
                    self.flush_answers(out)
                elif pos + skip < filled:
                    end = pos + skip
            ev, a, b = scan(buf, pos, end)
            if a > start:
                state.at_boundary = False
                write(view[start:a])
                start = a
                state.at_boundary = skip_of(scanner) == 0
            if ev == EV_FORWARD:
                if end < filled and b == 0:
                    pos = a  # stopped at the end of a frame for a local answer: go on
                    continue
                rb.keep_from(start)
                return b
            if ev != EV_POLICY:
                return -1
            frame = Frame(bytes(view[a:b]), scanner.code, scanner.flag, scanner.opaque, scanner.limited,
                          scanner.records)
            if not self.policy(out, frame, from_client):
                return None
            start = pos = b


class _RecvBuffer:
    """The Python pump's receive buffer: ``size`` bytes, grown (from the worker's BUDGET) while
    a frame that must be read whole is larger, back to ``size`` as soon as the rest fits."""

    __slots__ = ("size", "buf", "view", "filled", "held")

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.filled = 0
        self.held = 0  # bytes of the buffer beyond ``size``, reserved from BUDGET

    def keep_from(self, start: int) -> None:
        """Drop the bytes before ``start`` (forwarded); the rest moves to the front."""
        rest = self.filled - start
        if rest and start:
            self.buf[0:rest] = self.buf[start : self.filled]
        self.filled = rest

    def _replace(self, size: int) -> None:
        new = bytearray(size)
        new[0 : self.filled] = self.buf[0 : self.filled]
        self.view.release()
        self.buf = new
        self.view = memoryview(new)

    def fit(self, need: int) -> bool:
        """Size the buffer for a frame the scanner needs ``need`` bytes of; False: over budget."""
        if need > len(self.buf) and self.filled == len(self.buf):
            # A frame that needs policy (or a huge header) is larger than the buffer (the
            # scanner checked it against the frame limit already): grow as its bytes arrive,
            # so that memory and the budget follow what was received.
            grow_to = min(need, 2 * len(self.buf))
            if BUDGET.used - self.held + (grow_to - self.size) > BUDGET.limit:
                return False
            self._replace(grow_to)
            BUDGET.used += grow_to - self.size - self.held
            self.held = grow_to - self.size
        elif self.held and self.filled <= self.size and need <= self.size:
            self._replace(self.size)  # back to the base size as soon as the rest fits
            BUDGET.used -= self.held
            self.held = 0
        return True

    def release(self) -> None:
        self.view.release()
        BUDGET.used -= self.held
        self.held = 0

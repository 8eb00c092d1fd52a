"""A gRPC server on libnghttp2 (``[grpc] server = "h2"``) for :class:`~rmqfast.grpcfront.service.MessagingService`.

An asyncio Protocol per connection on the front's event loop (uvloop) drives an nghttp2 server
session (:mod:`rmqfast.grpcfront._h2build`: the callbacks are C and hand Python one batch of event
records per read).  This module does the gRPC part: 5-byte length-prefixed messages bounded by
``max_body_size``, ``grpc-timeout`` (the handler's ``time_remaining()``; past it the handler is
cancelled and the call answered ``DEADLINE_EXCEEDED``), the ``grpc-status``/``grpc-message``
trailers, unary, server-streaming and bidi-streaming calls, ``UNIMPLEMENTED`` for unknown methods;
a stream reset by the client, or its connection lost, cancels its handler task.  The service's
handlers run unchanged: the context they get (:class:`Call`) has ``peer()``,
``invocation_metadata()`` and ``time_remaining()``.

Bounds (clients are untrusted): SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_MAX_HEADER_LIST_SIZE
(checked in C while the headers arrive); the connection bounds of :mod:`rmqfast.grpcfront.gate`
(``max_connections`` handshaken connections per process, ``max_connections_per_client`` per client
address, the handshake deadline, the idle timeout; a connection past one is closed, counted and
logged at most every 10 s per reason); a message longer than ``max_body_size`` ends its call with
``RESOURCE_EXHAUSTED``; the connection's flow-control window is given back only when a message is
handed to its handler (bidi: when the handler takes it), so the bytes a connection has buffered in
Python are bounded by that window; a handler streaming answers waits while its stream holds more
than ``_WRITE_MARK`` bytes the client has not taken.  A protocol error closes that connection
only (after nghttp2's GOAWAY).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import struct
from collections.abc import AsyncIterator
from typing import Any

from rmqfast.grpcfront.gate import Gate, client_key, closed_counter
from rmqfast.grpcfront.h2wire import (
    BIDI,
    DEADLINE_EXCEEDED,
    INTERNAL,
    OK_TRAILER,
    RESOURCE_EXHAUSTED,
    UNARY,
    UNIMPLEMENTED,
    UNKNOWN,
    Method,
    methods_of,
    parse_timeout,
    trailer,
)
from rmqfast.heap import Trimmer

log = logging.getLogger("rmqfast.grpc")

try:
    from rmqfast.grpcfront._h2 import ffi, lib  # type: ignore[import-not-found]
except ImportError as _exc:  # pragma: no cover - depends on the build
    ffi = lib = None
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

MAX_STREAMS = 256  # SETTINGS_MAX_CONCURRENT_STREAMS per connection
MAX_HEADER_LIST = 16 * 1024  # SETTINGS_MAX_HEADER_LIST_SIZE
STREAM_WINDOW = 1 << 20
_WRITE_MARK = 1 << 20  # bytes queued on a stream past which a streaming handler waits
_QUEUE = 32  # client messages of a bidi stream waiting for its handler
_CLOSE_GRACE = 5.0  # s a connection closed by a bound has to take its GOAWAY before it is cut

_NGHTTP2_CANCEL = 0x8

_EV = struct.Struct(">cII")
_PREFIX = struct.Struct(">BI")
_EOF = object()


class H2Unavailable(RuntimeError):
    """The nghttp2 binding was not built (libnghttp2-dev missing at build time)."""


def available() -> None:
    """Raise :class:`H2Unavailable` with what to do when the binding is missing."""
    if lib is None:
        raise H2Unavailable(f'[grpc] server = "h2" needs rmqfast.grpcfront._h2, which is not built ({_IMPORT_ERROR}); '
                            'install libnghttp2-dev (Debian) and rebuild (make install, or '
                            'python -m rmqfast.grpcfront._h2build), or set [grpc] server = "grpcio"')


class Call:
    """One gRPC call (an HTTP/2 stream); also the context its handler gets."""

    __slots__ = ("conn", "sid", "method", "md", "deadline", "task", "inbuf", "msg", "queue", "finished", "timer",
                 "writable", "ended", "owed")

    def __init__(self, conn: H2Protocol, sid: int, method: Method, md: bytes, deadline: float | None) -> None:
        self.conn = conn
        self.sid = sid
        self.method = method
        self.md = md
        self.deadline = deadline
        self.task: asyncio.Task[Any] | None = None
        self.inbuf: bytearray | None = None
        self.msg: bytes | None = None
        self.queue: asyncio.Queue[Any] | None = None
        self.finished = False  # trailers submitted (or the stream reset)
        self.ended = False  # the client half-closed
        self.timer: asyncio.TimerHandle | None = None
        self.writable: asyncio.Event | None = None
        self.owed = 0  # connection window held by ``msg``: given back when a handler takes it

    # the context the service's handlers use
    def peer(self) -> str:
        return self.conn.peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        parts = self.md.decode("latin-1").split("\0")
        return tuple(zip(parts[0:-1:2], parts[1::2], strict=True))

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self.conn.loop.time())

    async def requests(self) -> AsyncIterator[Any]:
        """The client's messages of a bidi call, deserialized, until it half-closes."""
        q = self.queue
        assert q is not None
        deser = self.method.deser
        while True:
            item = await q.get()
            if item is _EOF:
                return
            self.conn.consumed(len(item) + 5)
            yield deser(item)


class H2Protocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.loop = server.loop
        self.methods = server.methods
        self.max_body = server.max_body
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.calls: dict[int, Call] = {}
        self.c: Any = None
        self._pp = ffi.new("char **")
        self._pn = ffi.new("size_t *")
        self._ep = ffi.new("char **")
        self._en = ffi.new("size_t *")
        self._flush_pending = False
        self._paused = False
        self._consume = 0
        self.closed = False
        self._idle: asyncio.TimerHandle | None = None  # the handshake deadline
        self.idle_since = 0.0  # loop time the connection last had no open stream (see H2Server._sweep)

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        addr = transport.get_extra_info("peername")
        if isinstance(addr, tuple) and len(addr) >= 2:
            self.peer = f"ipv6:[{addr[0]}]:{addr[1]}" if ":" in str(addr[0]) else f"ipv4:{addr[0]}:{addr[1]}"
        gate = self.server.gate
        if not gate.admit(self, client_key(addr)):
            self.closed = True
            transport.abort()
            return
        c = lib.h2_new(MAX_STREAMS, MAX_HEADER_LIST, STREAM_WINDOW, self.server.conn_window)
        if c == ffi.NULL:
            log.warning("gRPC connection from %s: cannot make an HTTP/2 session", self.peer)
            gate.release(self)
            self.closed = True
            transport.abort()
            return
        self.c = ffi.gc(c, lib.h2_free)
        self.server.conns.add(self)
        self._idle = self.loop.call_later(gate.handshake_timeout, self.shut, "handshake_timeout")
        if self.server.stopping:
            lib.h2_goaway(self.c)
        self._flush()

    def _handshaken(self) -> None:
        """The client's preface and first SETTINGS arrived: the connection counts in max_connections."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self.idle_since = self.loop.time()
        if not self.server.gate.handshaken(self):
            self.shut("max_connections")

    def shut(self, reason: str) -> None:
        """Closed by a bound of the gate (``reason``): GOAWAY, then closed; cut if the client does not
        take it within _CLOSE_GRACE s."""
        if reason == "handshake_timeout" and self in self.server.gate.pending:  # connection_made's deadline
            self.server.gate.refused(reason, self.peer, 1, self.server.gate.handshake_timeout)
        self.server.gate.release(self)
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return
        log.debug("gRPC connection from %s: closing (%s)", self.peer, reason)
        if self.c is not None:
            lib.h2_goaway(self.c)
            self._flush()
        transport.close()
        self.loop.call_later(_CLOSE_GRACE, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self.c is None or self.closed:
            return
        rv = lib.h2_recv(self.c, data, len(data), self._pp, self._pn)
        n = self._pn[0]
        if n:
            self._events(ffi.buffer(self._pp[0], n)[:])
        self._flush()
        if rv < 0 and not self.closed and self.transport is not None:  # fatal: nghttp2 reads no more of it
            log.debug("gRPC connection from %s: HTTP/2 error %d, closing", self.peer, rv)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        if self._idle is not None:
            self._idle.cancel()
        c, self.c = self.c, None
        if c is not None:
            ffi.release(c)
        self.server.conns.discard(self)
        self.server.gate.release(self)
        for call in self.calls.values():
            self._drop(call)
        self.calls.clear()
        self.server.conn_gone()

    def pause_writing(self) -> None:  # the client reads slower than it asks: it is not read meanwhile
        self._paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self._flush()

    # --- events from nghttp2 ---------------------------------------------------------------

    def _events(self, buf: bytes) -> None:
        pos, end = 0, len(buf)
        unpack = _EV.unpack_from
        calls = self.calls
        while pos < end:
            typ, sid, n = unpack(buf, pos)
            pos += 9
            if typ == b"D":
                call = calls.get(sid)
                if call is None:
                    self._consume += n
                else:
                    self._data(call, buf[pos:pos + n])
            elif typ == b"H":
                self._headers(sid, buf[pos:pos + n])
            elif typ == b"E":
                call = calls.get(sid)
                if call is not None:
                    self._end(call)
            elif typ == b"C":
                call = calls.pop(sid, None)
                if call is not None:
                    self._closed(call)
                    if not calls:
                        self.idle_since = self.loop.time()
            elif typ == b"W":
                call = calls.get(sid)
                if call is not None and call.writable is not None:
                    call.writable.set()
            elif typ == b"S":
                self._handshaken()
            pos += n

    def _headers(self, sid: int, rec: bytes) -> None:
        self.idle_since = self.loop.time()
        path, tmo, md = rec.split(b"\0", 2)
        method = self.methods.get(path)
        if method is None:
            self._reply(sid, None, trailer(UNIMPLEMENTED, f"Method not found: {path.decode('latin-1')}"))
            return
        timeout = parse_timeout(tmo) if tmo else None
        deadline = None if timeout is None else self.loop.time() + timeout
        call = Call(self, sid, method, md, deadline)
        self.calls[sid] = call
        if deadline is not None:
            call.timer = self.loop.call_at(deadline, self._expire, call)
        if method.kind == BIDI:
            call.queue = asyncio.Queue()
            call.task = self.loop.create_task(self._run_bidi(call))

    def _data(self, call: Call, chunk: bytes) -> None:
        if call.finished:
            self._consume += len(chunk)
            return
        buf = call.inbuf
        if buf is None:
            if len(chunk) >= 5:  # the common case: the whole message in one chunk
                flag, n = _PREFIX.unpack_from(chunk)
                if n + 5 == len(chunk) and not flag:
                    self._message(call, chunk[5:])
                    return
            buf = call.inbuf = bytearray()
        buf += chunk
        while len(buf) >= 5 and not call.finished:
            flag, n = _PREFIX.unpack_from(buf)
            if flag:
                self._fail(call, INTERNAL, "compressed messages are not supported (grpc-encoding identity only)")
            elif n > self.max_body:
                self._fail(call, RESOURCE_EXHAUSTED, f"message of {n} bytes is larger than max {self.max_body}")
            elif len(buf) < n + 5:
                return
            else:
                msg = bytes(buf[5:5 + n])
                del buf[:5 + n]
                self._message(call, msg)
        if call.finished and buf:
            self._consume += len(buf)
            buf.clear()

    def _message(self, call: Call, msg: bytes) -> None:
        if len(msg) > self.max_body:
            self._consume += len(msg) + 5
            self._fail(call, RESOURCE_EXHAUSTED, f"message of {len(msg)} bytes is larger than max {self.max_body}")
            return
        if call.queue is not None:  # bidi: given back when the handler takes it
            if call.queue.qsize() >= _QUEUE:
                self._consume += len(msg) + 5
                self._fail(call, RESOURCE_EXHAUSTED, "too many messages waiting on the stream")
                return
            call.queue.put_nowait(msg)
            return
        if call.msg is not None:
            self._consume += len(msg) + 5
            self._fail(call, UNIMPLEMENTED, "more than one request message on a unary call")
            return
        # the window it holds is given back when the client half-closes (a handler takes it) or the
        # stream closes: a client that never half-closes holds no more than the connection's window
        call.msg = msg
        call.owed = len(msg) + 5

    def _end(self, call: Call) -> None:
        call.ended = True
        self._consume += call.owed
        call.owed = 0
        if call.finished:
            return
        if call.queue is not None:
            call.queue.put_nowait(_EOF)
            return
        if call.msg is None:
            self._fail(call, INTERNAL, "no request message")
            return
        run = self._run_unary if call.method.kind == UNARY else self._run_stream
        call.task = self.loop.create_task(run(call))

    # --- answers -------------------------------------------------------------------------

    def _reply(self, sid: int, msg: bytes | None, trailer: bytes | None, mark: int = 0) -> int:
        if self.c is None:
            return -1
        if msg is None:
            rv = lib.h2_reply(self.c, sid, ffi.NULL, 0, 0, trailer, len(trailer) if trailer else 0, mark)
        else:
            rv = lib.h2_reply(self.c, sid, msg, len(msg), 1, trailer if trailer is not None else ffi.NULL,
                              len(trailer) if trailer else 0, mark)
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)
        return rv  # type: ignore[no-any-return]

    def _finish(self, call: Call, msg: bytes | None, trailer: bytes) -> None:
        if call.finished:
            return
        call.finished = True
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        self._reply(call.sid, msg, trailer)

    def _fail(self, call: Call, code: int, message: str) -> None:
        self._finish(call, None, trailer(code, message))
        if call.task is not None and not call.task.done():
            call.task.cancel()

    def _expire(self, call: Call) -> None:
        call.timer = None
        self._fail(call, DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _closed(self, call: Call) -> None:
        """The stream closed: the connection window its unread bytes hold is given back."""
        if call.inbuf:
            self._consume += len(call.inbuf)
        self._consume += call.owed
        call.owed = 0
        q = call.queue
        while q is not None and not q.empty():
            item = q.get_nowait()
            if item is not _EOF:
                self._consume += len(item) + 5
        self._drop(call)

    def _drop(self, call: Call) -> None:
        """The stream is gone (reset by the client, or the connection lost): its handler is cancelled."""
        call.finished = True
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if call.task is not None and not call.task.done():
            call.task.cancel()
        if call.writable is not None:
            call.writable.set()

    def consumed(self, n: int) -> None:
        self._consume += n
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        c = self.c
        if c is None or self.closed or self._paused:
            return
        if self._consume:
            lib.h2_consume(c, self._consume)
            self._consume = 0
        rv = lib.h2_send_out(c, self._pp, self._pn, self._ep, self._en)
        transport = self.transport
        assert transport is not None
        if rv < 0:
            log.debug("gRPC connection from %s: HTTP/2 send error %d", self.peer, rv)
            transport.abort()
            return
        n = self._pn[0]
        if n:
            transport.write(ffi.buffer(self._pp[0], n)[:])
        n = self._en[0]
        if n:  # the data sources' records: a stream the client had been slow on drained ('W')
            self._events(ffi.buffer(self._ep[0], n)[:])
        if not lib.h2_want(c):
            transport.close()

    # --- handler tasks -------------------------------------------------------------------

    def _error(self, call: Call, exc: BaseException) -> None:
        log.warning("gRPC %s failed: %r", call.method.fn.__name__, exc)
        self._finish(call, None, trailer(UNKNOWN, f"Unexpected error: {type(exc).__name__}"))

    async def _run_unary(self, call: Call) -> None:
        m = call.method
        try:
            req = m.deser(call.msg)
            call.msg = None
            resp = await m.fn(req, call)
            out = m.ser(resp)
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self._error(call, exc)
            return
        self._finish(call, out, OK_TRAILER)

    async def _send(self, call: Call, out: bytes) -> None:
        if call.finished:
            raise asyncio.CancelledError
        if self._reply(call.sid, out, None, _WRITE_MARK) == 1:  # the client is slow to take them: wait
            call.writable = asyncio.Event()
            await call.writable.wait()
            call.writable = None

    async def _stream_out(self, call: Call, answers: AsyncIterator[Any]) -> None:
        ser = call.method.ser
        try:
            async for resp in answers:
                await self._send(call, ser(resp))
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self._error(call, exc)
            return
        finally:
            aclose = getattr(answers, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        self._finish(call, None, OK_TRAILER)

    async def _run_stream(self, call: Call) -> None:
        try:
            req = call.method.deser(call.msg)
        except Exception as exc:
            self._error(call, exc)
            return
        call.msg = None
        await self._stream_out(call, call.method.fn(req, call))

    async def _run_bidi(self, call: Call) -> None:
        await self._stream_out(call, call.method.fn(call.requests(), call))

    def goaway(self) -> None:
        if self.c is not None and not self.closed:
            lib.h2_goaway(self.c)
            self._flush()


class H2Server:
    """Listens on ``host:port`` (SO_REUSEPORT), serving ``svc``'s methods; ``max_connections``,
    ``max_connections_per_client``, ``handshake_timeout`` and ``idle_timeout`` bound the connections
    (:class:`~rmqfast.grpcfront.gate.Gate`)."""

    def __init__(self, svc: Any, max_body: int, ssl_context: ssl.SSLContext | None = None, *,
                 max_connections: int = 10000, max_connections_per_client: int = 1000,
                 handshake_timeout: float = 10.0, idle_timeout: float = 300.0) -> None:
        available()
        self._stats = getattr(svc, "stats", None)  # MessagingService.stats, logged when the front stops
        self.loop = asyncio.get_running_loop()
        self.gate = Gate(max_connections, max_connections_per_client, handshake_timeout, idle_timeout,
                         self.loop.time, closed_counter())
        self.methods = methods_of(svc)
        self.max_body = max_body
        # the connection's window covers one largest message and its prefix, and then some
        self.conn_window = min((1 << 31) - 1, max(4 << 20, 2 * (max_body + 5)))
        self.ssl = ssl_context
        if ssl_context is not None:
            ssl_context.set_alpn_protocols(["h2"])
        self.conns: set[H2Protocol] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._gone = asyncio.Event()
        self._sweeper: asyncio.TimerHandle | None = None
        self.heap = Trimmer()  # the C heap given back after a peak of connections (rmqfast.heap)

    @property
    def refused(self) -> int:
        """Connections closed at once by ``max_connections`` or ``max_connections_per_client``."""
        return self.gate.closed["max_connections"] + self.gate.closed["per_client"]

    async def start(self, host: str, port: int) -> int:
        """Bind and listen; returns the port (useful with port 0)."""
        tls_deadline = {"ssl_handshake_timeout": self.gate.handshake_timeout} if self.ssl is not None else {}
        self._server = await self.loop.create_server(lambda: H2Protocol(self), host or None, port,
                                                     reuse_port=True, ssl=self.ssl, backlog=1024, **tls_deadline)
        self._sweep()
        return int(self._server.sockets[0].getsockname()[1])

    def _sweep(self) -> None:
        """Every tenth of ``idle_timeout`` (at most 5 s): established connections with no open stream
        for ``idle_timeout`` get GOAWAY and are closed; the free C heap is given back once many
        connections closed since their peak."""
        gate = self.gate
        limit = self.loop.time() - gate.idle_timeout
        idle = [p for p in gate.established if not p.calls and p.idle_since <= limit]  # type: ignore[attr-defined]
        for p in idle:
            gate.refused("idle", p.peer, len(gate.established), gate.idle_timeout)  # type: ignore[attr-defined]
            p.shut("idle")
        self.heap.maybe_trim(len(self.conns), gate)
        if not self.stopping:
            self._sweeper = self.loop.call_later(min(5.0, gate.idle_timeout / 10), self._sweep)

    def conn_gone(self) -> None:
        if not self.conns:
            self._gone.set()

    async def stop(self, grace: float) -> None:
        """GOAWAY to every connection, then up to ``grace`` seconds for their calls; then they are closed."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._stats is not None and hasattr(self._stats, "connections_refused"):
            self._stats.connections_refused = self.refused
            self._stats.connections_closed = {k: v for k, v in self.gate.closed.items() if v}
        if self._server is not None:
            self._server.close()
        for p in list(self.conns):
            p.goaway()
        if self.conns:
            self._gone.clear()
            try:
                await asyncio.wait_for(self._gone.wait(), grace)
            except TimeoutError:
                pass
        tasks = []
        for p in list(self.conns):
            tasks += [c.task for c in p.calls.values() if c.task is not None and not c.task.done()]
            if p.transport is not None:
                p.transport.abort()
            p.connection_lost(None)  # its calls cancelled now
        if tasks:
            await asyncio.wait(tasks, timeout=grace)

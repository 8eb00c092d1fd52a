"""The relay: one upstream connection per downstream connection, two pumps per pair.

Each pump reads whole receive buffers (``recv_into`` a reusable buffer), lets the frame
scanner say how far the bytes may be forwarded unchanged, and forwards that span with one
``sendall``.  Only frames a policy filter asked for become Python objects.  Partial frames
are forwarded as they arrive unless a policy needs them whole, so the relay adds no
store-and-forward delay to large messages.

Because the client and its upstream connection are paired 1:1, opaques, heartbeats,
oneway frames and broker-to-client requests (transaction check-back 39, consumer ids
changed 40, running info 307, consume directly 309...) need no bookkeeping at all.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING, Any

import gevent
from gevent import socket
from gevent.lock import Semaphore

from rmqfast.codec import EV_FORWARD, EV_POLICY, FrameScanner
from rmqfast.codec import codes as C
from rmqfast.log import ctx
from rmqfast.proxy.policy import FilterChain, Frame, Verdict, error_response

if TYPE_CHECKING:
    from rmqfast.codec import ScanStats
    from rmqfast.config import HostPort

log = logging.getLogger("rmqfast.relay")


class RelaySettings:
    """The part of the configuration a relay session needs (shared, updated on reload)."""

    def __init__(
        self, buffer_size: int, max_frame: int, max_header: int, connect_timeout: float, idle_timeout: float
    ) -> None:
        self.buffer_size = buffer_size
        self.max_frame = max_frame
        self.max_header = max_header
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout


class Session:
    """A client connection and its upstream connection."""

    def __init__(
        self,
        role: str,
        client: socket.socket,
        client_addr: str,
        upstreams: list[HostPort],
        chain: FilterChain,
        stats: ScanStats,
        settings: RelaySettings,
        events: Any,
    ) -> None:
        self.role = role
        self.client = client
        self.client_addr = client_addr
        self.upstreams = upstreams
        self.upstream_addr = ""
        self.chain = chain
        self.stats = stats
        self.settings = settings
        self.events = events  # worker-level hooks: counters, session registry
        self.state: dict[str, Any] = {}
        self.upstream: socket.socket | None = None
        self.last_activity = time.monotonic()
        self.client_lock = Semaphore()
        self.upstream_lock = Semaphore()
        self.closed = False
        self.c2u: FrameScanner | None = None
        self.u2c: FrameScanner | None = None

    # Lifecycle ------------------------------------------------------------------------------

    def run(self) -> None:
        upstream = self._connect()
        if upstream is None:
            return
        self.upstream = upstream
        s = self.settings
        self.c2u = FrameScanner(
            self.stats,
            actions=self.chain.request_actions,
            response_policy=False,
            max_frame_size=s.max_frame,
            max_header_size=s.max_header,
        )
        # Requests from the broker to the client (39, 40, 307, 309...) are always relayed.
        self.u2c = FrameScanner(
            self.stats,
            response_policy=self.chain.response_policy,
            max_frame_size=s.max_frame,
            max_header_size=s.max_header,
        )
        self.client.settimeout(s.idle_timeout)
        upstream.settimeout(s.idle_timeout)
        back = gevent.spawn(self._pump, upstream, self.client, self.u2c, "upstream", self.client_lock, self._on_u2c)
        try:
            self._pump(self.client, upstream, self.c2u, "client", self.upstream_lock, self._on_c2u)
        finally:
            self.close()
            back.join(timeout=5)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in (self.client, self.upstream):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    @property
    def in_flight(self) -> int:
        """Client requests relayed upstream and not answered yet."""
        if self.c2u is None or self.u2c is None:
            return 0
        return max(0, self.c2u.requests - self.u2c.responses)

    def _connect(self) -> socket.socket | None:
        errors = []
        for hp in self.upstreams:
            try:
                sock = socket.create_connection((hp.host, hp.port), timeout=self.settings.connect_timeout)
            except OSError as exc:
                errors.append(f"{hp}: {exc.strerror or exc}")
                self.events.upstream_error(self.role)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.upstream_addr = str(hp)
            self.events.upstream_ok(self, hp)
            return sock
        reason = "; ".join(errors)
        log.warning("upstream unreachable", extra=ctx(role=self.role, client=self.client_addr, errors=reason))
        self._refuse(f"rmqfast: upstream unreachable ({reason}); retry later")
        return None

    def _refuse(self, remark: str) -> None:
        """Answer what the client sends in the next moment with SYSTEM_ERROR, then close."""
        scanner = FrameScanner(self.stats, actions=bytes([1]) * len(self.chain.request_actions))
        buf = bytearray(65536)
        filled = 0
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
                    if not frame.is_oneway:
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

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        scanner: FrameScanner,
        side: str,
        dst_lock: Semaphore,
        on_policy: Any,
    ) -> None:
        size = self.settings.buffer_size
        buf = bytearray(size)
        view = memoryview(buf)
        filled = 0
        scan = scanner.scan
        recv_into = src.recv_into
        try:
            while True:
                try:
                    n = recv_into(view[filled:])
                except TimeoutError:
                    if time.monotonic() - self.last_activity < self.settings.idle_timeout:
                        continue
                    log.info("closing idle connection", extra=ctx(role=self.role, client=self.client_addr))
                    return
                if n == 0:
                    return
                self.last_activity = time.monotonic()
                filled += n
                start = pos = 0
                need = 0
                while True:
                    ev, a, b = scan(buf, pos, filled)
                    if a > start:
                        with dst_lock:
                            dst.sendall(view[start:a])
                        start = a
                    if ev == EV_FORWARD:
                        need = b
                        break
                    if ev == EV_POLICY:
                        frame = Frame(bytes(view[a:b]), scanner.code, scanner.flag, scanner.opaque)
                        if not self._apply(on_policy(frame), frame, dst, dst_lock):
                            return
                        start = pos = b
                        continue
                    # EV_ERROR: one log line (the scanner counted it); only this connection closes.
                    log.warning(
                        "protocol error; closing connection",
                        extra=ctx(
                            role=self.role,
                            side=side,
                            client=self.client_addr,
                            upstream=self.upstream_addr,
                            error=scanner.error,
                        ),
                    )
                    return
                rest = filled - start
                if rest and start:
                    buf[0:rest] = buf[start:filled]
                filled = rest
                if need > len(buf):
                    # A frame head that needs policy (or a huge header) is larger than the
                    # buffer; the scanner checked it against the frame limit already.
                    grown = bytearray(max(need, 2 * len(buf)))
                    grown[0:filled] = buf[0:filled]
                    view.release()
                    buf = grown
                    view = memoryview(buf)
                elif filled == 0 and len(buf) > size:
                    view.release()
                    buf = bytearray(size)
                    view = memoryview(buf)
        except OSError as exc:
            if not self.closed and exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.EBADF, None):
                log.info(
                    "connection error", extra=ctx(role=self.role, side=side, client=self.client_addr, error=str(exc))
                )
        finally:
            view.release()
            self.close()

    def _apply(self, verdict: Verdict, frame: Frame, dst: socket.socket, dst_lock: Semaphore) -> bool:
        """Carry out a policy verdict; False when the connection must be closed."""
        kind = verdict.kind
        if kind == "pass":
            with dst_lock:
                dst.sendall(frame.data)
        elif kind == "rewrite":
            with dst_lock:
                dst.sendall(verdict.data)
        elif kind == "reply":
            # The answer goes back to where the frame came from.
            src, lock = (self.client, self.client_lock) if dst is self.upstream else (self.upstream, self.upstream_lock)
            assert src is not None
            with lock:
                src.sendall(verdict.data)
        elif kind == "close":
            log.warning(
                "policy closed connection", extra=ctx(role=self.role, client=self.client_addr, reason=verdict.reason)
            )
            return False
        # "divert": the filter owns the frame now.
        return True

    def _on_c2u(self, frame: Frame) -> Verdict:
        if frame.flag & C.FLAG_RESPONSE:
            return self.chain.on_response(self, frame)
        return self.chain.on_request(self, frame)

    def _on_u2c(self, frame: Frame) -> Verdict:
        if frame.flag & C.FLAG_RESPONSE:
            return self.chain.on_response(self, frame)
        return Verdict("pass")

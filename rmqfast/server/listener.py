"""A Remoting listener of a worker: its SO_REUSEPORT socket and its accept loop.

:class:`RelayServer` accepts connections as plain sockets, refuses those past the worker's caps
at once (:class:`rmqfast.server.accept.ConnectionCaps`) and backs off on a descriptor shortage
(:class:`rmqfast.server.accept.AcceptGuard`) instead of gevent's traceback loop.
"""

from __future__ import annotations

import _socket
from collections.abc import Callable
from typing import Any

from gevent import socket
from gevent.server import StreamServer

from rmqfast.config import HostPort
from rmqfast.server.accept import SHORTAGE_ERRNOS, TRANSIENT_ERRNOS, AcceptGuard, ConnectionCaps, client_key

#: connections past a cap closed in one turn of a listener before it lets the loop run others
MAX_REFUSALS_PER_TURN = 64


def bind_reuseport(hp: HostPort, backlog: int = 1024) -> socket.socket:
    family = socket.AF_INET6 if ":" in hp.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((hp.host, hp.port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        # name the address: "[Errno 98] Address already in use" alone does not say which one
        raise OSError(exc.errno, f"cannot listen on {hp}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


class RelayServer(StreamServer):
    """A StreamServer that hands its handler each accepted connection as a plain non-blocking
    socket (``_socket.socket``: no gevent socket object and its two libev watchers, which a relayed
    connection never waits on; code that waits with gevent's calls makes one,
    :func:`rmqfast.proxy.connect.to_gevent`), and leaves it to the handler: the handler closes it
    on every path (a relay session serving from the reactor after the handler returned closes it
    when it ends).  gevent's StreamServer closes every socket when its handler returns."""

    #: set by the worker: admission (caps) and the descriptor-shortage state of this listener
    caps: ConnectionCaps | None = None
    guard: AcceptGuard | None = None
    on_refused: Callable[[str, tuple], None] | None = None
    #: set by the worker: at the worker's cap, close an idle connection for the newcomer (True when
    #: one was closed: rmqfast.server.evict)
    make_room: Callable[[], bool] | None = None

    def do_read(self) -> tuple[Any, Any] | None:
        listener = self.socket
        guard = self.guard
        for _ in range(MAX_REFUSALS_PER_TURN):
            try:
                fd, address = listener._accept()
            except BlockingIOError:
                if guard is not None and guard.blocked:
                    guard.accepted()  # accept(2) takes a descriptor before it looks at the queue
                if not listener.timeout:
                    return None
                raise
            except OSError as exc:
                if guard is None or exc.errno not in SHORTAGE_ERRNOS | TRANSIENT_ERRNOS:
                    raise
                if exc.errno in TRANSIENT_ERRNOS:
                    continue  # that connection is gone; the next one may be fine
                self._back_off(guard.failed(exc))
                return None
            if guard is not None and guard.blocked:
                guard.accepted()
            caps = self.caps
            if caps is not None:
                cap = caps.admit(address[0])[1]
                if cap == "worker" and self.make_room is not None and self.make_room():
                    cap = caps.admit_over(address[0])[1]
                if cap:
                    _socket.close(fd)  # at once: a connection past a cap holds nothing
                    if self.on_refused is not None:
                        self.on_refused(cap, address)
                    continue
            sock = _socket.socket(listener.family, listener.type, listener.proto, fd)
            sock.setblocking(False)
            return sock, address
        return None

    def _back_off(self, delay: float) -> None:
        """Stop accepting for ``delay`` seconds (gevent's own back-off, without its traceback)."""
        self.stop_accepting()
        self._timer = self.loop.timer(delay)
        self._timer.start(self._retry)

    def _retry(self) -> None:
        """The back-off is over: accept again, and try at once even with nothing pending (an
        accept that finds the queue empty had a descriptor for it: the listener is not blocked
        any more, and /readyz must not wait for the next client to say so)."""
        self._start_accepting_if_started()
        if self.started and self.guard is not None and self.guard.blocked:
            self._do_read()

    def do_handle(self, sock: Any, address: Any) -> None:
        spawn = self._spawn  # type: ignore[attr-defined]
        if spawn is None:
            self._handle(sock, address)  # type: ignore[attr-defined]
            return
        try:
            spawn(self._handle, sock, address)  # type: ignore[attr-defined]
        except BaseException:
            sock.close()
            if self.caps is not None:  # admitted in do_read; no handler will release it
                self.caps.release(client_key(address[0]))
            raise

    def do_close(self, sock: Any, *args: Any) -> None:
        pass  # the handler's



class Listener:
    def __init__(self, role: str, listen: HostPort, server: StreamServer, upstream: HostPort | None) -> None:
        self.role = role
        self.listen = listen
        self.server = server
        self.upstream = upstream



"""The one writer of each socket of a relay session (:class:`SocketWriter`): the pump forwarding
into the socket and the answers the proxy makes itself take turns through it, never interleaving
inside a frame.  It is also the wake-up of a compiled pump parked in the reactor
(:meth:`SocketWriter.switch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gevent.lock import Semaphore
from greenlet import greenlet

from rmqfast.proxy.core import PumpState, Writer

if TYPE_CHECKING:
    from rmqfast.proxy.relay import Session

#: A connection's socket: a plain non-blocking socket (``_socket.socket``: what the worker accepts
#: and :func:`rmqfast.proxy.connect.connect_plain` opens), a gevent socket, or a TLS connection
#: (``rmqfast.proxy.tls.TlsSocket``).
Sock = Any


def raw_socket(sock: Any) -> Any:
    """What a pump reads and writes without waiting: the plain socket under a gevent socket (or
    the TLS connection's non-blocking I/O), or ``sock`` itself when it is a plain socket."""
    return getattr(sock, "_sock", sock)


class SocketWriter(Writer):
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
            raw = raw_socket(self.sock)
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
        raw = raw_socket(self.sock)
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

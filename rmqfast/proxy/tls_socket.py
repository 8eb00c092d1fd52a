"""The TLS connection the relay drives (:class:`TlsSocket`) and the handshake that makes one.

The relay's pumps read and write it like a plain non-blocking socket (``_sock`` is its
non-blocking I/O, :class:`_TlsIO`), so the Python pump runs on it unchanged; the compiled pump
never does (it reads raw file descriptors).  ``ssl`` is imported by the first handshake, after
:mod:`rmqfast.proxy.tls` built the contexts: a worker without TLS never loads OpenSSL.
"""

from __future__ import annotations

import errno
import socket as _stdsocket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl
else:
    ssl = None  # the module once load_ssl() ran (the first handshake)


def load_ssl() -> None:
    """Import ``ssl`` into this module (once; before the first handshake)."""
    global ssl
    if ssl is None:
        import ssl as module

        ssl = module


def wait_fd(fd: int, events: int, timeout: float | None, waiting: set[Any] | None = None) -> None:
    """Wait (gevent) until ``fd`` is readable (1) or writable (2); OSError(ETIMEDOUT) after ``timeout``.

    The watcher is in ``waiting`` meanwhile, so that closing the connection can wake the waiter."""
    import gevent

    hub = gevent.get_hub()
    watcher = hub.loop.io(fd, events)
    if waiting is not None:
        waiting.add(watcher)
    try:
        if timeout is None:
            hub.wait(watcher)
        else:
            with gevent.Timeout(timeout, False):
                hub.wait(watcher)
                return
            raise OSError(errno.ETIMEDOUT, f"no progress within {timeout:g} s")
    finally:
        if waiting is not None:
            waiting.discard(watcher)
        watcher.close()


def peek_first_byte(sock: Any, timeout: float) -> int | None:
    raw = sock._sock
    while True:
        try:
            b = raw.recv(1, _stdsocket.MSG_PEEK)
        except BlockingIOError:
            wait_fd(raw.fileno(), 1, timeout)
            continue
        return b[0] if b else None


def handshake(ctx: ssl.SSLContext, sock: Any, server_side: bool, name: str | None, timeout: float) -> TlsSocket:
    """A completed handshake on gevent socket ``sock`` (its raw socket stays non-blocking)."""
    load_ssl()
    raw = sock._sock
    raw.setblocking(False)
    try:
        sslobj = ctx._wrap_socket(raw, server_side, server_hostname=name if not server_side else None)  # type: ignore[attr-defined]
    except ValueError as exc:  # e.g. check_hostname with no name
        raise OSError(errno.EINVAL, f"TLS setup failed: {exc}") from None
    import time

    deadline = time.monotonic() + timeout
    fd = raw.fileno()
    while True:
        try:
            sslobj.do_handshake()
            break
        except ssl.SSLWantReadError:
            events = 1
        except ssl.SSLWantWriteError:
            events = 2
        except ssl.SSLError as exc:
            detail = getattr(exc, "verify_message", None)
            why = f"{exc.reason or exc}" + (f" ({detail})" if detail else "")
            raise OSError(errno.EPROTO, f"TLS handshake failed: {why}") from None
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError(errno.ETIMEDOUT, f"TLS handshake timed out after {timeout:g} s")
        try:
            wait_fd(fd, events, left)
        except OSError as exc:
            if exc.errno == errno.ETIMEDOUT:
                raise OSError(errno.ETIMEDOUT, f"TLS handshake timed out after {timeout:g} s") from None
            raise
    return TlsSocket(sock, sslobj)


# The connection object the relay drives -------------------------------------------------------


_FULL_RECORD = 16384  # TLS plaintext record limit: a record this long is likely followed by more


class _TlsIO:
    """What the relay's Python pump calls on ``sock._sock``: non-blocking ``recv_into`` and
    ``send`` that raise BlockingIOError when the TLS layer must wait for the socket."""

    __slots__ = ("_ssl", "_fd", "eof_pending")

    def __init__(self, sslobj: Any, fd: int) -> None:
        self._ssl = sslobj
        self._fd = fd
        # The end of the stream (close_notify, or TCP EOF) was read right after data that this
        # call returns: the next call returns 0 without reading.  The pump must not take this
        # short count for "drained": the socket may never be readable again (a peer that sends
        # close_notify and keeps its TCP side open, waiting for ours).
        self.eof_pending = False

    def recv_into(self, buf: Any) -> int:
        """Plaintext into ``buf``: TLS records until ``buf`` is full, the socket has no more, or a
        record shorter than the maximum ended (the peer flushed).

        A short count never leaves decrypted bytes inside OpenSSL (read-ahead is off, so what
        is not read yet is still in the socket and makes it readable): the pump may wait for
        readiness after it. 0 is the end of the stream (close_notify, or the peer closed the
        TCP connection).
        """
        if self.eof_pending:
            return 0
        view = memoryview(buf)
        total = len(view)
        n = 0
        read = self._ssl.read
        while n < total:
            try:
                got = read(total - n, view[n:])
            except ssl.SSLWantReadError:
                if n:
                    return n
                raise BlockingIOError(errno.EAGAIN, "TLS: waiting for the peer") from None
            except ssl.SSLWantWriteError:  # a key update answer waits for buffer space
                wait_fd(self._fd, 2, 30.0)
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                got = 0
            except ssl.SSLError as exc:
                raise OSError(errno.EPROTO, f"TLS error: {exc.reason or exc}") from None
            if got == 0:
                self.eof_pending = n > 0
                return n
            n += got
            if got < _FULL_RECORD and not self._ssl.pending():
                # A short record (the peer flushed) and nothing decrypted left inside OpenSSL: stop
                # here rather than pay a failing read; more records on the socket make it readable,
                # and the pump's wait returns at once.  Full records (bulk data) read on.
                return n
        return n

    def send(self, data: Any) -> int:
        """All of ``data`` (OpenSSL writes whole or asks to be called again with the same bytes)."""
        while True:
            try:
                return int(self._ssl.write(data))
            except ssl.SSLWantWriteError:
                raise BlockingIOError(errno.EAGAIN, "TLS: socket buffer full") from None
            except ssl.SSLWantReadError:  # renegotiation is off; only a handshake message could need it
                wait_fd(self._fd, 1, 30.0)
            except ssl.SSLEOFError:
                raise BrokenPipeError(errno.EPIPE, "TLS: connection closed") from None
            except ssl.SSLError as exc:
                raise OSError(errno.EPROTO, f"TLS error: {exc.reason or exc}") from None

    def pending(self) -> int:
        return int(self._ssl.pending())


class TlsSocket:
    """A TLS connection, shaped like the gevent socket the relay uses.

    ``_sock`` is what the Python pump reads and writes (:class:`_TlsIO`); ``fileno`` is the
    TCP socket's descriptor (the relay waits on it); ``recv_into``/``sendall``/``settimeout``
    are blocking (gevent) versions for the relay's refusal path.
    """

    is_tls = True

    def __init__(self, sock: Any, sslobj: Any) -> None:
        self._gsock = sock
        self._sslobj = sslobj
        self._fd = sock.fileno()
        self._sock = _TlsIO(sslobj, self._fd)
        self._timeout: float | None = None
        self._closed = False
        self._waiting: set[Any] = set()  # watchers of blocking recv_into/sendall calls, woken by close

    def fileno(self) -> int:
        return self._fd if not self._closed else -1

    def setsockopt(self, *args: Any) -> None:
        self._gsock.setsockopt(*args)

    def getpeername(self) -> Any:
        return self._gsock.getpeername()

    def version(self) -> str | None:
        return self._sslobj.version()  # type: ignore[no-any-return]

    def cipher(self) -> Any:
        return self._sslobj.cipher()

    def getpeercert(self, binary_form: bool = False) -> Any:
        return self._sslobj.getpeercert(binary_form)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        view = memoryview(buf)
        if nbytes:
            view = view[:nbytes]
        while True:
            try:
                return self._sock.recv_into(view)
            except BlockingIOError:
                if self._closed:
                    raise OSError(errno.EBADF, "TLS connection closed") from None
                wait_fd(self._fd, 1, self._timeout, self._waiting)

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self.recv_into(buf)
        return bytes(buf[:got])

    def sendall(self, data: Any) -> None:
        while True:
            try:
                self._sock.send(data)
                return
            except BlockingIOError:
                if self._closed:
                    raise OSError(errno.EBADF, "TLS connection closed") from None
                wait_fd(self._fd, 2, self._timeout, self._waiting)

    def close(self) -> None:
        """Send close_notify if the socket takes it now (never waits), then close."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sslobj.shutdown()
        except (ssl.SSLError, OSError, ValueError):
            pass
        if self._waiting:  # greenlets blocked in recv_into/sendall get EBADF, as with gevent's sockets
            import gevent

            hub = gevent.get_hub()
            for w in list(self._waiting):
                hub.cancel_wait(w, OSError(errno.EBADF, "TLS connection closed"))
        self._gsock.close()


def is_tls(sock: Any) -> bool:
    return getattr(sock, "is_tls", False) is True

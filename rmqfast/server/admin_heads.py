"""The admin endpoint's accept loop: request heads read by one event-driven thread.

A handler thread per connection that reads the head itself lets slow or idle clients hold every
thread: forty slow loopback clients turned ``/healthz`` into 503 and could get the pod restarted
by its liveness probe.  Here one thread accepts and reads every head with :mod:`selectors`; only
a connection whose head is complete goes on (:meth:`HeadOwner.head_done`): answered at once from
this thread (refusals, ``/healthz``) or handed to a handler thread.  A connection waiting for its
head costs a descriptor and its bytes so far, never a thread, and is bounded:

* ``idle`` seconds without a byte, or ``deadline`` seconds since accept: closed;
* at most ``max_pending`` connections and ``max_pending_bytes`` of head bytes wait at once: past
  either, the connection waiting longest is closed (a probe sends its head at once and is read
  in the loop turn it arrives); at most ``max_answering`` answered connections linger;
* a head over ``max_head`` bytes without its end goes on as it is (the handler answers 414/431).

Answers sent from this thread are written without blocking; then the connection is half-closed
and what the client still sends is read and dropped for at most 1 s (closing with unread bytes
would send a reset that can destroy the answer before the client reads it).

``accept`` failing for want of descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM) pauses accepting
for ``ACCEPT_BACKOFF`` seconds with one warning per 10 s, never a busy loop or a traceback.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Protocol

from rmqfast.log import ctx

log = logging.getLogger("rmqfast.admin")

ACCEPT_BACKOFF = 0.1
LINGER = 1.0  # s an answered connection is read and dropped before it is closed
LINGER_BYTES = 1 << 20
WRITE_DEADLINE = 2.0  # s an answer may take to be written
_SHORTAGE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_WARN_EVERY = 10.0


class Conn:
    """One accepted connection in the loop: reading its head, then writing an answer, then lingering."""

    __slots__ = ("sock", "addr", "client", "buf", "since", "last", "out", "until", "dropped", "local_ip", "closed")

    def __init__(self, sock: socket.socket, addr: Any, client: str | None, now: float) -> None:
        self.sock = sock
        self.addr = addr
        self.client = client  # what the owner counts per client address (None: not counted)
        self.buf = bytearray()
        self.since = now
        self.last = now
        self.out: bytes | None = None  # the answer still to write (None: still reading the head)
        self.until = 0.0  # end of writing or lingering
        self.dropped = 0
        self.closed = False
        try:
            name = sock.getsockname()
            self.local_ip = str(name[0]) if isinstance(name, tuple) else ""
        except OSError:
            self.local_ip = ""


class HeadOwner(Protocol):
    """What the loop asks of the server it reads heads for."""

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        """An accepted connection: refuse it, or give it back with :meth:`HeadReader.adopt`."""
        ...

    def head_done(self, conn: Conn, complete: bool) -> bytes | None:
        """The head is in ``conn.buf`` (``complete`` False: over ``max_head`` without its end):
        the answer to send from the loop, or None when the owner took the connection."""
        ...

    def conn_closed(self, conn: Conn) -> None:
        """The loop closed ``conn`` (after an answer, a timeout, the client leaving)."""
        ...


class HeadReader:
    def __init__(self, listener: socket.socket, owner: HeadOwner, *, idle: float, deadline: float,
                 max_head: int, max_pending: int = 256, max_pending_bytes: int = 8 << 20,
                 max_answering: int = 128) -> None:
        self.listener = listener
        self.owner = owner
        self.idle = idle
        self.deadline = deadline
        self.max_head = max_head
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.max_answering = max_answering
        self.sel = selectors.DefaultSelector()
        self.pending: OrderedDict[int, Conn] = OrderedDict()  # reading their head, oldest first
        self.answering: OrderedDict[int, Conn] = OrderedDict()  # writing an answer or lingering, oldest first
        self.pending_bytes = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._adopted: deque[Conn] = deque()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._life = threading.Lock()
        self._accept_paused_until = 0.0
        self._warned: dict[str, float] = {}
        self.evicted = 0  # connections closed to make room (tests and logs)
        self.expired = 0  # connections closed for their head's idle time or deadline

    # Called from any thread --------------------------------------------------------------------

    def adopt(self, sock: socket.socket, addr: Any, client: str | None) -> None:
        """Read the head of ``sock`` in the loop (the owner accepted it)."""
        conn = Conn(sock, addr, client, time.monotonic())
        if threading.current_thread() is self._thread:
            self._add(conn)
        else:
            self._adopted.append(conn)
            self._wake()

    def stop(self) -> None:
        """End the loop and close every connection it holds; returns once it ended."""
        with self._life:
            self._stop = True
            thread = self._thread
            if thread is None:  # never ran (and now never will)
                self._release()
                return
        self._wake()
        if thread is not threading.current_thread():
            self._done.wait(5.0)  # a turn ends within a second; never hang a stopping supervisor

    def _release(self) -> None:
        self.sel.close()
        self._wake_r.close()
        self._wake_w.close()
        self._done.set()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # full (a wake-up is pending anyway) or closed

    # The loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        with self._life:
            if self._stop:
                return
            self._thread = threading.current_thread()
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        try:
            while not self._stop:
                try:
                    self._turn()
                except Exception:  # a bug must not silence the endpoint: log it and go on
                    self._warn("loop", "admin endpoint: unexpected error in the accept loop", exc_info=True)
                    time.sleep(0.05)  # should it repeat: no busy loop
        finally:
            for conn in [*self.pending.values(), *self.answering.values(), *self._adopted]:
                self._close(conn)
            self._release()

    def _turn(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self.sel.register(self.listener, selectors.EVENT_READ, None)
        timeout = 1.0
        if self.pending:
            timeout = min(timeout, max(0.0, min(c.last + self.idle for c in self.pending.values()) - now),
                          max(0.0, next(iter(self.pending.values())).since + self.deadline - now))
        if self._accept_paused_until:
            timeout = min(timeout, max(0.0, self._accept_paused_until - now))
        for key, events in self.sel.select(timeout):
            if key.data is None:
                self._accept()
            elif key.data is self._wake_r:
                self._drain_wake()
            elif key.data.closed:
                continue  # closed by an earlier event of this turn (evicted)
            elif key.data.out is None:
                self._read_head(key.data)
            else:
                self._answer_io(key.data, events)
        self._expire(time.monotonic())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self._adopted:
            self._add(self._adopted.popleft())

    def _accept(self) -> None:
        for _ in range(64):  # then serve what is readable too
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _SHORTAGE:
                    self.sel.unregister(self.listener)
                    self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF
                    self._warn("accept", "admin endpoint: cannot accept connections, the process is short of "
                               f"descriptors or memory ({exc.strerror}); retrying every {ACCEPT_BACKOFF} s")
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that client is gone already
                if self._stop or self.listener.fileno() < 0:
                    return
                self._warn("accept-other", f"admin endpoint: accept failed ({exc})")
                return
            try:
                self.owner.process_request(sock, addr)
            except Exception:
                self._warn("process", "admin endpoint: could not take a connection", exc_info=True)
                sock.close()

    def _add(self, conn: Conn) -> None:
        if self._stop:
            self._close(conn)
            return
        try:
            conn.sock.setblocking(False)
            self.sel.register(conn.sock, selectors.EVENT_READ, conn)
        except (OSError, ValueError):
            self._close(conn)
            return
        self.pending[conn.sock.fileno()] = conn
        while len(self.pending) > self.max_pending:
            self._evict()

    def _evict(self) -> None:
        _, oldest = self.pending.popitem(last=False)
        self.pending_bytes -= len(oldest.buf)
        self.evicted += 1
        self._warn("evict", f"admin endpoint: more than {self.max_pending} connections or "
                   f"{self.max_pending_bytes} bytes waiting for their request head; closing the oldest")
        self._forget(oldest)
        self._close(oldest)

    def _read_head(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        fd = conn.sock.fileno()
        if not data:  # the client left (or reset) before its head was complete
            self.pending.pop(fd, None)
            self.pending_bytes -= len(conn.buf)
            self._forget(conn)
            self._close(conn)
            return
        start = max(0, len(conn.buf) - 2)
        conn.buf += data
        conn.last = time.monotonic()
        self.pending_bytes += len(data)
        end = _head_end(conn.buf, start)
        if end < 0 and len(conn.buf) <= self.max_head:
            while self.pending_bytes > self.max_pending_bytes and self.pending:
                self._evict()
            return
        self.pending.pop(fd, None)
        self.pending_bytes -= len(conn.buf)
        self.sel.unregister(conn.sock)
        try:
            answer = self.owner.head_done(conn, 0 <= end <= self.max_head)
        except Exception:
            self._warn("head", "admin endpoint: could not answer a request", exc_info=True)
            answer = (b"HTTP/1.0 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                      b'Connection: close\r\n\r\n{"error": "the admin endpoint failed; see its log"}\n')
        if answer is not None:
            self.send(conn, answer)

    def send(self, conn: Conn, answer: bytes) -> None:
        """Write ``answer`` on ``conn`` (not registered in the selector), then linger and close."""
        conn.out = answer
        conn.until = time.monotonic() + WRITE_DEADLINE
        try:
            conn.sock.setblocking(False)
            self.sel.register(conn.sock, selectors.EVENT_WRITE, conn)
        except (OSError, ValueError):
            self._close(conn)
            return
        self.answering[conn.sock.fileno()] = conn
        while len(self.answering) > self.max_answering:  # a flood of requests: close the oldest now
            _, oldest = self.answering.popitem(last=False)
            self._forget(oldest)
            self._close(oldest)
        if not conn.closed:
            self._answer_io(conn, selectors.EVENT_WRITE)

    def _answer_io(self, conn: Conn, events: int) -> None:
        try:
            if conn.out:
                if events & selectors.EVENT_WRITE:
                    conn.out = conn.out[conn.sock.send(conn.out):]
                if not conn.out:  # all written: half-close, then read and drop what still comes
                    conn.sock.shutdown(socket.SHUT_WR)
                    conn.until = time.monotonic() + LINGER
                    self.sel.modify(conn.sock, selectors.EVENT_READ, conn)
                return
            if events & selectors.EVENT_READ:
                data = conn.sock.recv(65536)
                conn.dropped += len(data)
                if data and conn.dropped < LINGER_BYTES:
                    return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self.answering.pop(conn.sock.fileno(), None)
        self._forget(conn)
        self._close(conn)

    def _expire(self, now: float) -> None:
        while self.pending:  # oldest first: the whole-head deadline
            conn = next(iter(self.pending.values()))
            if now - conn.since < self.deadline:
                break
            self._expire_one(conn)
        late = [c for c in self.pending.values() if now - c.last >= self.idle]
        for conn in late:
            self._expire_one(conn)
        done = [c for c in self.answering.values() if now >= c.until]
        for conn in done:
            self.answering.pop(conn.sock.fileno(), None)
            self._forget(conn)
            self._close(conn)

    def _expire_one(self, conn: Conn) -> None:
        self.pending.pop(conn.sock.fileno(), None)
        self.pending_bytes -= len(conn.buf)
        self.expired += 1
        self._forget(conn)
        self._close(conn)

    def _forget(self, conn: Conn) -> None:
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        try:
            conn.sock.close()
        finally:
            try:
                self.owner.conn_closed(conn)
            except Exception:
                self._warn("closed", "admin endpoint: error while closing a connection", exc_info=True)

    def _warn(self, what: str, message: str, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._warned.get(what, -_WARN_EVERY) >= _WARN_EVERY:
            self._warned[what] = now
            log.warning(message, exc_info=exc_info, extra=ctx(evicted=self.evicted, expired=self.expired))


def _head_end(buf: bytearray, start: int) -> int:
    """The index just past the empty line that ends the head in ``buf`` (searched from
    ``start``), or -1; lines may end in CRLF or LF alone, as http.server reads them."""
    i = buf.find(b"\n", start)
    while i >= 0:
        j = i + 1
        if j < len(buf) and buf[j:j + 1] == b"\r":
            j += 1
        if j < len(buf) and buf[j:j + 1] == b"\n":
            return j + 1
        i = buf.find(b"\n", i + 1)
    return -1

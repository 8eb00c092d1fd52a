"""How a relay session reaches its upstream: try each upstream address in turn (plain TCP, or TLS
when ``[tls]`` says so for the role), tell the worker which worked or failed (endpoint health),
and when none can be reached answer what the client sends next with SYSTEM_ERROR and close.
A connect that fails for the proxy's own shortage of descriptors or buffers stops at once: it is
never the upstream's fault (rmqfast.server.accept.SHORTAGE_ERRNOS).
"""

from __future__ import annotations

import errno
import functools
import logging
from typing import TYPE_CHECKING

from gevent import socket

from rmqfast.codec import EV_FORWARD, EV_POLICY, code_slot
from rmqfast.codec import codes as C
from rmqfast.codec.tables import R_ONEWAY, result_index
from rmqfast.filters.api import Frame, error_response
from rmqfast.log import ctx
from rmqfast.proxy.connect import connect_plain, connect_tcp, to_gevent

if TYPE_CHECKING:
    from rmqfast.proxy.writer import Sock
    from rmqfast.settings.hostport import HostPort

log = logging.getLogger("rmqfast.relay")

#: connect errors that are the proxy's own shortage of descriptors or buffers (EMFILE, ENFILE,
#: ENOBUFS, ENOMEM): never the upstream's fault (rmqfast.server.accept.SHORTAGE_ERRNOS)
_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@functools.lru_cache(maxsize=1024)  # a worker's upstreams are few
def addr_text(hp: HostPort) -> str:
    """``str(hp)``, one string per upstream shared by its sessions (not 64 bytes per connection)."""
    return str(hp)


class UpstreamConnect:
    """The upstream connect of :class:`rmqfast.proxy.relay.Session` (a mixin: the session's state
    lives in its slots)."""

    __slots__ = ()

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
            self.upstream_addr = addr_text(hp)
            self.events.upstream_ok(self, hp)
            return sock
        reason = "; ".join(errors)
        log.warning("upstream unreachable", extra=ctx(role=self.role, client=self.client_addr, errors=reason))
        self._refuse(f"rmqfast: upstream unreachable ({reason}); retry later")
        return None

    def _refuse(self, remark: str) -> None:
        """Answer what the client sends in the next moment with SYSTEM_ERROR, then close."""
        scanner = self._new_scanner(actions=bytes([1]) * len(self.chain.request_actions))
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

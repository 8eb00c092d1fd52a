"""Opening upstream TCP connections from a worker (gevent sockets).

``gevent.socket.create_connection`` resolves every address with ``getaddrinfo`` on gevent's
thread pool, numeric ones included: a thread hand-off and two lock round trips per upstream
connection, a fifth of a worker's CPU while many clients connect at once.  Brokers and name
servers are usually configured by IP address, so numeric hosts are connected directly.

The relay's connections are plain sockets (:func:`connect_plain`, and the worker's listener hands
over accepted ones the same way): a gevent socket object makes two libev watchers and a wrapper
(~400 bytes per socket) that a relayed connection never waits on, since its pumps read and write
the descriptor and wait in the worker's reactor or on watchers of their own.  Code that waits
with gevent's blocking calls (TLS, the refusal path, failover) turns one into a gevent socket
first (:func:`to_gevent`).
"""

from __future__ import annotations

import _socket
import errno
import functools
import ipaddress
import os
from typing import Any

import gevent
from gevent import socket


@functools.lru_cache(maxsize=1024)  # a worker's upstreams are few: parse each once
def _family(host: str) -> int | None:
    """AF_INET/AF_INET6 for a numeric host, None for a name to resolve."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.AF_INET6 if ip.version == 6 else socket.AF_INET


def connect_tcp(host: str, port: int, timeout: float) -> socket.socket:
    """A connected TCP socket to ``host:port`` (blocking the calling greenlet at most ``timeout`` s)."""
    family = _family(host)
    if family is None:
        return socket.create_connection((host, port), timeout=timeout)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def to_gevent(sock: Any) -> Any:
    """A plain socket as a gevent socket (the same descriptor), for code that waits with gevent's
    blocking calls; anything else (a gevent socket, a TLS connection) is returned as it is.  A
    plain ``sock`` must not be used afterwards."""
    if not isinstance(sock, _socket.socket):
        return sock
    return socket.socket(sock.family, sock.type, sock.proto, fileno=sock.detach())


def plain(sock: Any) -> _socket.socket:
    """A non-blocking plain socket on ``sock``'s descriptor (a gevent socket gives its descriptor up:
    its watchers go, nothing waits on it any more; a plain socket is returned as it is)."""
    if isinstance(sock, _socket.socket):
        sock.setblocking(False)
        return sock
    raw = _socket.socket(sock.family, sock.type, sock.proto, sock.detach())
    raw.setblocking(False)
    return raw


def connect_plain(host: str, port: int, timeout: float) -> _socket.socket:
    """:func:`connect_tcp` for the relay: a connected, non-blocking plain socket (no gevent socket
    object, no watchers kept: the connect waits on one libev watcher that is closed at once)."""
    family = _family(host)
    if family is None:
        return plain(socket.create_connection((host, port), timeout=timeout))
    raw = _socket.socket(family, _socket.SOCK_STREAM | _socket.SOCK_NONBLOCK)
    try:
        err = raw.connect_ex((host, port))
        if err in (errno.EINPROGRESS, errno.EAGAIN):
            hub = gevent.get_hub()
            watcher = hub.loop.io(raw.fileno(), 2)
            try:
                with gevent.Timeout(timeout, TimeoutError("timed out")):  # gevent's connect says the same
                    hub.wait(watcher)
            finally:
                watcher.close()
            err = raw.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
    except BaseException:
        raw.close()
        raise
    return raw

"""Opening upstream TCP connections from a worker (gevent sockets).

``gevent.socket.create_connection`` resolves every address with ``getaddrinfo`` on gevent's
thread pool, numeric ones included: a thread hand-off and two lock round trips per upstream
connection, a fifth of a worker's CPU while many clients connect at once.  Brokers and name
servers are usually configured by IP address, so numeric hosts are connected directly.
"""

from __future__ import annotations

import functools
import ipaddress

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

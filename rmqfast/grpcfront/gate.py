"""Who may hold a connection of the gRPC front (``[grpc] server = "h2"``), and for how long.

A connection is *pending* from its accept until the client's HTTP/2 preface and first SETTINGS
have arrived (its handshake), then *established*.  The bounds, all checked without reading a byte:

- ``max_connections_per_client`` connections (pending or established) per client address (an IPv6
  client counts by its /64, which one host can rotate through); past it a new connection is closed
  at once;
- ``max_connections`` established connections; a connection that completes its handshake past it
  is closed (after GOAWAY);
- as many pending connections as ``max_connections``; past it the *oldest* pending connection is
  closed to make room, so a flood of half-open connections delays a real client by one handshake
  at most instead of locking it out;
- a pending connection is closed ``handshake_timeout`` seconds after its accept (the TLS handshake,
  when there is one, has the same deadline of its own, see :mod:`rmqfast.grpcfront.server`);
- an established connection with no open stream for ``idle_timeout`` seconds gets GOAWAY and is
  closed.

Every such close is counted by reason (:attr:`Gate.closed`, and
``rmqfast_grpc_connections_closed_total{reason}`` when the process has a metric directory) and
logged at most once per ``_LOG_EVERY`` seconds per reason.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("rmqfast.grpc")

_LOG_EVERY = 10.0  # s between two log lines about connections closed for the same reason
REASONS = ("max_connections", "per_client", "handshake_timeout", "handshake_evicted", "idle")
_WHY = {
    "max_connections": "{n} connections open, the most this process takes ([grpc] max_connections = {cap}); "
                       "raise it, or add workers",
    "per_client": "{n} connections open from {key}, the most one client address may hold "
                  "([grpc] max_connections_per_client = {cap}); raise it if many clients share that address",
    "handshake_timeout": "no HTTP/2 preface and SETTINGS within [grpc] handshake_timeout = {cap} s of the accept",
    "handshake_evicted": "the oldest of {n} connections still in their handshake, closed to make room for a new one "
                         "(at most [grpc] max_connections = {cap} may be in their handshake)",
    "idle": "no open stream for [grpc] idle_timeout = {cap} s: GOAWAY and closed",
}


class Conn(Protocol):
    """What the gate needs of a connection."""

    def shut(self, reason: str) -> None:
        """Close the connection (GOAWAY first where HTTP/2 allows it); the gate was told already."""


def client_key(peername: Any) -> str:
    """The address ``max_connections_per_client`` counts: the IP of an IPv4 (or IPv4-mapped) client,
    the /64 of an IPv6 one; "" when the transport names none (a Unix socket)."""
    host = str(peername[0]) if isinstance(peername, tuple) and peername else ""
    if not host:
        return ""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.ip_network(f"{addr}/64", strict=False))
    return host


def closed_counter() -> Callable[[str], None] | None:
    """``rmqfast_grpc_connections_closed_total{reason}`` in the workers' multiprocess metric files (the
    supervisor's ``PROMETHEUS_MULTIPROC_DIR``, inherited through the worker); None without one."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    try:
        from rmqfast.metrics import light_prometheus

        light_prometheus()
        from prometheus_client import Counter

        counter = Counter("rmqfast_grpc_connections_closed_total",
                          "gRPC front connections closed by a bound: max_connections, per_client, "
                          "handshake_timeout, handshake_evicted, idle", ["reason"])
    except Exception as exc:  # no prometheus-client, an unusable directory: counted in Gate.closed only
        log.warning("gRPC connection closes are not counted in the metrics: %s", exc)
        return None

    def count(reason: str) -> None:
        counter.labels(reason).inc()

    return count


class Gate:
    """The connection bounds of one gRPC front process (see the module's docstring)."""

    def __init__(self, max_connections: int, per_client: int, handshake_timeout: float, idle_timeout: float,
                 clock: Callable[[], float], counter: Callable[[str], None] | None = None) -> None:
        self.max_connections = max_connections
        self.per_client = per_client
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.counter = counter
        self.pending: dict[Conn, float] = {}  # accept time; oldest first (dicts keep insertion order)
        self.established: dict[Conn, None] = {}
        self.by_client: dict[str, int] = {}
        self.keys: dict[Conn, str] = {}
        self.closed = dict.fromkeys(REASONS, 0)
        self.peak = 0  # the most connections open at once since rmqfast.heap last trimmed
        self._logged = dict.fromkeys(REASONS, -_LOG_EVERY)

    def __len__(self) -> int:
        return len(self.pending) + len(self.established)

    def admit(self, conn: Conn, key: str) -> bool:
        """A new connection from ``key`` (see :func:`client_key`): True when it may stay (pending);
        False when it is over its address's cap (counted and logged; close it at once)."""
        n = self.by_client.get(key, 0)
        if key and n >= self.per_client:
            self.refused("per_client", key, n, self.per_client)
            return False
        if len(self.pending) >= self.max_connections:
            oldest = next(iter(self.pending))
            self.refused("handshake_evicted", key, len(self.pending), self.max_connections)
            self.release(oldest)
            oldest.shut("handshake_evicted")
        self.pending[conn] = self.clock()
        self.peak = max(self.peak, len(self))
        self.keys[conn] = key
        if key:
            self.by_client[key] = n + 1
        return True

    def handshaken(self, conn: Conn) -> bool:
        """``conn`` sent its preface and SETTINGS: True when it may stay (established); False when
        ``max_connections`` are established already (counted and logged; close it)."""
        if self.pending.pop(conn, None) is None:
            return conn in self.established
        if len(self.established) >= self.max_connections:
            self.refused("max_connections", self.keys.get(conn, ""), len(self.established), self.max_connections)
            self.release(conn)
            return False
        self.established[conn] = None
        return True

    def release(self, conn: Conn) -> None:
        """``conn`` is gone (or about to be closed): it holds no place any more."""
        self.pending.pop(conn, None)
        self.established.pop(conn, None)
        key = self.keys.pop(conn, None)
        if key:
            n = self.by_client.get(key, 0) - 1
            if n > 0:
                self.by_client[key] = n
            else:
                self.by_client.pop(key, None)

    def refused(self, reason: str, key: str, n: int, cap: float) -> None:
        """Count a connection closed by a bound; one log line per reason per ``_LOG_EVERY`` s."""
        self.closed[reason] += 1
        if self.counter is not None:
            try:
                self.counter(reason)
            except Exception as exc:  # a metric file gone bad must not stop the bound itself
                log.debug("gRPC connection close not counted: %s", exc)
        now = self.clock()
        if now - self._logged[reason] >= _LOG_EVERY:
            self._logged[reason] = now
            why = _WHY[reason].format(n=n, key=key or "?", cap=cap)
            log.warning("gRPC connection from %s closed: %s (%d closed so far for this reason)",
                        key or "?", why, self.closed[reason])

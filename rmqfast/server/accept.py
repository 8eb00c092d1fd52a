"""Admission on the Remoting listeners: connection caps and descriptor shortage on accept.

A worker's open-files limit bounds what it can serve: every client connection costs two
descriptors (the client's socket and its upstream connection).  Without a cap, one client that
keeps opening connections brings the worker to its limit; from then on ``accept`` fails with
EMFILE for everyone, the pending connections of every other client wait in the kernel's accept
queue, and the listener answers nobody (issue 30, finding 1).

* :class:`ConnectionCaps`: a per-worker cap (``proxy.max_connections``; by default derived from
  RLIMIT_NOFILE, leaving room for upstream sockets, RocksDB, logs: :func:`auto_max_connections`)
  and a per-client-address cap (``proxy.max_connections_per_client``; IPv6 counted by /64).  A
  connection past a cap is closed at once; connections from other addresses keep being served.
  Anchors: HAProxy ``maxconn``, nginx ``limit_conn``, Envoy's downstream connection limits.
* :class:`AcceptGuard`: EMFILE/ENFILE/ENOBUFS/ENOMEM on ``accept`` stop the listener for a short,
  doubling back-off (5 ms to :data:`MAX_BACKOFF`, 0.25 s), then it tries again (Go's ``net/http``): no
  traceback loop, one log line per second at most, a counter; the listener is reported blocked
  (``/readyz`` false) until an accept succeeds again.
* :class:`RateLimitedLog`: one JSON line per reason and second, with the count of what it folded.

No Python object is made per accepted connection here beyond the count (a dict entry per
address with connections open).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from rmqfast.log import ctx

log = logging.getLogger("rmqfast.worker")

#: accept errors that mean "this process or system is out of descriptors/memory": back off, retry
SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: accept errors about one connection (it was reset before we took it...): skip it, go on
TRANSIENT_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR})

#: First and longest wait before a listener that hit a descriptor shortage tries again (seconds):
#: the listener serves again within MAX_BACKOFF of descriptors coming free.
MIN_BACKOFF = 0.005
MAX_BACKOFF = 0.25

#: Descriptors a worker keeps for itself at least (listeners, probes, metrics files, logs, RocksDB).
BASE_RESERVED_FDS = 256
#: ... plus this share of the limit (RocksDB opens more files as its spill grows).
RESERVED_FRACTION = 0.1


def is_shortage(exc: BaseException) -> bool:
    """Is ``exc`` the proxy's own shortage of descriptors or buffers (not the peer's fault)?"""
    return isinstance(exc, OSError) and exc.errno in SHORTAGE_ERRNOS


def auto_max_connections(nofile: int | None = None) -> int:
    """The default per-worker cap: half of what the open-files limit leaves after the reserve
    (``BASE_RESERVED_FDS`` plus ``RESERVED_FRACTION`` of the limit), at least 1."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if nofile == resource.RLIM_INFINITY:
            nofile = 1 << 20
    reserve = BASE_RESERVED_FDS + int(nofile * RESERVED_FRACTION)
    return max(1, (nofile - reserve) // 2)


def effective_caps(max_connections: int, per_client: int, nofile: int | None = None) -> tuple[int, int]:
    """(worker cap, per-client cap) from the settings (0: automatic).  The automatic per-client cap
    is half the worker's, so one address never takes everything; a configured cap above the
    worker's is lowered to it."""
    total = max_connections or auto_max_connections(nofile)
    client = per_client or max(1, total // 2)
    return total, min(client, total)


def client_key(host: str) -> str:
    """The address a per-client cap counts by: the IPv4 address, an IPv6 address's /64
    (one host can hold a whole /64), an IPv4-mapped IPv6 address as IPv4."""
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))


class RateLimitedLog:
    """One log line per reason and ``period`` seconds; the lines folded in between are counted in
    the next one (``suppressed``)."""

    def __init__(self, period: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.period = period
        self.clock = clock
        self._last: dict[str, float] = {}
        self._folded: dict[str, int] = {}

    def __call__(self, level: int, reason: str, message: str, **fields: Any) -> bool:
        """Log unless ``reason`` was logged less than ``period`` ago; True when it logged."""
        now = self.clock()
        last = self._last.get(reason)
        if last is not None and now - last < self.period:
            self._folded[reason] = self._folded.get(reason, 0) + 1
            return False
        self._last[reason] = now
        folded = self._folded.pop(reason, 0)
        log.log(level, message, extra=ctx(reason=reason, suppressed=folded, **fields))
        return True


class ConnectionCaps:
    """Counts of a worker's open client connections, in all and per client address."""

    __slots__ = ("total", "per_client", "open", "by_client", "peak")

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self.open = 0
        self.by_client: dict[str, int] = {}
        self.peak = 0  # most connections open since the last heap trim (rmqfast.heap.Trimmer)

    def set_limits(self, total: int, per_client: int) -> None:
        """New caps (a reload); connections open over them are kept, new ones are refused."""
        self.total, self.per_client = total, per_client

    def admit(self, host: str) -> tuple[str, str]:
        """(key, "") and counted when a connection from ``host`` may be served, else (key, why not):
        ``"worker"`` (the worker's cap is reached) or ``"client"`` (this address's)."""
        key = client_key(host)
        n = self.by_client.get(key, 0)
        if n >= self.per_client:
            return key, "client"
        if self.open >= self.total:
            return key, "worker"
        self.by_client[key] = n + 1
        self.open += 1
        if self.open > self.peak:
            self.peak = self.open
        return key, ""

    def admit_over(self, host: str) -> tuple[str, str]:
        """Count a connection past the worker's cap: :meth:`admit` said ``"worker"`` (so this
        address is under its own cap) and a connection was evicted to make room for this one (its
        release follows when its session has ended)."""
        key = client_key(host)
        self.by_client[key] = self.by_client.get(key, 0) + 1
        self.open += 1
        return key, ""

    def full(self) -> bool:
        """Is the worker at its cap (a newcomer needs an eviction)?"""
        return self.open >= self.total

    def release(self, key: str) -> None:
        """A connection admitted under ``key`` has ended (called once per admitted connection)."""
        n = self.by_client.get(key, 0)
        if n <= 1:
            self.by_client.pop(key, None)
        else:
            self.by_client[key] = n - 1
        if self.open > 0:
            self.open -= 1


class ListenMetrics:
    """Prometheus counters of the listeners' admission (created once per worker)."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self.refused = Counter(
            "rmqfast_connections_refused_total",
            "Client connections closed at once on accept, by role and cap reached (worker, client)",
            ["role", "cap"],
        )
        self.accept_errors = Counter(
            "rmqfast_accept_errors_total",
            "Failed accepts on a Remoting listener, by role and errno name (EMFILE, ENFILE...)",
            ["role", "error"],
        )
        self.evicted = Counter(
            "rmqfast_connections_evicted_total",
            "Idle client connections closed at the worker's cap to admit a new one (rmqfast.server.evict), "
            "by role of the evicted connection",
            ["role"],
        )
        self.deadline_closes = Counter(
            "rmqfast_deadline_closes_total",
            "Client connections closed by a deadline, by role and reason (first_frame: no whole frame within "
            "proxy.first_frame_timeout; idle: proxy.idle_timeout; frame_stalled: a frame stopped arriving)",
            ["role", "reason"],
        )
        self.local_shortage = Counter(
            "rmqfast_local_shortage_total",
            "Upstream connects and probes that failed for the proxy's own lack of descriptors or buffers "
            "(never counted against a broker), by where",
            ["where"],
        )


class AcceptGuard:
    """The descriptor-shortage state of one listener: back-off delays, the log and the reports.

    ``on_state(blocked_reason)`` is called when the listener stops being able to accept ("" once
    it accepts again)."""

    def __init__(self, role: str, listen: str, metrics: ListenMetrics | None,
                 on_state: Callable[[str], None], rate_log: RateLimitedLog) -> None:
        self.role = role
        self.listen = listen
        self.metrics = metrics
        self.on_state = on_state
        self.rate_log = rate_log
        self.delay = MIN_BACKOFF
        self.blocked = ""

    def failed(self, exc: OSError) -> float:
        """``accept`` failed with a shortage: the seconds to wait before trying again."""
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        if self.metrics is not None:
            self.metrics.accept_errors.labels(self.role, name).inc()
        delay = self.delay
        self.delay = min(MAX_BACKOFF, self.delay * 2)
        self.rate_log(logging.ERROR, f"accept {name} {self.listen}",
                      "cannot accept on a listener: out of descriptors; backing off",
                      role=self.role, listen=self.listen, error=name, retry_in=round(delay, 3),
                      what_to_do="raise the open-files limit (LimitNOFILE, ulimit -n) or lower "
                                 "proxy.max_connections")
        if not self.blocked:
            self.blocked = f"{self.role} listener {self.listen}: accept fails with {name} (descriptors exhausted)"
            self.on_state(self.blocked)
        return delay

    def accepted(self) -> None:
        """``accept`` worked (or found nothing pending: a descriptor was free for it)."""
        self.delay = MIN_BACKOFF
        if self.blocked:
            self.blocked = ""
            self.rate_log(logging.WARNING, f"accept ok {self.listen}", "listener accepts again",
                          role=self.role, listen=self.listen)
            self.on_state("")

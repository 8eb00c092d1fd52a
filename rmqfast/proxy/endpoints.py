"""Broker endpoints: which proxy port stands for which real broker address.

Clients that do not send the broker name (Go v2, Java <= 4.9.4, C++) pick a broker only by
the address in the route, so every real broker address (masters and slaves) gets a proxy
port of its own, and a connection's upstream is known from the port it arrived on.

Endpoints come from the static ``[[brokers.static]]`` table and, for brokers the routes
reveal later, from ``brokers.port_range``.  Worker processes share nothing but this table:
it lives in ``<state_dir>/endpoints.json``, changed under an exclusive ``flock`` so that two
workers never give one port two meanings, and kept across restarts so that routes clients
cached stay valid.  The worker that allocates a port binds it before publishing it; the
others bind it (SO_REUSEPORT) when they next refresh the table.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rmqfast.config import Config
from rmqfast.log import ctx
from rmqfast.settings.hostport import HostPort, parse_hostport

log = logging.getLogger("rmqfast.endpoints")

STATE_VERSION = 1


@dataclass(frozen=True)
class Endpoint:
    """One broker listener: clients connect to ``listen``; frames go to ``upstream``."""

    listen: HostPort
    upstream: HostPort
    vip: bool = False  # the old clients' VIP channel (port - 2) of another endpoint


class EndpointTableError(Exception):
    pass


class EndpointRegistry:
    """The endpoint table of one worker, kept in step with the shared state file.

    ``bind`` is called with every endpoint this worker must listen on: it returns normally
    once the listener is bound, or raises ``OSError`` (the port is held by someone else).
    """

    def __init__(self, cfg: Config, bind: Callable[[Endpoint], None]) -> None:
        self._bind = bind
        self._auto: dict[str, int] = {}  # real "host:port" -> proxy port
        self._bound: set[HostPort] = set()
        self.reconfigure(cfg)

    # Configuration ----------------------------------------------------------------------

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg
        self.advertise_host = cfg.advertise_host
        self.listen_host = cfg.broker_listen_host
        self.static = {str(s.upstream): s.listen for s in cfg.brokers.static}
        state_dir = Path(cfg.proxy.state_dir)
        self.state_file = state_dir / "endpoints.json"
        self.lock_file = state_dir / "endpoints.lock"

    def endpoints(self) -> list[Endpoint]:
        """Every endpoint this worker should listen on now (static, auto, VIP channels)."""
        out: list[Endpoint] = []
        for s in self.cfg.brokers.static:
            out.extend(self._with_vip(s.listen, s.upstream))
        for real, port in self._auto.items():
            out.extend(self._with_vip(HostPort(self.listen_host, port), parse_hostport("endpoint", real)))
        return out

    def _with_vip(self, listen: HostPort, upstream: HostPort) -> list[Endpoint]:
        eps = [Endpoint(listen, upstream)]
        if self.cfg.brokers.vip_channel and listen.port > 2 and upstream.port > 2:
            eps.append(
                Endpoint(HostPort(listen.host, listen.port - 2), HostPort(upstream.host, upstream.port - 2), vip=True)
            )
        return eps

    # Lookups -------------------------------------------------------------------------------

    def advertised(self, real: str) -> str | None:
        """The proxy address to put in routes instead of the real broker address ``real``.

        Allocates (and binds) a port from the range for a broker not seen before.  Returns
        ``None`` when the broker cannot be mapped (no range configured, range exhausted):
        the caller then leaves the real address in the route and logs it.
        """
        listen = self.static.get(real)
        if listen is not None:
            return f"{self.advertise_host}:{listen.port}"
        port = self._auto.get(real)
        if port is None:
            port = self._allocate(real)
            if port is None:
                return None
        return f"{self.advertise_host}:{port}"

    def is_proxy_address(self, addr: str) -> bool:
        """True when ``addr`` is already one of this proxy's endpoints (a rewritten route)."""
        host, _, port = addr.rpartition(":")
        if host != self.advertise_host or not port.isdigit():
            return False
        p = int(port)
        return p in self._auto.values() or any(s.port == p for s in self.static.values())

    # Shared table ---------------------------------------------------------------------------

    def refresh(self) -> None:
        """Load the shared table and bind whatever other workers allocated."""
        table = self._read()
        if table != self._auto:
            self._auto = table
        self.bind_all()

    def bind_all(self) -> None:
        for ep in self.endpoints():
            if ep.listen in self._bound:
                continue
            try:
                self._bind(ep)
            except OSError as exc:
                log.error(
                    "cannot listen on a broker endpoint",
                    extra=ctx(listen=str(ep.listen), upstream=str(ep.upstream), error=str(exc)),
                )
                continue
            self._bound.add(ep.listen)

    def forget_bound(self, listen: HostPort) -> None:
        self._bound.discard(listen)

    def _read(self) -> dict[str, int]:
        try:
            raw = json.loads(self.state_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):  # the worker's shortage, not the file's
                raise
            raise EndpointTableError(
                f"endpoint table {str(self.state_file)!r} is unreadable ({exc}); fix or delete it "
                "(clients will then re-learn broker endpoints from fresh routes)"
            ) from None
        except ValueError as exc:
            raise EndpointTableError(
                f"endpoint table {str(self.state_file)!r} is unreadable ({exc}); fix or delete it "
                "(clients will then re-learn broker endpoints from fresh routes)"
            ) from None
        if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
            raise EndpointTableError(
                f"endpoint table {str(self.state_file)!r} has an unknown format; expected version {STATE_VERSION}"
            )
        eps = raw.get("endpoints", {})
        return {str(k): int(v) for k, v in eps.items()}

    def _write(self, table: dict[str, int]) -> None:
        tmp = self.state_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": STATE_VERSION, "endpoints": table}, indent=1, sort_keys=True))
        os.replace(tmp, self.state_file)

    def _allocate(self, real: str) -> int | None:
        rng = self.cfg.brokers.port_range
        if rng is None:
            return None
        try:
            upstream = parse_hostport("route broker address", real)
        except ValueError:
            log.warning("route names a broker address that is not host:port", extra=ctx(addr=real))
            return None
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_file, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                table = self._read()
                if real in table:
                    self._auto = table
                    self.bind_all()
                    return table[real]
                used: set[int] = set()
                vip = self.cfg.brokers.vip_channel
                for s in self.cfg.brokers.static:
                    used.update((s.listen.port, s.listen.port - 2))
                for p in table.values():
                    used.update((p, p - 2))
                lo, hi = rng
                for port in range(lo + 2 if vip else lo, hi + 1):
                    if port in used or (vip and port - 2 in used):
                        continue
                    candidates = self._with_vip(HostPort(self.listen_host, port), upstream)
                    try:
                        for ep in candidates:
                            self._bind(ep)
                            self._bound.add(ep.listen)
                    except OSError as exc:
                        log.info("port in range is taken, trying the next", extra=ctx(port=port, error=str(exc)))
                        used.update((port, port - 2))
                        continue
                    table[real] = port
                    self._write(table)
                    self._auto = table
                    log.info("new broker endpoint", extra=ctx(broker=real, port=port))
                    return port
                log.error(
                    "brokers.port_range is exhausted: broker left unmapped in routes",
                    extra=ctx(broker=real, port_range=f"{lo}-{hi}"),
                )
                return None
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

"""``[grpc]``: the RocketMQ 5 gRPC front (``apache.rocketmq.v2.MessagingService``).

Parsed here without importing grpc, so a configuration without the section needs none of the
``rmqfast[grpc]`` packages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rmqfast.errors import ConfigError


@dataclass
class GrpcSection:
    enabled: bool = False
    listen: str = "0.0.0.0:8081"  # host:port, bound with SO_REUSEPORT by every worker's gRPC process
    notify: bool = True  # pop with notify; false: one pop long-polling on one broker (as Apache's proxy)
    max_fanout: int = 8  # brokers a receive sends NOTIFICATION to at once
    min_poll: float = 0.2  # s: no new notification round with less long-poll time left
    long_poll_reserve: float = 0.5  # s kept from the client's deadline for the answer to travel
    request_timeout: float = 3.0  # s: sends, short pops, acks, routes
    connect_timeout: float = 3.0
    route_ttl: float = 5.0  # s a topic's route is cached
    default_invisible: float = 60.0  # s, for receives that name no invisible duration
    max_body_size: int = 4 * 1024 * 1024
    max_connections: int = 10000  # per gRPC process (server = "h2"): handshaken connections; past it closed
    max_connections_per_client: int = 1000  # per client address (IPv6: its /64), handshaken or not (server = "h2")
    handshake_timeout: float = 10.0  # s from accept to the client's preface and first SETTINGS (and the TLS one)
    idle_timeout: float = 300.0  # s with no open stream: GOAWAY and closed
    tls: bool = False  # the listener serves TLS only, with [tls.listen]'s cert, key, ca and verify_client
    server: str = "h2"  # "h2": the nghttp2 server (rmqfast.grpcfront.h2server); "grpcio": grpc.aio

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_FLOATS = {"min_poll": (0.01, 60.0), "long_poll_reserve": (0.0, 10.0), "request_timeout": (0.1, 60.0),
           "connect_timeout": (0.1, 60.0), "route_ttl": (0.1, 3600.0), "default_invisible": (1.0, 43200.0),
           "handshake_timeout": (0.05, 600.0), "idle_timeout": (0.1, 86400.0)}
_INTS = {"max_fanout": (1, 256), "max_body_size": (1, 1 << 30), "max_connections": (1, 1_000_000),
         "max_connections_per_client": (1, 1_000_000)}
SERVERS = ("h2", "grpcio")
KEYS = {"enabled", "notify", "tls", "listen", "server", *_FLOATS, *_INTS}


def parse_grpc(raw: Any) -> GrpcSection:
    if not isinstance(raw, dict):
        raise ConfigError("grpc: must be a table")
    unknown = set(raw) - KEYS
    if unknown:
        raise ConfigError(f"grpc: unknown key(s) {', '.join(sorted(unknown))}")
    s = GrpcSection()
    for k in ("enabled", "notify", "tls"):
        if k in raw:
            if not isinstance(raw[k], bool):
                raise ConfigError(f"grpc.{k}: must be true or false")
            setattr(s, k, raw[k])
    if "listen" in raw:
        v = raw["listen"]
        host, sep, port = str(v).rpartition(":")
        if not isinstance(v, str) or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"grpc.listen: expected host:port, got {v!r}")
        s.listen = v
    _parse_server(raw, s)
    for k, (lo, hi) in _FLOATS.items():
        if k in raw:
            v = raw[k]
            if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
                raise ConfigError(f"grpc.{k}: expected a number in [{lo}, {hi}], got {v!r}")
            setattr(s, k, float(v))
    for k, (lo, hi) in _INTS.items():
        if k in raw:
            v = raw[k]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"grpc.{k}: expected an integer in [{lo}, {hi}], got {v!r}")
            setattr(s, k, v)
    return s


def _parse_server(raw: dict[str, Any], s: GrpcSection) -> None:
    """``server``: "h2" (the nghttp2 server, rmqfast.grpcfront.h2server) or "grpcio" (grpc.aio); "h2" needs its
    binding built (libnghttp2-dev at build time)."""
    if "server" in raw:
        if raw["server"] not in SERVERS:
            raise ConfigError(f'grpc.server: expected "h2" (the nghttp2 server) or "grpcio" (grpc.aio), '
                              f'got {raw["server"]!r}')
        s.server = raw["server"]
    if s.enabled and s.server == "h2":
        try:
            from rmqfast.grpcfront.h2server import H2Unavailable, available
        except ImportError as exc:
            raise ConfigError(f'grpc.server = "h2": {exc}') from exc
        try:
            available()
        except H2Unavailable as exc:
            raise ConfigError(f"grpc.server: {exc}") from exc


def check_tls(s: GrpcSection, tls: Any) -> None:
    """``[grpc] tls = true`` takes the listener certificate of ``[tls.listen]`` (a ``TlsSection``; its
    ``mode`` is the Remoting listeners' and may stay "disabled"): ``cert`` and ``key`` must be set;
    grpc takes the key unencrypted (no ``key_password``) and either asks for no client certificate
    (``verify_client = "none"``) or requires one chaining to ``ca`` (``"require"``): it cannot ask
    for an optional one."""
    if not s.tls:
        return
    L = tls.listen
    if not L.cert or not L.key:
        raise ConfigError("grpc.tls: needs tls.listen.cert and tls.listen.key (the listener certificate)")
    if L.key_password:
        raise ConfigError("grpc.tls: the gRPC listener takes an unencrypted key (tls.listen.key_password is set)")
    if L.verify_client == "optional":
        raise ConfigError('grpc.tls: tls.listen.verify_client = "optional" is not possible with gRPC '
                          '(use "none" or "require")')
    if L.verify_client == "require" and not L.ca:
        raise ConfigError('grpc.tls: tls.listen.verify_client = "require" needs tls.listen.ca')
    from rmqfast.proxy.tls import server_context

    server_context(L)  # the files read and the key checked against the certificate now, not at the front's start


def server_credentials(tls: Any) -> Any:
    """grpc's server credentials from ``[tls.listen]`` (see :func:`check_tls`)."""
    import grpc

    L = tls.listen
    with open(L.cert, "rb") as f:
        cert = f.read()
    with open(L.key, "rb") as f:
        key = f.read()
    ca = None
    if L.ca:
        with open(L.ca, "rb") as f:
            ca = f.read()
    require = L.verify_client == "require"
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca if require else None,
                                       require_client_auth=require)

"""``[grpc]``: the RocketMQ 5 gRPC front (``apache.rocketmq.v2.MessagingService``).

Parsed here without importing grpc, so a configuration without the section needs none of the
``rmqfast[grpc]`` packages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rmqfast.errors import ConfigError
from rmqfast.settings.base import toml_value
from rmqfast.settings.engine import parse_section, section, setting, toml_keys

SERVERS = ("h2", "grpcio")


def _listen(key: str, v: Any) -> str:
    host, sep, port = str(v).rpartition(":")
    if not isinstance(v, str) or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f'{key}: {toml_value(v)} is not allowed; expected "host:port"')
    return v


@section("grpc", "The RocketMQ 5 gRPC front (apache.rocketmq.v2.MessagingService).", parse=lambda raw: parse_grpc(raw))
@dataclass
class GrpcSection:
    enabled: bool = setting(False, doc="serve RocketMQ 5 gRPC clients")
    listen: str = setting("0.0.0.0:8081", parse=_listen, expect='"host:port"',
                          doc="bound with SO_REUSEPORT by every worker's gRPC process")
    notify: bool = setting(True, doc="pop with notify; false: one pop long-polling on one broker (as Apache's proxy)")
    max_fanout: int = setting(8, lo=1, hi=256, doc="brokers a receive sends NOTIFICATION to at once")
    min_poll: float = setting(0.2, kind="duration", lo=0.01, hi=60,
                              doc="no new notification round with less long-poll time left")
    long_poll_reserve: float = setting(0.5, kind="duration", lo=0, hi=10,
                                       doc="kept from the client's deadline for the answer to travel")
    request_timeout: float = setting(3.0, kind="duration", lo=0.1, hi=60, doc="sends, short pops, acks, routes")
    connect_timeout: float = setting(3.0, kind="duration", lo=0.1, hi=60, doc="connecting to a broker")
    route_ttl: float = setting(5.0, kind="duration", lo=0.1, hi=3600, doc="a topic's route is cached this long")
    default_invisible: float = setting(60.0, kind="duration", lo=1, hi=43200,
                                       doc="for receives that name no invisible duration")
    max_body_size: int = setting(4 << 20, kind="size", lo=1, hi=1 << 30, doc="largest message body")
    max_connections: int = setting(10000, lo=1, hi=1_000_000,
                                   doc='per gRPC process (server = "h2"): handshaken connections; past it closed')
    max_connections_per_client: int = setting(1000, lo=1, hi=1_000_000,
                                              doc="per client address (IPv6: its /64), handshaken or not")
    handshake_timeout: float = setting(10.0, kind="duration", lo=0.05, hi=600,
                                       doc="from accept to the client's preface and first SETTINGS (and TLS)")
    idle_timeout: float = setting(300.0, kind="duration", lo=0.1, hi=86400, doc="with no open stream: GOAWAY, closed")
    tls: bool = setting(False, doc="serve TLS only, with [tls.listen]'s cert, key, ca and verify_client")
    server: str = setting("h2", choices=SERVERS,
                          doc='"h2": the nghttp2 server (rmqfast.grpcfront.h2server); "grpcio": grpc.aio')

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


KEYS = set(toml_keys(GrpcSection))


def parse_grpc(raw: Any) -> GrpcSection:
    """Validate ``[grpc]``; every problem reported at once (the h2 binding checked when it is used)."""
    s = parse_section(GrpcSection, "grpc", raw)
    _check_server(s)
    return s


def _check_server(s: GrpcSection) -> None:
    """``server = "h2"`` (the nghttp2 server, rmqfast.grpcfront.h2server) needs its binding built
    (libnghttp2-dev at build time)."""
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

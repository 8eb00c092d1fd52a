"""Configuration: a TOML file, overridden by quick-start command-line flags, validated at start.

Every error names the key, the bad value and what is allowed, e.g.::

    proxy.workers: -1 is not allowed; expected an integer from 0 (one per CPU) to 256

The validated :class:`Config` is plain data (dataclasses), serialisable to JSON so the
supervisor can hand exactly the same configuration to every worker process.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rmqfast.delay.settings import DelaySection, parse_delay
from rmqfast.errors import ConfigError
from rmqfast.gray.config import GraySection, parse_gray
from rmqfast.grpcfront.settings import KEYS as GRPC_KEYS
from rmqfast.grpcfront.settings import GrpcSection, parse_grpc
from rmqfast.grpcfront.settings import check_tls as check_grpc_tls
from rmqfast.limits.rules import LimitsSection, parse_limits, parse_rule
from rmqfast.proxy.acl import AclSection, parse_acl
from rmqfast.proxy.health import FailoverSection, parse_failover
from rmqfast.proxy.tls import TlsSection, parse_tls
from rmqfast.server.admin_names import parse_allowed_hosts
from rmqfast.settings.base import ConfigErrors as ConfigErrors  # re-exported: rmqfast.config.ConfigErrors
from rmqfast.settings.base import Errors as _Errors
from rmqfast.settings.base import boolean as _bool
from rmqfast.settings.base import check_keys as _check_keys
from rmqfast.settings.base import choice as _choice
from rmqfast.settings.base import integer as _int
from rmqfast.settings.base import seconds as _float
from rmqfast.settings.base import string as _str
from rmqfast.settings.base import table as _table
from rmqfast.settings.base import toml_value as _t
from rmqfast.settings.base import toml_value as toml_value  # re-exported
from rmqfast.settings.base import valid_host
from rmqfast.settings.cpus import usable_cpus_at_start
from rmqfast.settings.hostport import HostPort as HostPort  # re-exported: rmqfast.config.HostPort
from rmqfast.settings.hostport import parse_hostport as parse_hostport  # re-exported
from rmqfast.settings.hostport import parse_hostport_list as parse_hostport_list  # re-exported

DEFAULT_NAMESRV_LISTEN = "127.0.0.1:9876"


@dataclass(frozen=True)
class StaticBroker:
    listen: HostPort
    upstream: HostPort


@dataclass
class ProxySection:
    workers: int = 0
    advertise_host: str = ""
    max_frame_size: int = 16 * 1024 * 1024
    max_header_size: int = 1024 * 1024
    buffer_size: int = 256 * 1024
    connect_timeout: float = 3.0
    idle_timeout: float = 120.0
    drain_timeout: float = 10.0
    state_dir: str = ".rmqfast-state"
    # seconds a frame a peer started sending may wait for its next bytes (0: no deadline)
    frame_timeout: float = 30.0
    # bytes per worker for frames held whole (policy, limited sends, batches) beyond the base buffers
    buffer_budget: int = 64 * 1024 * 1024
    # client connections per worker on the Remoting listeners (0: from the open-files limit)
    max_connections: int = 0
    # ... per client address, IPv6 by /64 (0: half of the worker's cap)
    max_connections_per_client: int = 0
    # seconds a new Remoting connection may take to send its first frame (0: no deadline)
    first_frame_timeout: float = 10.0


@dataclass
class NamesrvSection:
    listen: HostPort | None = None
    upstreams: list[HostPort] = field(default_factory=list)


@dataclass
class BrokersSection:
    port_range: tuple[int, int] | None = (30900, 30999)
    listen_host: str = ""
    vip_channel: bool = True
    static: list[StaticBroker] = field(default_factory=list)


@dataclass
class PolicySection:
    allow_codes: list[int] = field(default_factory=list)
    deny_codes: list[int] = field(default_factory=list)
    # "read-only-admin": also let through the read-only admin codes (rmqfast.codec.admincodes)
    preset: str = ""
    # broker addresses inside messages (rmqfast.proxy.addresses): "all" (store hosts in pull, pop,
    # query and view answers and the offset msgId of send answers, both mapped in C), "records"
    # (not the send answers: queryMsgById then reaches the real broker), "off"
    message_addresses: str = "all"


@dataclass
class AdminSection:
    listen: HostPort | None = None
    # Required (as "Authorization: Bearer <token>") to change limits over HTTP; without one,
    # changes are accepted only when the admin endpoint listens on a loopback address.
    token: str = ""
    # Names (besides its listen address, localhost, 127.0.0.1, [::1] and $POD_IP) a request may
    # give in Host or Origin: "name" with any port, "name:port" with that one (rmqfast.server.admin_names)
    allowed_hosts: list[str] = field(default_factory=list)


@dataclass
class LogSection:
    format: str = "json"
    level: str = "info"


@dataclass
class RecordsSection:
    """``[records]``: traffic records for the Spark jobs (docs/records.md)."""

    enabled: bool = False
    dir: str = "records"
    rotate_seconds: float = 60.0
    rotate_bytes: int = 64 << 20
    sample_rate: float = 0.0  # share of requests written as sampled per-request records
    format: str = "parquet"  # parquet | jsonl


@dataclass
class RemoteCloud:
    """A remote cluster copies are delivered to: a name and its name servers ('host:port')."""

    name: str
    namesrv: list[str] = field(default_factory=list)
    # the proxy's own credentials in that cluster (brokers with ACL on): copies and the online
    # detector's questions are signed with them (rmqfast.codec.aclsign)
    access_key: str = ""
    secret_key: str = ""

    @property
    def credentials(self) -> tuple[str, str] | None:
        return (self.access_key, self.secret_key) if self.access_key else None


@dataclass
class CloudsSection:
    local: str = "local"
    detect_interval: float = 2.0
    detect_timeout: float = 3.0
    remotes: list[RemoteCloud] = field(default_factory=list)


@dataclass
class TopicRule:
    """``[[replicate.topic]]``: when copies of a topic go to remote clouds."""

    name: str
    replicate: str = "online"  # online | always | never
    tags: list[str] = field(default_factory=list)  # empty: every tag
    remotes: list[str] = field(default_factory=list)  # empty: every remote
    groups: list[str] = field(default_factory=list)  # consumer groups to ask the remotes about


@dataclass
class ReplicateSection:
    durability: str = "fast"  # fast | durable
    default: str = "never"  # rule for topics no [[replicate.topic]] names
    channel_size: int = 10000
    disk_cap_bytes: int = 1 << 30
    on_disk_full: str = "reject"  # reject | drop
    # RocksDB memory of a worker's spill (also what holds [delay] messages): up to two memtables of
    # write_buffer_bytes and the block cache (index partitions included); with 8 MiB each a worker
    # holding 10 M delayed messages peaked at 68 MB RSS while accepting; 57 MB with 4 MiB each and
    # partitioned indexes (bench/delay_bench.py)
    write_buffer_bytes: int = 4 << 20
    block_cache_bytes: int = 4 << 20
    deliver_processes: int = 1
    max_in_flight: int = 1024
    retry_initial: float = 0.1
    retry_max: float = 5.0
    # seconds a deliver process holds the other workers' copies after a worker's link broke, until
    # that worker's replacement handed over the copies it inherited (order across a worker crash)
    order_hold_max: float = 30.0
    topics: list[TopicRule] = field(default_factory=list)


@dataclass
class Config:
    proxy: ProxySection = field(default_factory=ProxySection)
    namesrv: NamesrvSection = field(default_factory=NamesrvSection)
    brokers: BrokersSection = field(default_factory=BrokersSection)
    policy: PolicySection = field(default_factory=PolicySection)
    admin: AdminSection = field(default_factory=AdminSection)
    log: LogSection = field(default_factory=LogSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    records: RecordsSection = field(default_factory=RecordsSection)
    clouds: CloudsSection = field(default_factory=CloudsSection)
    replicate: ReplicateSection = field(default_factory=ReplicateSection)
    failover: FailoverSection = field(default_factory=FailoverSection)  # [failover] (rmqfast.proxy.health)
    delay: DelaySection = field(default_factory=DelaySection)  # [delay] (rmqfast.delay)
    acl: AclSection = field(default_factory=AclSection)  # [acl]: per-AccessKey topic allowlist (rmqfast.proxy.acl)
    tls: TlsSection = field(default_factory=TlsSection)  # [tls.listen], [tls.upstream] (rmqfast.proxy.tls)
    gray: GraySection = field(default_factory=GraySection)  # [gray]: canary releases (rmqfast.gray)
    grpc: GrpcSection = field(default_factory=GrpcSection)  # [grpc]: RocketMQ 5 gRPC front (rmqfast.grpcfront)

    @property
    def replication_enabled(self) -> bool:
        """Copies are taken only when at least one remote cloud is configured."""
        return bool(self.clouds.remotes)

    # Derived values -------------------------------------------------------------------

    @property
    def worker_count(self) -> int:
        """``proxy.workers``, or (0) one per CPU this process may use: its affinity mask, capped
        by its cgroup's CPU quota (a container's CPU limit), worked out once per process
        (``rmqfast.settings.cpus``: the count stays what the workers were started with)."""
        if self.proxy.workers:
            return self.proxy.workers
        return usable_cpus_at_start()

    @property
    def advertise_host(self) -> str:
        """Host written into rewritten routes: where clients reach the broker endpoints."""
        if self.proxy.advertise_host:
            return self.proxy.advertise_host
        assert self.namesrv.listen is not None
        return self.namesrv.listen.host

    @property
    def broker_listen_host(self) -> str:
        """Host the automatically allocated broker endpoints bind."""
        if self.brokers.listen_host:
            return self.brokers.listen_host
        assert self.namesrv.listen is not None
        return self.namesrv.listen.host

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


# --------------------------------------------------------------------------------------
# Errors: every problem in a file is reported at once, values written as TOML writes them.


# --------------------------------------------------------------------------------------
# Parsing helpers: each takes the dotted key for its error messages.

def parse_port_range(key: str, value: Any) -> tuple[int, int] | None:
    if value in ("", None, False):
        return None
    if isinstance(value, str) and "-" in value:
        a, _, b = value.partition("-")
        if a.strip().isdigit() and b.strip().isdigit():
            lo, hi = int(a), int(b)
            if 1 <= lo <= hi <= 65535 and hi - lo >= 2:
                return lo, hi
    raise ConfigError(
        f"{key}: {_t(value)} is not allowed; expected \"FIRST-LAST\" with 1 <= FIRST, FIRST+2 <= LAST "
        "<= 65535 (e.g. \"30900-30999\"), or \"\" to disable automatic broker endpoints"
    )


def _codes(key: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a list of request codes")
    errs = _Errors()
    out = []
    for i, v in enumerate(value):
        with errs.check():
            out.append(_int(f"{key}[{i}]", v, 0, 2**31 - 1))
    errs.raise_if_any()
    return out


_KNOWN = {
    "proxy": {
        "workers",
        "advertise_host",
        "max_frame_size",
        "max_header_size",
        "buffer_size",
        "connect_timeout",
        "idle_timeout",
        "drain_timeout",
        "state_dir",
        "frame_timeout",
        "buffer_budget",
        "max_connections",
        "max_connections_per_client",
        "first_frame_timeout",
    },
    "namesrv": {"listen", "upstreams"},
    "brokers": {"port_range", "listen_host", "vip_channel", "static"},
    "policy": {"allow_codes", "deny_codes", "preset", "message_addresses"},
    "admin": {"listen", "token", "allowed_hosts"},
    "limits": {"global_rate", "global_burst", "global_bytes_rate", "global_bytes_burst", "rule"},
    "log": {"format", "level"},
    "records": {"enabled", "dir", "rotate_seconds", "rotate_bytes", "sample_rate", "format"},
    "clouds": {"local", "detect_interval", "detect_timeout", "remote"},
    "replicate": {
        "durability",
        "default",
        "channel_size",
        "disk_cap_bytes",
        "on_disk_full",
        "write_buffer_bytes",
        "block_cache_bytes",
        "deliver_processes",
        "max_in_flight",
        "retry_initial",
        "retry_max",
        "order_hold_max",
        "topic",
    },
    "delay": {"topics", "max_pending_bytes", "max_delay", "levels", "release_in_flight", "queue_window"},
    "acl": {"topics", "unsigned", "other_keys", "secret_keys", "signature_max_age"},
    "tls": {"listen", "upstream"},
    "gray": {"settle", "grace", "drain_timeout", "backlog_interval", "state_file", "group"},
    "grpc": set(GRPC_KEYS),
    "failover": {"enabled", "heal_routes", "probe_interval", "probe_interval_down", "probe_timeout", "hang_timeout",
                 "send_timeout", "ordered_topics", "ordered_property", "go_away", "resend"},
}

_REPLICATE_CHOICES = ("online", "always", "never")
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _name(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 64 or not set(value) <= _NAME_CHARS:
        raise ConfigError(
            f"{key}: {_t(value)} is not allowed; expected a name of 1 to 64 letters, digits, '-', '_' or '.'"
        )
    return value


def _str_list(key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a list of non-empty strings")
    return list(value)


def _section(errs: _Errors, raw: dict[str, Any], name: str) -> dict[str, Any]:
    """The known keys of table ``raw[name]`` ({} when absent or not a table); errors recorded."""
    with errs.check():
        tbl = _table(name, raw.get(name, {}))
        with errs.check():
            _check_keys(name, tbl, _KNOWN[name])
        return {k: v for k, v in tbl.items() if k in _KNOWN[name]}
    return {}


def _parse_clouds(cfg: Config, raw: dict[str, Any], errs: _Errors) -> None:
    cl = _section(errs, raw, "clouds")
    c = cfg.clouds
    _set(errs, cl, c, "clouds", "local", _name)
    _set(errs, cl, c, "clouds", "detect_interval", lambda key, v: _float(key, v, 0.1, 3600))
    _set(errs, cl, c, "clouds", "detect_timeout", lambda key, v: _float(key, v, 0.1, 60))
    remotes = cl.get("remote", [])
    if not isinstance(remotes, list):
        errs.messages.append(
            f"clouds.remote: {_t(remotes)} is not allowed; expected an array of tables [[clouds.remote]]")
        remotes = []
    for i, r in enumerate(remotes):
        with errs.check():
            c.remotes.append(_parse_remote(f"clouds.remote[{i}]", r, c))

    rp = _section(errs, raw, "replicate")
    r = cfg.replicate
    for k, choices in (("durability", ("fast", "durable")), ("default", _REPLICATE_CHOICES),
                       ("on_disk_full", ("reject", "drop"))):
        _set(errs, rp, r, "replicate", k, lambda key, v, choices=choices: _choice(key, v, choices))
    for k, lo, hi in (
        ("channel_size", 0, 10_000_000),
        ("disk_cap_bytes", 1 << 20, 1 << 50),
        ("write_buffer_bytes", 64 << 10, 1 << 30),
        ("block_cache_bytes", 64 << 10, 1 << 34),
        ("deliver_processes", 1, 64),
        ("max_in_flight", 1, 1_000_000),
    ):
        _set(errs, rp, r, "replicate", k, lambda key, v, lo=lo, hi=hi: _int(key, v, lo, hi))
    for k, flo, fhi in (("retry_initial", 0.001, 60), ("retry_max", 0.01, 3600), ("order_hold_max", 0.0, 3600)):
        _set(errs, rp, r, "replicate", k, lambda key, v, flo=flo, fhi=fhi: _float(key, v, flo, fhi))
    topics = rp.get("topic", [])
    if not isinstance(topics, list):
        errs.messages.append(
            f"replicate.topic: {_t(topics)} is not allowed; expected an array of tables [[replicate.topic]]")
        topics = []
    for i, t in enumerate(topics):
        with errs.check():
            r.topics.append(_parse_topic_rule(f"replicate.topic[{i}]", t, c, r))


def _parse_remote(key: str, r: Any, c: CloudsSection) -> RemoteCloud:
    r = _table(key, r)
    _check_keys(key, r, {"name", "namesrv", "access_key", "secret_key"})
    if "name" not in r or "namesrv" not in r:
        raise ConfigError(f"{key}: both 'name' and 'namesrv' (the remote name servers) are required")
    creds = [_str(f"{key}.{k}", r.get(k, "")) for k in ("access_key", "secret_key")]
    if bool(creds[0]) != bool(creds[1]):
        raise ConfigError(f"{key}: 'access_key' and 'secret_key' go together (the proxy's own credentials in that "
                          "cluster, for brokers with ACL on); give both or neither")
    name = _name(f"{key}.name", r["name"])
    if name == c.local:
        raise ConfigError(f"{key}.name: {_t(name)} is the local cloud's name (clouds.local); pick another")
    if any(x.name == name for x in c.remotes):
        raise ConfigError(f"{key}.name: {_t(name)} is used by another [[clouds.remote]]")
    ns = [str(hp) for hp in parse_hostport_list(f"{key}.namesrv", r["namesrv"])]
    if not ns:
        raise ConfigError(f"{key}.namesrv: [] is not allowed; expected at least one \"host:port\"")
    return RemoteCloud(name, ns, *creds)


def _parse_topic_rule(key: str, t: Any, c: CloudsSection, r: ReplicateSection) -> TopicRule:
    t = _table(key, t)
    _check_keys(key, t, {"name", "replicate", "tags", "remotes", "groups"})
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise ConfigError(f"{key}.name: {_t(t.get('name'))} is not allowed; expected the topic name")
    errs = _Errors()
    fields: dict[str, Any] = {}
    with errs.check():
        fields["replicate"] = _choice(f"{key}.replicate", t.get("replicate", "online"), _REPLICATE_CHOICES)
    for k in ("tags", "remotes", "groups"):
        with errs.check():
            fields[k] = _str_list(f"{key}.{k}", t.get(k, []))
    names = {x.name for x in c.remotes}
    for rn in fields.get("remotes", []):
        if rn not in names:
            errs.messages.append(
                f"{key}.remotes: {_t(rn)} is not a configured remote; known: {', '.join(sorted(names)) or 'none'}")
    if any(x.name == t["name"] for x in r.topics):
        errs.messages.append(f"{key}.name: topic {_t(t['name'])} has another rule already")
    errs.raise_if_any()
    return TopicRule(t["name"], fields["replicate"], fields["tags"], fields["remotes"], fields["groups"])


def from_dict(raw: dict[str, Any]) -> Config:
    """Validate a parsed TOML document (plus overrides) into a :class:`Config`.

    Every problem is found in one pass: one :class:`ConfigError` for a single problem, a
    :class:`ConfigErrors` (``.errors``, one message per line) for several.
    """
    errs = _Errors()
    with errs.check():
        _check_keys("", raw, set(_KNOWN))
    cfg = Config()
    _parse_proxy(cfg, raw, errs)
    _parse_namesrv(cfg, raw, errs)
    _parse_brokers(cfg, raw, errs)
    _parse_policy(cfg, raw, errs)
    ad = _section(errs, raw, "admin")
    with errs.check():
        if ad.get("listen"):
            cfg.admin.listen = parse_hostport("admin.listen", ad["listen"])
    _set(errs, ad, cfg.admin, "admin", "token", _str)
    _set(errs, ad, cfg.admin, "admin", "allowed_hosts", parse_allowed_hosts)
    _parse_limits(cfg, raw, errs)
    lg = _section(errs, raw, "log")
    with errs.check():
        cfg.log.format = _choice("log.format", lg.get("format", "json"), ("json", "human"))
    with errs.check():
        cfg.log.level = _choice("log.level", lg.get("level", "info"), ("debug", "info", "warning", "error"))

    _parse_records(cfg, raw, errs)
    _parse_clouds(cfg, raw, errs)
    with errs.check():
        if "failover" in raw:
            cfg.failover = parse_failover(raw["failover"])
    with errs.check():
        if "delay" in raw:
            cfg.delay = parse_delay(raw["delay"])
    with errs.check():
        if "acl" in raw:
            cfg.acl = parse_acl(raw["acl"])
    with errs.check():
        if "tls" in raw:
            cfg.tls = parse_tls(raw["tls"])  # loads the certificate files: a bad file is a config error
    with errs.check():
        if "gray" in raw:
            cfg.gray = parse_gray(raw["gray"])
    with errs.check():
        if "grpc" in raw:
            cfg.grpc = parse_grpc(raw["grpc"])
            if not errs.any_under("tls"):  # the listener certificate of [tls.listen], read above
                check_grpc_tls(cfg.grpc, cfg.tls)

    # cross-field checks only on values that parsed (else they would report the defaults)
    if not errs.any_under("namesrv.listen", "brokers", "admin.listen", "proxy.advertise_host"):
        _check_ports(cfg, errs)
    errs.raise_if_any()
    return cfg


def _set(errs: _Errors, section: dict[str, Any], target: Any, where: str, key: str,
         parse: Callable[[str, Any], Any]) -> None:
    """``target.key = parse("where.key", value)`` when the section has the key; a problem is recorded."""
    with errs.check():
        if key in section:
            setattr(target, key, parse(f"{where}.{key}", section[key]))


def _parse_proxy(cfg: Config, raw: dict[str, Any], errs: _Errors) -> None:
    px = _section(errs, raw, "proxy")
    p = cfg.proxy
    ints = (("workers", 0, 256, " (one per CPU)"), ("max_frame_size", 1024, 1 << 30, ""),
            ("max_header_size", 64, 0xFFFFFF, ""), ("buffer_size", 4096, 64 << 20, ""))
    for k, lo, hi, what in ints:
        _set(errs, px, p, "proxy", k, lambda key, v, lo=lo, hi=hi, what=what: _int(key, v, lo, hi, what))
    for k, flo, fhi in (("connect_timeout", 0.1, 60), ("idle_timeout", 20, 86400), ("drain_timeout", 0, 600)):
        _set(errs, px, p, "proxy", k, lambda key, v, flo=flo, fhi=fhi: _float(key, v, flo, fhi))
    for k in ("advertise_host", "state_dir"):
        _set(errs, px, p, "proxy", k, _str)
    with errs.check():
        if "frame_timeout" in px:
            p.frame_timeout = _float("proxy.frame_timeout", px["frame_timeout"], 0, 3600)
            if 0 < p.frame_timeout < 1:
                raise ConfigError(f"proxy.frame_timeout: {p.frame_timeout!r} is not allowed; use 0 (no deadline) "
                                  "or at least 1 second")
    _set(errs, px, p, "proxy", "buffer_budget", lambda key, v: _int(key, v, 1 << 20, 1 << 40, " (1 MiB)"))
    for k in ("max_connections", "max_connections_per_client"):  # 0: automatic (rmqfast.server.accept)
        _set(errs, px, p, "proxy", k, lambda key, v: _int(key, v, 0, 1 << 24, " (0: automatic)"))
    with errs.check():
        if "first_frame_timeout" in px:
            p.first_frame_timeout = _float("proxy.first_frame_timeout", px["first_frame_timeout"], 0, 3600)
            if 0 < p.first_frame_timeout < 1:
                raise ConfigError(f"proxy.first_frame_timeout: {p.first_frame_timeout!r} is not allowed; use 0 "
                                  "(no deadline) or at least 1 second")
    if 0 < p.max_connections < p.max_connections_per_client:
        errs.messages.append(
            f"proxy.max_connections_per_client: {p.max_connections_per_client} is not allowed; it must not "
            f"exceed proxy.max_connections ({p.max_connections})"
        )
    if p.max_header_size > p.max_frame_size:
        errs.messages.append(
            f"proxy.max_header_size: {p.max_header_size} is not allowed; it must not exceed "
            f"proxy.max_frame_size ({p.max_frame_size})"
        )


def _parse_namesrv(cfg: Config, raw: dict[str, Any], errs: _Errors) -> None:
    ns = _section(errs, raw, "namesrv")
    with errs.check():
        cfg.namesrv.listen = parse_hostport("namesrv.listen", ns.get("listen", DEFAULT_NAMESRV_LISTEN))
    with errs.check():
        ups = ns.get("upstreams", [])
        if not isinstance(ups, list | str) or not ups:
            raise ConfigError(
                f"namesrv.upstreams: {_t(ups)} is not allowed; expected a non-empty list of \"host:port\" "
                "(the real RocketMQ name servers), e.g. [\"10.0.0.1:9876\"]"
            )
        cfg.namesrv.upstreams = parse_hostport_list("namesrv.upstreams", ups)


def _parse_brokers(cfg: Config, raw: dict[str, Any], errs: _Errors) -> None:
    br = _section(errs, raw, "brokers")
    b = cfg.brokers
    _set(errs, br, b, "brokers", "port_range", parse_port_range)
    _set(errs, br, b, "brokers", "listen_host", _str)
    _set(errs, br, b, "brokers", "vip_channel", _bool)
    statics = br.get("static", [])
    if not isinstance(statics, list):
        errs.messages.append(f"brokers.static: {_t(statics)} is not allowed; expected an array of tables")
        statics = []
    for i, s in enumerate(statics):
        key = f"brokers.static[{i}]"
        with errs.check():
            s = _table(key, s)
            _check_keys(key, s, {"listen", "upstream"})
            if "listen" not in s or "upstream" not in s:
                raise ConfigError(f"{key}: both 'listen' and 'upstream' are required")
            b.static.append(StaticBroker(parse_hostport(f"{key}.listen", s["listen"]),
                                         parse_hostport(f"{key}.upstream", s["upstream"])))


def _parse_policy(cfg: Config, raw: dict[str, Any], errs: _Errors) -> None:
    po = _section(errs, raw, "policy")
    with errs.check():
        cfg.policy.allow_codes = _codes("policy.allow_codes", po.get("allow_codes", []))
    with errs.check():
        cfg.policy.deny_codes = _codes("policy.deny_codes", po.get("deny_codes", []))
    _set(errs, po, cfg.policy, "policy", "preset", lambda key, v: _choice(key, v, ("", "read-only-admin")))
    _set(errs, po, cfg.policy, "policy", "message_addresses",
         lambda key, v: _choice(key, v, ("records", "all", "off")))


def _parse_limits(cfg: Config, raw: dict[str, Any], errs: _Errors) -> None:
    """``[limits]``: each rule checked on its own first, so every bad rule is reported."""
    lim = raw.get("limits", {})
    before = len(errs.messages)
    if isinstance(lim, dict) and isinstance(lim.get("rule"), list):
        for i, r in enumerate(lim["rule"]):
            with errs.check():
                parse_rule(f"limits.rule[{i}]", r)
    if len(errs.messages) == before:
        with errs.check():
            cfg.limits = parse_limits(lim)


def _parse_records(cfg: Config, raw: dict[str, Any], errs: _Errors) -> None:
    rc = _section(errs, raw, "records")
    r = cfg.records
    _set(errs, rc, r, "records", "enabled", _bool)
    with errs.check():
        if "dir" in rc:
            r.dir = _str("records.dir", rc["dir"])
            if not r.dir:
                raise ConfigError("records.dir: \"\" is not allowed; expected a directory path (created if missing)")
    _set(errs, rc, r, "records", "rotate_seconds", lambda key, v: _float(key, v, 1, 86400))
    _set(errs, rc, r, "records", "rotate_bytes", lambda key, v: _int(key, v, 4096, 1 << 40))
    with errs.check():
        if "sample_rate" in rc:
            v = rc["sample_rate"]
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                raise ConfigError(
                    f"records.sample_rate: {_t(v)} is not allowed; expected a number from 0 (no per-request "
                    "records) to 1 (every request)"
                )
            r.sample_rate = float(v)
    _set(errs, rc, r, "records", "format", lambda key, v: _choice(key, v, ("parquet", "jsonl")))


def _check_ports(cfg: Config, errs: _Errors) -> None:
    """Listeners must not collide with each other (including VIP channels at port - 2)."""
    assert cfg.namesrv.listen is not None
    if cfg.namesrv.listen.is_wildcard and not cfg.proxy.advertise_host:
        errs.messages.append(
            f"proxy.advertise_host: required when namesrv.listen binds a wildcard address "
            f"({cfg.namesrv.listen}); set it to the address clients use to reach this proxy"
        )
    if cfg.proxy.advertise_host:
        with errs.check():
            _check_host("proxy.advertise_host", cfg.proxy.advertise_host)
    used: dict[int, str] = {cfg.namesrv.listen.port: "namesrv.listen"}
    if cfg.admin.listen is not None:
        with errs.check():
            _claim(used, cfg.admin.listen.port, "admin.listen")
    for i, s in enumerate(cfg.brokers.static):
        with errs.check():
            _claim(used, s.listen.port, f"brokers.static[{i}].listen")
        if cfg.brokers.vip_channel:
            with errs.check():
                if s.listen.port <= 2:
                    raise ConfigError(f"brokers.static[{i}].listen: port {s.listen.port} leaves no room for its "
                                      "VIP channel at port - 2")
                _claim(used, s.listen.port - 2, f"brokers.static[{i}].listen (VIP channel, port - 2)")
    rng = cfg.brokers.port_range
    if rng is not None:
        for port, who in used.items():
            if rng[0] <= port <= rng[1]:
                errs.messages.append(
                    f"brokers.port_range: \"{rng[0]}-{rng[1]}\" is not allowed; it contains port {port} "
                    f"already used by {who}"
                )


def _claim(used: dict[int, str], port: int, who: str) -> None:
    if port in used:
        raise ConfigError(f"{who}: port {port} is already used by {used[port]}")
    used[port] = who


def _check_host(key: str, host: str) -> None:
    if not valid_host(host):
        raise ConfigError(f"{key}: {_t(host)} is not allowed; expected an IP address or host name")


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file; errors name the file and the TOML problem."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:  # TOML files are UTF-8, comments included
        line = data.count(b"\n", 0, exc.start) + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(
            f"config file {str(p)!r}: byte 0x{data[exc.start]:02x} at line {line}, column {col} is not valid "
            "UTF-8 (TOML files must be UTF-8, comments included); re-save the file as UTF-8"
        ) from None
    import tomllib  # here: a worker reads its configuration as JSON and never needs it

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(
            f"config file {str(p)!r}: arrays or tables nested too deeply to read; no rmqfast setting needs "
            "more than a few levels"
        ) from None


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge dotted-key overrides (``{"namesrv.listen": ...}``) into a raw document copy."""
    out = json.loads(json.dumps(raw))
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        out.setdefault(section, {})[key] = value
    return out


def load(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    raw = load_file(path) if path else {}
    try:
        return from_dict(apply_overrides(raw, overrides or {}))
    except RecursionError:  # a document tomllib could read but that is still absurdly deep
        raise ConfigError(
            f"config file {str(path)!r}: values nested too deeply; no rmqfast setting needs more than a few levels"
        ) from None


def from_json(text: str) -> Config:
    """Inverse of :meth:`Config.to_json` (used by workers; the data was validated already)."""
    d = json.loads(text)

    def hp(x: Any) -> HostPort | None:
        return HostPort(x["host"], x["port"]) if x else None

    cfg = Config(
        proxy=ProxySection(**d["proxy"]),
        namesrv=NamesrvSection(listen=hp(d["namesrv"]["listen"]), upstreams=[hp(u) for u in d["namesrv"]["upstreams"]]),  # type: ignore[misc]
        brokers=BrokersSection(
            port_range=tuple(d["brokers"]["port_range"]) if d["brokers"]["port_range"] else None,  # type: ignore[arg-type]
            listen_host=d["brokers"]["listen_host"],
            vip_channel=d["brokers"]["vip_channel"],
            static=[StaticBroker(hp(s["listen"]), hp(s["upstream"])) for s in d["brokers"]["static"]],  # type: ignore[arg-type]
        ),
        policy=PolicySection(**d["policy"]),
        admin=AdminSection(listen=hp(d["admin"]["listen"]), token=d["admin"].get("token", ""),
                           allowed_hosts=list(d["admin"].get("allowed_hosts", []))),
        log=LogSection(**d["log"]),
    )
    if "limits" in d:
        cfg.limits = LimitsSection.from_dict(d["limits"])
    if "records" in d:
        cfg.records = RecordsSection(**d["records"])
    if "clouds" in d:
        cl = dict(d["clouds"])
        cl["remotes"] = [RemoteCloud(**x) for x in cl.get("remotes", [])]
        cfg.clouds = CloudsSection(**cl)
    if "replicate" in d:
        rp = dict(d["replicate"])
        rp["topics"] = [TopicRule(**x) for x in rp.get("topics", [])]
        cfg.replicate = ReplicateSection(**rp)
    if "delay" in d:
        cfg.delay = DelaySection(**d["delay"])
    if "acl" in d:
        cfg.acl = AclSection.from_dict(d["acl"])
    if "tls" in d:
        cfg.tls = TlsSection.from_dict(d["tls"])
    if "failover" in d:
        cfg.failover = FailoverSection.from_dict(d["failover"])
    if "gray" in d:
        cfg.gray = GraySection.from_dict(d["gray"])
    if "grpc" in d:
        cfg.grpc = GrpcSection(**d["grpc"])
    return cfg

"""Configuration: a TOML file, overridden by quick-start command-line flags, validated at start.

Every error names the key, the bad value and what is allowed, e.g.::

    proxy.workers: -1 is not allowed; expected an integer from 0 (one per CPU) to 256

The validated :class:`Config` is plain data (dataclasses), serialisable to JSON so the
supervisor can hand exactly the same configuration to every worker process.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from rmqfast.delay.settings import DelaySection
from rmqfast.errors import ConfigError
from rmqfast.gray.config import GraySection, parse_gray
from rmqfast.grpcfront.settings import GrpcSection, parse_grpc
from rmqfast.grpcfront.settings import check_tls as check_grpc_tls
from rmqfast.limits.rules import LimitsSection, parse_limits, parse_rule
from rmqfast.proxy.acl import AclSection, parse_acl
from rmqfast.proxy.health import FailoverSection
from rmqfast.proxy.tls import TlsSection, parse_tls
from rmqfast.server.admin_names import parse_allowed_hosts
from rmqfast.settings.base import ConfigErrors as ConfigErrors  # re-exported: rmqfast.config.ConfigErrors
from rmqfast.settings.base import Errors as _Errors
from rmqfast.settings.base import check_keys as _check_keys
from rmqfast.settings.base import choice as _choice
from rmqfast.settings.base import integer as _int
from rmqfast.settings.base import string as _str
from rmqfast.settings.base import table as _table
from rmqfast.settings.base import toml_value as _t
from rmqfast.settings.base import toml_value as toml_value  # re-exported
from rmqfast.settings.base import valid_host
from rmqfast.settings.cpus import usable_cpus_at_start
from rmqfast.settings.engine import parse_section, revive, section, sections, setting
from rmqfast.settings.hostport import HostPort as HostPort  # re-exported: rmqfast.config.HostPort
from rmqfast.settings.hostport import parse_hostport as parse_hostport  # re-exported
from rmqfast.settings.hostport import parse_hostport_list as parse_hostport_list  # re-exported

DEFAULT_NAMESRV_LISTEN = "127.0.0.1:9876"


@dataclass(frozen=True)
class StaticBroker:
    listen: HostPort
    upstream: HostPort


@section("proxy", "The listeners, frames, buffers and timeouts of every worker.")
@dataclass
class ProxySection:
    workers: int = setting(0, lo=0, hi=256, what=" (one per CPU)", doc="worker processes (0: one per usable CPU)")
    advertise_host: str = setting("", doc="host written into rewritten routes (default: namesrv.listen's host)")
    max_frame_size: int = setting(16 << 20, kind="size", lo=1024, hi=1 << 30, doc="largest Remoting frame accepted")
    max_header_size: int = setting(1 << 20, kind="size", lo=64, hi=0xFFFFFF, doc="largest frame header accepted")
    buffer_size: int = setting(256 << 10, kind="size", lo=4096, hi=64 << 20, doc="socket buffer per direction")
    connect_timeout: float = setting(3.0, kind="duration", lo=0.1, hi=60, doc="connecting to an upstream")
    idle_timeout: float = setting(120.0, kind="duration", lo=20, hi=86400, doc="a connection with no traffic is closed")
    drain_timeout: float = setting(10.0, kind="duration", lo=0, hi=600, doc="in-flight requests finish on shutdown")
    state_dir: str = setting(".rmqfast-state", doc="directory of the proxy's state (spill, delay, gray)")
    frame_timeout: float = setting(30.0, kind="duration", lo=1, hi=3600, zero_off=True,
                                   doc="a frame a peer started sending may wait this long for its next bytes")
    buffer_budget: int = setting(64 << 20, kind="size", lo=1 << 20, hi=1 << 40,
                                 doc="bytes per worker for frames held whole (policy, limited sends, batches)")
    max_connections: int = setting(0, lo=0, hi=1 << 24, what=" (0: automatic)",
                                   doc="client connections per worker (0: from the open-files limit)")
    max_connections_per_client: int = setting(0, lo=0, hi=1 << 24, what=" (0: automatic)",
                                              doc="... per client address, IPv6 by /64 (0: half the worker's cap)")
    first_frame_timeout: float = setting(10.0, kind="duration", lo=1, hi=3600, zero_off=True,
                                         doc="a new Remoting connection must send its first frame within this")

    def check(self) -> list[str]:
        out = []
        if 0 < self.max_connections < self.max_connections_per_client:
            out.append(f"proxy.max_connections_per_client: {self.max_connections_per_client} is not allowed; it "
                       f"must not exceed proxy.max_connections ({self.max_connections})")
        if self.max_header_size > self.max_frame_size:
            out.append(f"proxy.max_header_size: {self.max_header_size} is not allowed; it must not exceed "
                       f"proxy.max_frame_size ({self.max_frame_size})")
        return out


@section("namesrv", "Where clients reach the proxy's name server, and the real RocketMQ name servers.")
@dataclass
class NamesrvSection:
    listen: HostPort | None = setting(parse_hostport("namesrv.listen", DEFAULT_NAMESRV_LISTEN),
                                      parse=lambda k, v: parse_hostport(k, v), expect='"host:port"',
                                      doc="where clients connect")
    upstreams: list[HostPort] = setting(factory=list, parse=lambda k, v: _upstreams(k, v), required=True,
                                        expect='a non-empty list of "host:port"', doc="the real name servers")


def _upstreams(key: str, ups: Any) -> list[HostPort]:
    if not isinstance(ups, list | str) or not ups:
        raise ConfigError(
            f"{key}: {_t(ups)} is not allowed; expected a non-empty list of \"host:port\" "
            "(the real RocketMQ name servers), e.g. [\"10.0.0.1:9876\"]"
        )
    return parse_hostport_list(key, ups)


@section("brokers", "The endpoints clients reach the brokers through.")
@dataclass
class BrokersSection:
    port_range: tuple[int, int] | None = setting(
        (30900, 30999), parse=lambda k, v: parse_port_range(k, v), expect='"FIRST-LAST", or "" for none',
        doc="ports of the automatically allocated broker endpoints")
    listen_host: str = setting("", doc="host those endpoints bind (default: namesrv.listen's host)")
    vip_channel: bool = setting(True, doc="also listen at port - 2 for the clients' VIP channel")
    static: list[StaticBroker] = setting(factory=list, parse=lambda k, v: _statics(k, v),
                                         expect='[[brokers.static]] tables of listen and upstream "host:port"',
                                         doc="fixed endpoints: listen -> upstream")


def _statics(key: str, statics: Any) -> list[StaticBroker]:
    if not isinstance(statics, list):
        raise ConfigError(f"{key}: {_t(statics)} is not allowed; expected an array of tables")
    errs = _Errors()
    out = []
    for i, s in enumerate(statics):
        k = f"{key}[{i}]"
        with errs.check():
            s = _table(k, s)
            _check_keys(k, s, {"listen", "upstream"})
            if "listen" not in s or "upstream" not in s:
                raise ConfigError(f"{k}: both 'listen' and 'upstream' are required")
            out.append(StaticBroker(parse_hostport(f"{k}.listen", s["listen"]),
                                    parse_hostport(f"{k}.upstream", s["upstream"])))
    errs.raise_if_any()
    return out


@section("policy", "Which request codes pass, and the broker addresses rewritten inside messages.")
@dataclass
class PolicySection:
    allow_codes: list[int] = setting(factory=list, parse=lambda k, v: _codes(k, v), expect="a list of request codes",
                                     doc="admin request codes let through besides the data plane")
    deny_codes: list[int] = setting(factory=list, parse=lambda k, v: _codes(k, v), expect="a list of request codes",
                                    doc="request codes refused whatever else says")
    preset: str = setting("", choices=("", "read-only-admin"),
                          doc='"read-only-admin": also let through the read-only admin codes')
    message_addresses: str = setting(
        "all", choices=("records", "all", "off"),
        doc='"all": store hosts and send answers\' msgIds mapped; "records": not send answers; "off": none')


@section("admin", "The admin HTTP endpoint: /metrics, /healthz, /readyz, /limits.")
@dataclass
class AdminSection:
    listen: HostPort | None = setting(None, parse=lambda k, v: parse_hostport(k, v) if v else None,
                                      expect='"host:port"', doc="where it listens (default: off)")
    token: str = setting("", doc='required as "Authorization: Bearer <token>" to change limits (else loopback only)')
    allowed_hosts: list[str] = setting(factory=list, parse=lambda k, v: parse_allowed_hosts(k, v),
                                       expect='a list of "name" or "name:port"',
                                       doc="names besides the listen address a request may give in Host or Origin")


@section("log", "How the proxy logs.")
@dataclass
class LogSection:
    format: str = setting("json", choices=("json", "human"), doc="one JSON object per line, or text for people")
    level: str = setting("info", choices=("debug", "info", "warning", "error"), doc="the least level written")


@section("records", "Traffic records for the Spark jobs (docs/records.md).")
@dataclass
class RecordsSection:
    enabled: bool = setting(False, doc="write traffic records")
    dir: str = setting("records", parse=lambda k, v: _records_dir(k, v), expect="a directory path",
                       doc="where (created if missing)")
    rotate_seconds: float = setting(60.0, kind="duration", lo=1, hi=86400, doc="a new file this often")
    rotate_bytes: int = setting(64 << 20, kind="size", lo=4096, hi=1 << 40, doc="... or when a file reaches this")
    sample_rate: float = setting(0.0, lo=0, hi=1, what=" (no per-request records)", kind="float",
                                 doc="share of requests written as sampled per-request records")
    format: str = setting("parquet", choices=("parquet", "jsonl"), doc="file format")


def _records_dir(key: str, value: Any) -> str:
    if not _str(key, value):
        raise ConfigError(f"{key}: \"\" is not allowed; expected a directory path (created if missing)")
    return str(value)


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


@section("clouds", "The local cloud's name and the remote clusters copies go to (docs/cross-cloud.md).")
@dataclass
class CloudsSection:
    local: str = setting("local", parse=lambda k, v: _name(k, v), expect="a name of 1 to 64 letters, digits, "
                         "'-', '_' or '.'", doc="this cluster's name")
    detect_interval: float = setting(2.0, kind="duration", lo=0.1, hi=3600, doc="between online checks of remotes")
    detect_timeout: float = setting(3.0, kind="duration", lo=0.1, hi=60, doc="an online check's deadline")
    remotes: list[RemoteCloud] = setting(factory=list, key="remote", parse=lambda k, v: _remotes(k, v),
                                         expect="[[clouds.remote]] tables of name, namesrv, access_key, secret_key",
                                         doc="the remote clusters")

    def check(self) -> list[str]:
        return [f"clouds.remote[{i}].name: {_t(r.name)} is the local cloud's name (clouds.local); pick another"
                for i, r in enumerate(self.remotes) if r.name == self.local]


@dataclass
class TopicRule:
    """``[[replicate.topic]]``: when copies of a topic go to remote clouds."""

    name: str
    replicate: str = "online"  # online | always | never
    tags: list[str] = field(default_factory=list)  # empty: every tag
    remotes: list[str] = field(default_factory=list)  # empty: every remote
    groups: list[str] = field(default_factory=list)  # consumer groups to ask the remotes about


_REPLICATE_CHOICES = ("online", "always", "never")


@section("replicate", "When copies go to the remote clouds, and the spill that holds them (docs/cross-cloud.md).")
@dataclass
class ReplicateSection:
    durability: str = setting("fast", choices=("fast", "durable"), doc="answer sends before or after the copy is kept")
    default: str = setting("never", choices=_REPLICATE_CHOICES, doc="rule for topics no [[replicate.topic]] names")
    channel_size: int = setting(10000, lo=0, hi=10_000_000, doc="copies queued in memory per worker")
    disk_cap_bytes: int = setting(1 << 30, kind="size", lo=1 << 20, hi=1 << 50, doc="the spill's disk cap")
    on_disk_full: str = setting("reject", choices=("reject", "drop"), doc="a send past the cap: refused or not copied")
    # RocksDB memory of a worker's spill (also what holds [delay] messages): with 8 MiB each a worker holding
    # 10 M delayed messages peaked at 68 MB RSS while accepting; 57 MB with 4 MiB each (bench/delay_bench.py)
    write_buffer_bytes: int = setting(4 << 20, kind="size", lo=64 << 10, hi=1 << 30, doc="RocksDB memtable (two)")
    block_cache_bytes: int = setting(4 << 20, kind="size", lo=64 << 10, hi=1 << 34, doc="RocksDB block cache")
    deliver_processes: int = setting(1, lo=1, hi=64, doc="processes delivering copies")
    max_in_flight: int = setting(1024, lo=1, hi=1_000_000, doc="copies in flight per delivery process")
    retry_initial: float = setting(0.1, kind="duration", lo=0.001, hi=60, doc="first retry of a failed copy")
    retry_max: float = setting(5.0, kind="duration", lo=0.01, hi=3600, doc="longest wait between retries")
    order_hold_max: float = setting(30.0, kind="duration", lo=0, hi=3600,
                                    doc="a deliver process holds the other workers' copies after a worker's link "
                                    "broke, until its replacement handed over the copies it inherited")
    topics: list[TopicRule] = setting(factory=list, key="topic", parse=lambda k, v: _topic_rules(k, v),
                                      expect="[[replicate.topic]] tables of name, replicate, tags, remotes, groups",
                                      doc="per-topic rules")


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


_DECLARED = [name for name, spec in sections().items() if spec.parse is None]

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


def _table_list(key: str, value: Any, each: Callable[[str, Any, list[Any]], Any]) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected an array of tables [[{key}]]")
    errs = _Errors()
    out: list[Any] = []
    for i, r in enumerate(value):
        with errs.check():
            out.append(each(f"{key}[{i}]", r, out))
    errs.raise_if_any()
    return out


def _remotes(key: str, value: Any) -> list[RemoteCloud]:
    return _table_list(key, value, _parse_remote)


def _topic_rules(key: str, value: Any) -> list[TopicRule]:
    return _table_list(key, value, _parse_topic_rule)


def _parse_remote(key: str, r: Any, before: list[RemoteCloud]) -> RemoteCloud:
    r = _table(key, r)
    _check_keys(key, r, {"name", "namesrv", "access_key", "secret_key"})
    if "name" not in r or "namesrv" not in r:
        raise ConfigError(f"{key}: both 'name' and 'namesrv' (the remote name servers) are required")
    creds = [_str(f"{key}.{k}", r.get(k, "")) for k in ("access_key", "secret_key")]
    if bool(creds[0]) != bool(creds[1]):
        raise ConfigError(f"{key}: 'access_key' and 'secret_key' go together (the proxy's own credentials in that "
                          "cluster, for brokers with ACL on); give both or neither")
    name = _name(f"{key}.name", r["name"])
    if any(x.name == name for x in before):
        raise ConfigError(f"{key}.name: {_t(name)} is used by another [[clouds.remote]]")
    ns = [str(hp) for hp in parse_hostport_list(f"{key}.namesrv", r["namesrv"])]
    if not ns:
        raise ConfigError(f"{key}.namesrv: [] is not allowed; expected at least one \"host:port\"")
    return RemoteCloud(name, ns, *creds)


def _parse_topic_rule(key: str, t: Any, before: list[TopicRule]) -> TopicRule:
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
    if any(x.name == t["name"] for x in before):
        errs.messages.append(f"{key}.name: topic {_t(t['name'])} has another rule already")
    errs.raise_if_any()
    return TopicRule(t["name"], fields["replicate"], fields["tags"], fields["remotes"], fields["groups"])


def _check_rule_remotes(cfg: Config, errs: _Errors) -> None:
    """Every remote a ``[[replicate.topic]]`` names is a ``[[clouds.remote]]``."""
    names = {x.name for x in cfg.clouds.remotes}
    for i, rule in enumerate(cfg.replicate.topics):
        for rn in rule.remotes:
            if rn not in names:
                errs.messages.append(f"replicate.topic[{i}].remotes: {_t(rn)} is not a configured remote; known: "
                                     f"{', '.join(sorted(names)) or 'none'}")


def from_dict(raw: dict[str, Any]) -> Config:
    """Validate a parsed TOML document (plus overrides) into a :class:`Config`.

    Every problem is found in one pass: one :class:`ConfigError` for a single problem, a
    :class:`ConfigErrors` (``.errors``, one message per line) for several.
    """
    errs = _Errors()
    with errs.check():
        _check_keys("", raw, set(sections()))
    cfg = Config()
    for name in _DECLARED:  # the sections declared field by field (rmqfast.settings.engine)
        setattr(cfg, name, parse_section(type(getattr(cfg, name)), name, raw.get(name, {}), errs))
    _parse_limits(cfg, raw, errs)
    if not errs.any_under("clouds", "replicate"):
        _check_rule_remotes(cfg, errs)
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
    hints = typing.get_type_hints(Config)
    return Config(**{f.name: revive(hints[f.name], d[f.name]) for f in fields(Config) if f.name in d})

"""Addresses in the configuration: ``"host:port"`` parsed into a :class:`HostPort`.

A leaf of the settings (it imports no feature): the configuration, the relay and the endpoint
registry all take their addresses from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rmqfast.errors import ConfigError
from rmqfast.settings.base import Errors, valid_host
from rmqfast.settings.base import toml_value as _t


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_wildcard(self) -> bool:
        return self.host in ("0.0.0.0", "::", "")



def parse_hostport(key: str, value: Any) -> HostPort:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a string \"host:port\"")
    text = value.strip()
    if ";" in text:
        raise ConfigError(
            f"{key}: {_t(value)} is not allowed; one \"host:port\" here (RocketMQ's \"a:9876;b:9876\" list "
            "form is accepted where several name servers are, e.g. namesrv.upstreams)"
        )
    if text.startswith("["):  # [v6]:port
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected \"host:port\", e.g. \"127.0.0.1:9876\"")
    p = int(port)
    if not 1 <= p <= 65535:
        raise ConfigError(f"{key}: {_t(value)} is not allowed; the port must be from 1 to 65535")
    if not host:
        raise ConfigError(f"{key}: {_t(value)} is not allowed; the host is missing ({_missing_host_hint(key, p)})")
    if not valid_host(host):
        raise ConfigError(
            f"{key}: {_t(value)} is not allowed; {_t(host)} is neither an IP address nor a host name "
            "(IPv6 addresses are written [addr]:port)"
        )
    return HostPort(host, p)


def _missing_host_hint(key: str, port: int) -> str:
    """What to write instead of a bare ":port", for the kind of field ``key`` is."""
    if key.rpartition(".")[2].startswith("listen"):
        return f"where to listen: \"0.0.0.0:{port}\" for every address, \"127.0.0.1:{port}\" for this machine only"
    server = ("a real RocketMQ name server" if key.startswith("namesrv.upstreams")
              else "the real broker" if key.endswith(".upstream") else "the server rmqfast connects to")
    return f"write the address of {server}, e.g. \"10.0.0.1:{port}\"; 0.0.0.0 is for listen addresses only"


def parse_hostport_list(key: str, value: Any) -> list[HostPort]:
    """A list of "host:port" (or one string); RocketMQ's "a:9876;b:9876" form is split into several."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a list of \"host:port\"")
    errs = Errors()
    out: list[HostPort] = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]" if not isinstance(value, str) else key
        parts = [p.strip() for p in item.split(";")] if isinstance(item, str) else [item]
        for part in parts:
            if part == "" and len(parts) > 1:
                continue  # "a:9876;b:9876;" as RocketMQ tolerates it
            with errs.check():
                out.append(parse_hostport(where, part))
    errs.raise_if_any()
    return out

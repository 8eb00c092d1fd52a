"""Who may drive the admin endpoint: its own names (``Host``) and its own origin (``Origin``).

A browser on the admin host, or on a network that reaches it, can be made to send requests to
the endpoint by any web page: a cross-site form posts ``text/plain`` with a foreign ``Origin``,
and DNS rebinding makes ``http://evil.example:9400/`` resolve to the endpoint, so the request
carries ``Host: evil.example:9400``.  The head reader (:mod:`rmqfast.server.admin_heads`) asks
:meth:`OwnNames.refusal` before anything else of a request is read:

* ``Host`` must be one of the endpoint's own names, with the endpoint's port: its listen
  address, the address the connection arrived at (the listen address of a wildcard listener),
  ``localhost``, ``127.0.0.1``, ``[::1]``, the pod IP (environment variable ``POD_IP``), or a
  name of ``admin.allowed_hosts`` (``"name"``: any port, for reverse proxies and forwarded
  ports; ``"name:port"``: that port only).  Else 421.
* A state-changing request (POST, PUT, DELETE, PATCH) must carry
  ``Content-Type: application/json`` (a cross-site form cannot send it without a CORS
  preflight, which the endpoint never grants), and an ``Origin``, if it has one, must name the
  endpoint itself.  Else 403.

Parsed here without importing :mod:`rmqfast.config` (which reads ``admin.allowed_hosts`` with
:func:`parse_allowed_hosts`).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.message import Message
from typing import Any

from rmqfast.errors import ConfigError

POD_IP_ENV = "POD_IP"
CHANGE_METHODS = frozenset({"POST", "PUT", "DELETE", "PATCH"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def normal_host(host: str) -> str | None:
    """``host`` as compared: an IP address in its canonical form (IPv4-mapped IPv6 as IPv4), a
    name in lower case without a trailing dot; None when it is neither."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        name = host.lower()
        name = name[:-1] if name.endswith(".") else name
        if 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split(".")):
            return name
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` value (``name[:port]``, ``v4[:port]``, ``[v6][:port]``) as (normal host, port or
    None); None when it is not one (user info, a path, a bare IPv6 address, a zone id, port 0...)."""
    v = value.strip()
    if not v or len(v) > 300:
        return None
    if v.startswith("["):
        host, sep, rest = v[1:].partition("]")
        if not sep or "%" in host or (rest and not rest.startswith(":")):
            return None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = v.partition(":")
        if ":" in port_text:
            return None  # a bare IPv6 address: not a Host value
    port: int | None = None
    if port_text:
        if not port_text.isascii() or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            return None
        port = int(port_text)
    name = normal_host(host)
    return None if name is None else (name, port)


def parse_allowed_hosts(key: str, value: Any) -> list[str]:
    """``admin.allowed_hosts``: a list of ``"name"`` or ``"name:port"`` (``"[v6]:port"``)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: {value!r} is not allowed; expected a list of host names, e.g. "
                          "[\"proxy-1.example.internal\", \"localhost:19400\"]")
    for i, v in enumerate(value):
        if split_host(v) is None:
            raise ConfigError(f"{key}[{i}]: {v!r} is not allowed; expected \"name\" (any port) or \"name:port\" "
                              "(an IPv6 address as \"[addr]\" or \"[addr]:port\"), without scheme or path")
    return list(value)


def pod_ips(env: dict[str, str] | None = None) -> list[str]:
    """The pod's own addresses from ``POD_IP`` (comma-separated; Kubernetes' ``status.podIP``)."""
    raw = (os.environ if env is None else env).get(POD_IP_ENV, "").strip()
    out = []
    for part in filter(None, (p.strip() for p in raw.split(","))):
        try:
            out.append(str(ipaddress.ip_address(part)))
        except ValueError:
            raise ConfigError(f"environment {POD_IP_ENV}={raw!r}: {part!r} is not an IP address; set it from "
                              "the pod's status.podIP (fieldRef) or unset it") from None
    return out


@dataclass(frozen=True)
class OwnNames:
    """The names a request may give in ``Host`` and ``Origin`` (see the module docstring)."""

    port: int  # the endpoint's bound port
    own: frozenset[str]  # names that must come with ``port``
    any_port: frozenset[str]  # configured names without a port
    pinned: frozenset[tuple[str, int]]  # configured names with their port

    @classmethod
    def build(cls, listen_host: str, port: int, allowed_hosts: Iterable[str] = (),
              pod: Sequence[str] = ()) -> OwnNames:
        own = {n for n in (normal_host(h) for h in (*LOOPBACK_NAMES, *pod)) if n}
        listen = normal_host(listen_host)
        if listen and listen not in ("0.0.0.0", "::"):
            own.add(listen)
        any_port, pinned = set(), set()
        for entry in allowed_hosts:
            hp = split_host(entry)
            if hp is None:
                raise ConfigError(f"admin.allowed_hosts: {entry!r} is not a host name or \"name:port\"")
            if hp[1] is None:
                any_port.add(hp[0])
            else:
                pinned.add((hp[0], hp[1]))
        return cls(port, frozenset(own), frozenset(any_port), frozenset(pinned))

    def accepts(self, host: str, port: int | None, local_ip: str) -> bool:
        """Whether ``host:port`` (normal host; port None: none given, 80) names this endpoint on a
        connection that arrived at ``local_ip``."""
        port = 80 if port is None else port  # no port in Host: HTTP's
        if host in self.any_port or (host, port) in self.pinned:
            return True
        if port != self.port:
            return False
        return host in self.own or (bool(local_ip) and host == normal_host(local_ip.split("%", 1)[0]))

    def examples(self) -> str:
        return f"127.0.0.1:{self.port} or localhost:{self.port}"

    def refusal(self, method: str, headers: Message, local_ip: str) -> tuple[int, str] | None:
        """(status, why) when the request must be refused before it is read further, else None."""
        hosts = headers.get_all("Host") or []
        if len(hosts) != 1:
            what = "no Host header" if not hosts else f"{len(hosts)} Host headers"
            return 421, (f"the request has {what}; send one Host header naming this endpoint "
                         f"({self.examples()}, or a name of admin.allowed_hosts)")
        hp = split_host(hosts[0])
        if hp is None or not self.accepts(hp[0], hp[1], local_ip):
            return 421, (f"Host {hosts[0][:200]!r} is not a name of this admin endpoint; ask it as "
                         f"{self.examples()}, or add the name to admin.allowed_hosts")
        if method.upper() not in CHANGE_METHODS:
            return None
        origins = headers.get_all("Origin") or []
        if len(origins) > 1 or (origins and not self._own_origin(origins[0], local_ip)):
            return 403, (f"{method} with Origin {', '.join(o[:200] for o in origins)!r} refused: changes are "
                         "accepted only from this endpoint's own origin (a web page elsewhere cannot drive "
                         "it); send the request from a tool, without an Origin header")
        ctypes = headers.get_all("Content-Type") or []
        media = ctypes[0].split(";", 1)[0].strip().lower() if len(ctypes) == 1 else ""
        if media != "application/json":
            got = ", ".join(c[:100] for c in ctypes) if ctypes else "none"
            return 403, (f"{method} needs the header 'Content-Type: application/json' (got {got}); changes "
                         "are sent as JSON, which a cross-site form cannot send")
        return None

    def _own_origin(self, origin: str, local_ip: str) -> bool:
        scheme, sep, rest = origin.strip().partition("://")
        if not sep or scheme.lower() not in _DEFAULT_PORTS or "/" in rest or "@" in rest:
            return False  # "null", other schemes, paths or user info: not an origin of this endpoint
        hp = split_host(rest)
        if hp is None:
            return False
        return self.accepts(hp[0], hp[1] if hp[1] is not None else _DEFAULT_PORTS[scheme.lower()], local_ip)

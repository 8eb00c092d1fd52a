"""TLS on the client-facing listeners and on the upstream connections.

Configuration (``[tls.listen]``, ``[tls.upstream]``), validation that loads the certificate
files (so ``rmqfast check-config`` and a reload refuse a missing file or bad PEM), the SSL
contexts of a worker (rebuilt from the files on every reload; a reload that cannot build
them keeps the running ones) and :class:`TlsSocket` (:mod:`rmqfast.proxy.tls_socket`), a TLS
connection that the relay's Python pump drives like a plain non-blocking socket.

Listener modes follow RocketMQ's ``tls.server.mode``:

- ``disabled``: plain TCP only;
- ``permissive``: the first byte a client sends decides, read with ``MSG_PEEK``: 0x16 (a TLS
  handshake record) starts TLS, anything else is relayed as plain Remoting;
- ``enforcing``: TLS only; a client that does not start a TLS handshake is closed.

The compiled pump receives and sends on raw file descriptors, so a session with TLS on either
side runs the Python pump over :class:`TlsSocket` (OpenSSL encrypts and decrypts, the frame
scanner, compiled or pure, scans the plaintext exactly as without TLS).

Only the standard library is imported at module level: the configuration is validated in
processes that never load gevent (``rmqfast check-config``, the supervisor).  ``ssl`` itself is
imported when the first context is built (:func:`_load_ssl`): OpenSSL's libraries add ~4 MiB to
every process that loads them, and a worker with no TLS configured never needs them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from rmqfast.errors import ConfigError
from rmqfast.log import ctx
from rmqfast.proxy.tls_socket import TlsSocket as TlsSocket  # re-exported: the relay and tests name it here
from rmqfast.proxy.tls_socket import handshake as _handshake
from rmqfast.proxy.tls_socket import is_tls as is_tls
from rmqfast.proxy.tls_socket import peek_first_byte as _peek_first_byte
from rmqfast.settings.base import Errors, check_keys, table, valid_host
from rmqfast.settings.base import boolean as _bool
from rmqfast.settings.base import choice as _choice
from rmqfast.settings.base import seconds as _float
from rmqfast.settings.base import string as _str
from rmqfast.settings.base import toml_value as _t
from rmqfast.settings.engine import section

if TYPE_CHECKING:
    import ssl
else:
    ssl = None  # the module once _load_ssl() ran: every context is built after it, every TLS socket from one

log = logging.getLogger("rmqfast.tls")

MODES = ("disabled", "permissive", "enforcing")
ROLES = ("namesrv", "broker")
VERIFY_CLIENT = ("none", "optional", "require")
TLS_RECORD_HANDSHAKE = 0x16  # first byte of a TLS ClientHello record (what RocketMQ's TlsModeHandler looks for)


# Configuration -------------------------------------------------------------------------------


@dataclass
class TlsListenSection:
    """``[tls.listen]``: TLS on the listeners clients connect to (name server and broker endpoints)."""

    mode: str = "disabled"  # disabled | permissive | enforcing
    roles: list[str] = field(default_factory=lambda: list(ROLES))  # listeners that use ``mode``
    cert: str = ""  # PEM certificate chain presented to clients
    key: str = ""  # PEM private key of ``cert``
    key_password: str = ""
    ca: str = ""  # PEM CA bundle that client certificates must chain to (verify_client)
    verify_client: str = "none"  # none | optional | require
    handshake_timeout: float = 10.0

    def mode_for(self, role: str) -> str:
        return self.mode if role in self.roles else "disabled"


@dataclass
class TlsUpstreamSection:
    """``[tls.upstream]``: TLS on the connections to the real name servers and brokers."""

    enable: bool = False
    roles: list[str] = field(default_factory=lambda: list(ROLES))
    verify: bool = True  # check the upstream's certificate (against ``ca``, else the system store)
    ca: str = ""
    server_name: str = ""  # name checked in the certificate and sent as SNI ("" : the upstream's host)
    cert: str = ""  # client certificate, for upstreams that ask for one
    key: str = ""
    key_password: str = ""

    def enabled_for(self, role: str) -> bool:
        return self.enable and role in self.roles


@section("tls", "TLS of the listeners and of the upstream connections (docs/tls.md).", parse=lambda raw: parse_tls(raw))
@dataclass
class TlsSection:
    listen: TlsListenSection = field(default_factory=TlsListenSection)
    upstream: TlsUpstreamSection = field(default_factory=TlsUpstreamSection)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TlsSection:
        return cls(TlsListenSection(**d.get("listen", {})), TlsUpstreamSection(**d.get("upstream", {})))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def active(self) -> bool:
        return self.listen.mode != "disabled" or self.upstream.enable


_LISTEN_KEYS = {"mode", "roles", "cert", "key", "key_password", "ca", "verify_client", "handshake_timeout"}
_UPSTREAM_KEYS = {"enable", "roles", "verify", "ca", "server_name", "cert", "key", "key_password"}


def _path(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a file path (a string)")
    if not value:
        return ""
    # absolute: workers run in another working directory
    return os.path.abspath(os.path.expanduser(value))


def _read(key: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {_t(path)} ({exc.strerror or exc})") from None


def _check_pem(key: str, path: str, marker: bytes, what: str) -> None:
    data = _read(key, path)
    if b"-----BEGIN " not in data or marker not in data:
        raise ConfigError(f"{key}: {_t(path)} is not a PEM file with {what} (no \"-----BEGIN ...{marker.decode()}\" "
                          "block)")


def _roles(key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or any(v not in ROLES for v in value):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a non-empty list of {', '.join(ROLES)}")
    return list(dict.fromkeys(value))


def parse_tls(raw: Any) -> TlsSection:
    """Validate ``[tls]`` (a table with ``listen`` and ``upstream`` tables); loads the files.

    Raises :class:`ConfigError` (one problem) or ``rmqfast.config.ConfigErrors`` (several).
    """
    errs = Errors()
    out = TlsSection()
    tbl = table("tls", raw)
    with errs.check():
        check_keys("tls", tbl, {"listen", "upstream"})
    li: dict[str, Any] = {}
    up: dict[str, Any] = {}
    with errs.check():
        li = table("tls.listen", tbl.get("listen", {}))
        check_keys("tls.listen", li, _LISTEN_KEYS)
    with errs.check():
        up = table("tls.upstream", tbl.get("upstream", {}))
        check_keys("tls.upstream", up, _UPSTREAM_KEYS)
    _parse_listen(out.listen, li, errs)
    _parse_upstream(out.upstream, up, errs)
    errs.raise_if_any()
    # Files: only for the sides in use, and only once the keys themselves parsed.
    _check_listen_files(out.listen, errs)
    _check_upstream_files(out.upstream, errs)
    errs.raise_if_any()
    return out


def _parse_listen(L: TlsListenSection, li: dict[str, Any], errs: Any) -> None:
    with errs.check():
        if "mode" in li:
            L.mode = _choice("tls.listen.mode", li["mode"], MODES)
    with errs.check():
        if "roles" in li:
            L.roles = _roles("tls.listen.roles", li["roles"])
    with errs.check():
        if "verify_client" in li:
            L.verify_client = _choice("tls.listen.verify_client", li["verify_client"], VERIFY_CLIENT)
    with errs.check():
        if "handshake_timeout" in li:
            L.handshake_timeout = _float("tls.listen.handshake_timeout", li["handshake_timeout"], 0.1, 300)
    for k in ("cert", "key", "ca"):
        with errs.check():
            if k in li:
                setattr(L, k, _path(f"tls.listen.{k}", li[k]))
    with errs.check():
        if "key_password" in li:
            L.key_password = _str("tls.listen.key_password", li["key_password"])


def _parse_upstream(U: TlsUpstreamSection, up: dict[str, Any], errs: Any) -> None:
    for k in ("enable", "verify"):
        with errs.check():
            if k in up:
                setattr(U, k, _bool(f"tls.upstream.{k}", up[k]))
    with errs.check():
        if "roles" in up:
            U.roles = _roles("tls.upstream.roles", up["roles"])
    for k in ("ca", "cert", "key"):
        with errs.check():
            if k in up:
                setattr(U, k, _path(f"tls.upstream.{k}", up[k]))
    for k in ("server_name", "key_password"):
        with errs.check():
            if k in up:
                setattr(U, k, _str(f"tls.upstream.{k}", up[k]))
    if U.server_name and not valid_host(U.server_name):
        errs.messages.append(f"tls.upstream.server_name: {_t(U.server_name)} is not allowed; expected a host name "
                             "or IP address")


def _check_listen_files(L: TlsListenSection, errs: Any) -> None:
    if L.mode == "disabled":
        return
    before = len(errs.messages)
    if not L.cert or not L.key:
        errs.messages.append(f"tls.listen: mode {_t(L.mode)} needs both 'cert' and 'key' (PEM files)")
    if L.verify_client != "none" and not L.ca:
        errs.messages.append(f"tls.listen.ca: required when verify_client is {_t(L.verify_client)} (the CA "
                             "bundle client certificates must chain to)")
    if len(errs.messages) == before:
        with errs.check():
            server_context(L)


def _check_upstream_files(U: TlsUpstreamSection, errs: Any) -> None:
    if not U.enable:
        return
    if bool(U.cert) != bool(U.key):
        errs.messages.append("tls.upstream: 'cert' and 'key' (the client certificate) go together; set both or "
                             "neither")
        return
    with errs.check():
        client_context(U)


def describe_tls(sec: TlsSection) -> str:
    """One line for ``rmqfast check-config``."""
    L, U = sec.listen, sec.upstream
    if L.mode == "disabled":
        listen = "listeners plain"
    else:
        roles = " and ".join(L.roles)
        listen = f"{roles} listeners {L.mode} ({L.cert}; client certificates: {L.verify_client})"
    if not U.enable:
        up = "upstreams plain"
    else:
        check = f"verified against {U.ca or 'the system CAs'}" if U.verify else "not verified"
        up = f"{' and '.join(U.roles)} upstreams over TLS (certificates {check})"
    return f"{listen}; {up}"


# SSL contexts --------------------------------------------------------------------------------


def _load_ssl() -> None:
    """Import ``ssl`` into this module (once; before any context is built)."""
    global ssl
    if ssl is None:
        import ssl as module

        ssl = module


def _load_chain(ctx: ssl.SSLContext, prefix: str, cert: str, key: str, password: str) -> None:
    _check_pem(f"{prefix}.cert", cert, b"CERTIFICATE-----", "a certificate")
    _check_pem(f"{prefix}.key", key, b"PRIVATE KEY-----", "a private key")
    try:
        # "" rather than None: without a password OpenSSL asks for one on the controlling terminal
        # and blocks there (a SIGHUP reload of an encrypted key with no key_password hung the process)
        ctx.load_cert_chain(cert, key, password=password or "")
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "MISMATCH" in str(reason).upper():
            raise ConfigError(f"{prefix}.key: {_t(key)} is not the private key of {prefix}.cert {_t(cert)}") from None
        raise ConfigError(f"{prefix}.cert/{prefix}.key: cannot load {_t(cert)} with {_t(key)} ({reason}; a "
                          "password-protected key needs key_password)") from None
    except OSError as exc:
        raise ConfigError(f"{prefix}.cert: cannot load {_t(cert)} ({exc.strerror or exc})") from None


def _load_ca(ctx: ssl.SSLContext, key: str, ca: str) -> None:
    _check_pem(key, ca, b"CERTIFICATE-----", "CA certificates")
    try:
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{key}: cannot load CA certificates from {_t(ca)} ({getattr(exc, 'reason', None) or exc})"
                          ) from None


def _harden(ctx: ssl.SSLContext) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= getattr(ssl, "OP_NO_RENEGOTIATION", 0) | ssl.OP_NO_COMPRESSION


def server_context(sec: TlsListenSection) -> ssl.SSLContext:
    """The listeners' context, built from the files now (ConfigError naming the key on failure)."""
    _load_ssl()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(ctx)
    _load_chain(ctx, "tls.listen", sec.cert, sec.key, sec.key_password)
    if sec.ca:
        _load_ca(ctx, "tls.listen.ca", sec.ca)
    ctx.verify_mode = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "require": ssl.CERT_REQUIRED}[
        sec.verify_client]
    return ctx


def client_context(sec: TlsUpstreamSection) -> ssl.SSLContext:
    """The upstream connections' context (ConfigError naming the key on failure)."""
    _load_ssl()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _harden(ctx)
    if sec.verify:
        ctx.check_hostname = True
        ctx.verify_mode = ssl.CERT_REQUIRED
        if sec.ca:
            _load_ca(ctx, "tls.upstream.ca", sec.ca)
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    else:  # like RocketMQ's tls.client.authServer=false: encrypted, the server not checked
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if sec.cert:
        _load_chain(ctx, "tls.upstream", sec.cert, sec.key, sec.key_password)
    return ctx


_probe_cache: dict[str, ssl.SSLContext] = {}


def probe_tls(sec: TlsSection) -> tuple[ssl.SSLContext, str] | None:
    """What the supervisor's readiness probe of the name servers needs: ``(context, server
    name)`` when ``[tls.upstream]`` covers them, else None.  The context is built once per
    configuration; a file that cannot be read now makes the probe fail (not ready), never raise."""
    up = sec.upstream
    if not up.enabled_for("namesrv"):
        return None
    _load_ssl()
    key = repr(up)
    context = _probe_cache.get(key)
    if context is None:
        try:
            context = client_context(up)
        except ConfigError as exc:
            log.error("readiness probe: cannot build the upstream TLS context", extra=ctx(error=str(exc)))
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies against nothing: the probe fails
        _probe_cache.clear()
        _probe_cache[key] = context
    return context, up.server_name


class TlsContexts:
    """A worker's TLS state: which listeners and upstreams use TLS, and their SSL contexts."""

    def __init__(self, sec: TlsSection) -> None:
        self.sec = sec
        self.server: ssl.SSLContext | None = None
        self.client: ssl.SSLContext | None = None
        self.handshakes = 0  # completed, both sides
        self.failures = 0  # handshakes that failed or timed out, both sides
        #: called with (role, side "client"/"upstream", ok) after every handshake (the worker's metrics)
        self.on_handshake: Callable[[str, str, bool], None] | None = None
        self._build(sec, keep_on_error=False)

    def _build(self, sec: TlsSection, keep_on_error: bool) -> bool:
        server = client = None
        try:
            if sec.listen.mode != "disabled":
                server = server_context(sec.listen)
            if sec.upstream.enable:
                client = client_context(sec.upstream)
        except ConfigError as exc:
            if not keep_on_error:
                raise
            log.error("TLS certificates not reloaded; new connections keep using the running ones",
                      extra=ctx(error=str(exc)))
            return False
        self.sec, self.server, self.client = sec, server, client
        return True

    def reload(self, sec: TlsSection) -> bool:
        """Rebuild the contexts from the files (new connections use them); False: the old ones stay."""
        ok = self._build(sec, keep_on_error=True)
        if ok and sec.active:
            log.info("TLS certificates loaded", extra=ctx(listen_mode=sec.listen.mode,
                                                        upstream=sec.upstream.enable))
        return ok

    def wrapper(self, role: str, timeout: float) -> Any:
        """``wrap(sock, host)`` for the proxy's own connections to upstreams of ``role`` (broker
        health probes, moved sends, route lookups: ``rmqfast.clouds.remoting.Connection``):
        TLS when ``[tls.upstream]`` covers the role at connect time, else the socket unchanged."""

        def wrap(sock: Any, host: str) -> Any:
            if not self.upstream_enabled(role):
                return sock
            return self.connect(role, sock, host, timeout)

        return wrap

    def listen_mode(self, role: str) -> str:
        return self.sec.listen.mode_for(role) if self.server is not None else "disabled"

    def upstream_enabled(self, role: str) -> bool:
        return self.client is not None and self.sec.upstream.enabled_for(role)

    # Accept and connect (run in gevent greenlets) -----------------------------------------------

    def accept(self, role: str, sock: Any, client: str) -> Any:
        """The connection to relay for an accepted client socket: ``sock`` itself (plain), a
        :class:`TlsSocket` after a completed handshake, or None (closed: handshake failed,
        timed out, or the client left before sending anything)."""
        mode = self.listen_mode(role)
        if mode == "disabled":
            return sock
        server_ctx = self.server
        assert server_ctx is not None
        timeout = self.sec.listen.handshake_timeout
        try:
            if mode == "permissive":
                first = _peek_first_byte(sock, timeout)
                if first is None:
                    sock.close()
                    return None
                if first != TLS_RECORD_HANDSHAKE:
                    return sock
            conn = _handshake(server_ctx, sock, True, None, timeout)
            self._count(role, "client", True)
            return conn
        except OSError as exc:
            self._count(role, "client", False)
            log.info("TLS handshake with a client failed; connection closed",
                     extra=ctx(role=role, client=client, error=str(exc)))
            sock.close()
            return None

    def connect(self, role: str, sock: Any, host: str, timeout: float) -> Any:
        """TLS over a connected upstream socket; OSError (socket closed) when the handshake fails."""
        client_ctx = self.client
        assert client_ctx is not None
        name = self.sec.upstream.server_name or host
        try:
            conn = _handshake(client_ctx, sock, False, name, timeout)
        except OSError:
            self._count(role, "upstream", False)
            sock.close()
            raise
        self._count(role, "upstream", True)
        return conn

    def _count(self, role: str, side: str, ok: bool) -> None:
        if ok:
            self.handshakes += 1
        else:
            self.failures += 1
        if self.on_handshake is not None:
            self.on_handshake(role, side, ok)

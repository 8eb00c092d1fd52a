"""TLS: configuration checks, and the relay with TLS listeners and TLS upstreams against an
in-process fake broker (the real broker and clients are in tests/integration/test_it_12_tls.py).

Sessions with TLS run the Python pump with either scanner; frames are scanned (policy,
denial) exactly as without TLS.
"""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import gevent
import pytest
from gevent import socket
from gevent.pool import Pool
from gevent.server import StreamServer

from rmqfast import config as config_mod
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.config import HostPort
from rmqfast.errors import ConfigError
from rmqfast.filters.api import FilterChain
from rmqfast.filters.deny import DenyAdminCodes
from rmqfast.proxy import relay
from rmqfast.proxy.relay import RelaySettings, Session
from rmqfast.proxy.tls import TlsContexts, TlsSection, TlsSocket, is_tls, parse_tls
from rmqfast.testing.tlscerts import CertSet, serial_of
from rmqfast.testing.wire import read_frame
from tests.test_relay import FakeBroker, send_frame

pytest.importorskip("cryptography")



# Configuration --------------------------------------------------------------------------------


def _cfg(tls: dict) -> config_mod.Config:
    return config_mod.from_dict({"namesrv": {"upstreams": ["127.0.0.1:9876"]}, "tls": tls})


def test_defaults_are_off() -> None:
    cfg = config_mod.from_dict({"namesrv": {"upstreams": ["127.0.0.1:9876"]}})
    assert cfg.tls.listen.mode == "disabled" and not cfg.tls.upstream.enable and not cfg.tls.active


def test_valid_config_round_trips_to_workers(certs: CertSet) -> None:
    cfg = _cfg({"listen": {"mode": "permissive", "cert": str(certs.server_cert), "key": str(certs.server_key),
                           "ca": str(certs.ca), "verify_client": "optional", "roles": ["broker"]},
                "upstream": {"enable": True, "ca": str(certs.ca), "server_name": "localhost",
                             "cert": str(certs.client_cert), "key": str(certs.client_key)}})
    back = config_mod.from_json(cfg.to_json())
    assert back.tls == cfg.tls
    assert back.tls.listen.mode_for("broker") == "permissive"
    assert back.tls.listen.mode_for("namesrv") == "disabled"
    assert back.tls.upstream.enabled_for("namesrv")


def test_relative_paths_become_absolute(certs: CertSet, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(certs.ca.parent)
    sec = parse_tls({"listen": {"mode": "enforcing", "cert": certs.server_cert.name, "key": certs.server_key.name}})
    assert sec.listen.cert == str(certs.server_cert)  # workers run in another directory


@pytest.mark.parametrize(
    "tls, expected",
    [
        ({"listen": {"mode": "on"}}, 'tls.listen.mode: "on" is not allowed; expected one of disabled, permissive, '
                                     "enforcing"),
        ({"listen": {"mode": "enforcing"}}, "tls.listen: mode \"enforcing\" needs both 'cert' and 'key'"),
        ({"listen": {"mode": "enforcing", "cert": "/nonexistent/s.pem", "key": "/nonexistent/s.key"}},
         'tls.listen.cert: cannot read "/nonexistent/s.pem" (No such file or directory)'),
        ({"listen": {"roles": ["proxy"]}}, 'tls.listen.roles: ["proxy"] is not allowed'),
        ({"listen": {"verify_client": "yes"}}, "tls.listen.verify_client"),
        ({"listen": {"certificate": "x"}}, "tls.listen.certificate: unknown key"),
        ({"upstream": {"enable": "yes"}}, 'tls.upstream.enable: "yes" is not allowed; expected true or false'),
        ({"upstream": {"enable": True, "cert": "/x.pem"}}, "tls.upstream: 'cert' and 'key'"),
        ({"upstream": {"enable": True, "ca": "/nonexistent/ca.pem"}}, 'tls.upstream.ca: cannot read'),
        ({"upstream": {"enable": True, "server_name": "bad name!"}}, "tls.upstream.server_name"),
        ({"tcp": {}}, "tls.tcp: unknown key"),
    ],
)
def test_config_errors(tls: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as ei:
        _cfg(tls)
    assert expected in str(ei.value)


def test_bad_pem_and_mismatched_key(certs: CertSet, other_certs: CertSet, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"tls.listen.cert: .*junk.pem\" is not a PEM file with a certificate"):
        _cfg({"listen": {"mode": "enforcing", "cert": str(junk), "key": str(certs.server_key)}})
    with pytest.raises(ConfigError, match=r"tls.listen.key: .* is not a PEM file with a private key"):
        _cfg({"listen": {"mode": "enforcing", "cert": str(certs.server_cert), "key": str(certs.server_cert)}})
    with pytest.raises(ConfigError, match=r"tls.listen.key: .* is not the private key of tls.listen.cert"):
        _cfg({"listen": {"mode": "enforcing", "cert": str(certs.server_cert), "key": str(other_certs.server_key)}})
    corrupt = tmp_path / "corrupt.pem"
    corrupt.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match=r"tls.upstream.ca: cannot load CA certificates"):
        _cfg({"upstream": {"enable": True, "ca": str(corrupt)}})
    with pytest.raises(ConfigError, match="tls.listen.ca: required when verify_client is \"require\""):
        _cfg({"listen": {"mode": "enforcing", "cert": str(certs.server_cert), "key": str(certs.server_key),
                         "verify_client": "require"}})

def test_encrypted_key_without_password_is_refused_not_prompted_for(certs: CertSet, tmp_path: Path) -> None:
    """Without key_password OpenSSL asked for the pass phrase on the controlling terminal and waited
    (a supervisor or worker started from a shell hung on a reload); it must be a ConfigError."""
    import os
    import subprocess
    import sys
    import termios

    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(certs.server_key.read_bytes(), None)
    enc = tmp_path / "enc-key.pem"
    enc.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(b"pw")))
    code = ("import sys\nfrom rmqfast.errors import ConfigError\nfrom rmqfast.proxy.tls import TlsListenSection, "
            "server_context\ntry:\n    server_context(TlsListenSection(mode='enforcing', cert=sys.argv[1], "
            "key=sys.argv[2]))\nexcept ConfigError as e:\n    print('REFUSED', e)\n")
    master, slave = os.openpty()

    def own_terminal() -> None:  # the child's controlling terminal is the pty: OpenSSL could prompt on it
        os.setsid()
        import fcntl

        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    try:
        proc = subprocess.Popen([sys.executable, "-c", code, str(certs.server_cert), str(enc)], stdin=slave,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=own_terminal,
                                cwd=str(Path(__file__).resolve().parent.parent))
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f"server_context waited for a pass phrase on the terminal: {out!r}")
    finally:
        os.close(master)
        os.close(slave)
    assert b"REFUSED tls.listen" in out and b"key_password" in out, out



def test_check_config_cli_reports_tls_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rmqfast.cli import main

    f = tmp_path / "c.toml"
    f.write_text('[namesrv]\nupstreams = ["127.0.0.1:9876"]\n[tls.listen]\nmode = "enforcing"\n'
                 'cert = "missing.pem"\nkey = "missing.key"\n')
    assert main(["check-config", str(f)]) == 2
    assert "tls.listen.cert: cannot read" in capsys.readouterr().err


# The relay ------------------------------------------------------------------------------------


class Events:
    def __init__(self, tls: TlsContexts) -> None:
        self.errors = 0
        self.tls = tls

    def upstream_error(self, role: str) -> None:
        self.errors += 1

    def upstream_ok(self, session: Session, hp: HostPort) -> None:
        pass


class TlsFakeBroker(FakeBroker):
    """The fake broker behind a TLS listener (its handshake done by gevent's ssl)."""

    def __init__(self, certs: CertSet, require_client_cert: bool = False) -> None:
        from gevent import ssl as gssl

        ctx = gssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # gevent's: the handshake must not block the loop
        ctx.load_cert_chain(certs.server_cert, certs.server_key)
        if require_client_cert:
            ctx.load_verify_locations(certs.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        self.ctx = ctx
        self.peer_certs: list[dict] = []
        self.handshake_failures = 0
        super().__init__()

    def handle(self, sock, addr):  # type: ignore[no-untyped-def]
        try:
            sock = self.ctx.wrap_socket(sock, server_side=True)
        except (ssl.SSLError, OSError):  # expected where a test makes the handshake fail
            self.handshake_failures += 1
            return
        self.peer_certs.append(sock.getpeercert())
        super().handle(sock, addr)


class Proxy:
    def __init__(self, tls_cfg: dict, upstream: HostPort, scanner: tuple) -> None:
        self.tls = TlsContexts(parse_tls(tls_cfg))
        self.events = Events(self.tls)
        self.stats = scanner[1]()
        chain = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
        settings = RelaySettings(4096, 16 << 20, 1 << 16, 2.0, 30.0)
        self.sessions: set[Session] = set()

        def handle(sock, addr):  # type: ignore[no-untyped-def]  # what Worker._handler does
            client = f"{addr[0]}:{addr[1]}"
            sock = self.tls.accept("broker", sock, client)
            if sock is None:
                return
            s = Session("broker", sock, client, [upstream], chain, self.stats, settings, self.events)
            self.sessions.add(s)
            try:
                s.run()
            finally:
                self.sessions.discard(s)

        # a pool: stop() waits for (then kills) the handlers, so no session outlives its test
        self.server = StreamServer(("127.0.0.1", 0), handle, spawn=Pool(100))
        self.server.start()

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.stop(timeout=2)


@pytest.fixture
def scanner(twin, monkeypatch):  # type: ignore[no-untyped-def]
    """Each twin's scanner in the relay (the ``twin`` fixture of tests/conftest.py); TLS keeps to the Python pump."""
    Scanner, Stats = twin.FrameScanner, twin.ScanStats
    monkeypatch.setattr(relay, "FrameScanner", Scanner)

    c_pump = Session._pump_c

    def plain_only(self, src, dst, *args):  # type: ignore[no-untyped-def]
        assert not (is_tls(src) or is_tls(dst)), "the compiled pump reads raw file descriptors: no TLS there"
        return c_pump(self, src, dst, *args)

    monkeypatch.setattr(Session, "_pump_c", plain_only)
    return Scanner, Stats


def _listen(certs: CertSet, mode: str = "enforcing", **extra: object) -> dict:
    return {"mode": mode, "cert": str(certs.server_cert), "key": str(certs.server_key), **extra}


def tls_client(port: int, certs: CertSet, client_cert: bool = False) -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(certs.ca)
    if client_cert:
        ctx.load_cert_chain(certs.client_cert, certs.client_key)
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    from gevent import ssl as gssl

    gctx = gssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    gctx.load_verify_locations(certs.ca)
    if client_cert:
        gctx.load_cert_chain(certs.client_cert, certs.client_key)
    return gctx.wrap_socket(raw, server_hostname="localhost")


def _roundtrip(sock, n: int = 20, body: bytes = b"hello") -> None:  # type: ignore[no-untyped-def]
    sock.sendall(b"".join(send_frame(i, body) for i in range(1, n + 1)))
    for i in range(1, n + 1):
        resp = decode_frame(read_frame(sock))
        assert resp.is_response and resp.opaque == i and resp.code == C.SUCCESS


@pytest.mark.parametrize("upstream_tls", [False, True], ids=["plain-upstream", "tls-upstream"])
def test_tls_client_through_the_relay(certs: CertSet, scanner: tuple, upstream_tls: bool) -> None:
    broker = TlsFakeBroker(certs) if upstream_tls else FakeBroker()
    tls_cfg: dict = {"listen": _listen(certs)}
    if upstream_tls:
        tls_cfg["upstream"] = {"enable": True, "ca": str(certs.ca), "server_name": "localhost"}
    px = Proxy(tls_cfg, broker.addr, scanner)
    try:
        c = tls_client(px.port, certs)
        _roundtrip(c)
        # large frames in both directions cross many TLS records (16 KiB each) and buffer refills
        big = bytes(range(256)) * 4096  # 1 MiB
        c.sendall(send_frame(100, big))
        resp = decode_frame(read_frame(c))
        assert resp.opaque == 100 and resp.code == C.SUCCESS
        assert broker.seen[-1].body == big
        # policy still applies: an admin code is denied by the proxy, over TLS
        c.sendall(encode(RemotingCommand(code=C.UPDATE_AND_CREATE_TOPIC, opaque=200, ext_fields={"topic": "T"})))
        resp = decode_frame(read_frame(c))
        assert resp.opaque == 200 and resp.code == C.NO_PERMISSION
        assert all(cmd.code != C.UPDATE_AND_CREATE_TOPIC for cmd in broker.seen)
        # the broker's check-back request (code 39) reaches the client over TLS
        c.sendall(encode(RemotingCommand(code=C.HEART_BEAT, opaque=300, body=b"{}")))
        got = {decode_frame(read_frame(c)).code for _ in range(2)}
        assert got == {C.SUCCESS, C.CHECK_TRANSACTION_STATE}
        assert sum(count for _, count, _ in px.stats.requests()) >= 23  # every frame scanned
        assert px.tls.handshakes == (2 if upstream_tls else 1)
        c.close()
    finally:
        px.stop()
        broker.server.stop(timeout=1)


def test_plain_client_to_tls_upstream(certs: CertSet, scanner: tuple) -> None:
    broker = TlsFakeBroker(certs, require_client_cert=True)
    px = Proxy({"upstream": {"enable": True, "ca": str(certs.ca), "server_name": "localhost",
                             "cert": str(certs.client_cert), "key": str(certs.client_key)}}, broker.addr, scanner)
    try:
        c = socket.create_connection(("127.0.0.1", px.port), timeout=10)
        _roundtrip(c, body=b"x" * 70000)
        assert broker.peer_certs and broker.peer_certs[0]["subject"][0][0][1] == "rmqfast test client"
        c.close()
    finally:
        px.stop()
        broker.server.stop(timeout=1)


def test_permissive_listener_takes_both(certs: CertSet, scanner: tuple) -> None:
    broker = FakeBroker()
    px = Proxy({"listen": _listen(certs, "permissive")}, broker.addr, scanner)
    try:
        plain = socket.create_connection(("127.0.0.1", px.port), timeout=10)
        _roundtrip(plain)
        enc = tls_client(px.port, certs)
        _roundtrip(enc)
        assert px.tls.handshakes == 1
        plain.close()
        enc.close()
    finally:
        px.stop()
        broker.server.stop(timeout=1)


def test_enforcing_listener_closes_plain_clients(certs: CertSet, scanner: tuple) -> None:
    broker = FakeBroker()
    px = Proxy({"listen": _listen(certs, "enforcing")}, broker.addr, scanner)
    try:
        plain = socket.create_connection(("127.0.0.1", px.port), timeout=10)
        plain.sendall(send_frame(1))
        try:
            assert plain.recv(100) == b""  # closed without an answer
        except ConnectionResetError:
            pass  # closed with the frame unread: a reset
        assert px.tls.failures == 1
        assert broker.seen == []
    finally:
        px.stop()
        broker.server.stop(timeout=1)


def test_client_certificate_required(certs: CertSet, other_certs: CertSet, scanner: tuple) -> None:
    broker = FakeBroker()
    px = Proxy({"listen": _listen(certs, verify_client="require", ca=str(certs.ca))}, broker.addr, scanner)
    try:
        with pytest.raises((ssl.SSLError, OSError)):
            c = tls_client(px.port, certs)  # no client certificate
            c.sendall(send_frame(1))
            if not c.recv(100):
                raise OSError("closed")
        good = tls_client(px.port, certs, client_cert=True)
        _roundtrip(good)
        good.close()
    finally:
        px.stop()
        broker.server.stop(timeout=1)


def test_upstream_certificate_not_trusted(certs: CertSet, other_certs: CertSet, scanner: tuple) -> None:
    """An upstream whose certificate the CA did not sign: no connection; the client is told why."""
    broker = TlsFakeBroker(certs)
    px = Proxy({"upstream": {"enable": True, "ca": str(other_certs.ca)}}, broker.addr, scanner)
    try:
        c = socket.create_connection(("127.0.0.1", px.port), timeout=10)
        c.sendall(send_frame(5))
        resp = decode_frame(read_frame(c))
        assert resp.opaque == 5 and resp.code == C.SYSTEM_ERROR
        assert "TLS handshake failed: CERTIFICATE_VERIFY_FAILED (unable to get local issuer certificate)" in (
            resp.remark or "")
        assert px.events.errors == 1 and px.tls.failures == 1 and broker.seen == []
        with gevent.Timeout(10):
            while broker.handshake_failures < 1:  # the broker saw the proxy's alert
                gevent.sleep(0.01)
    finally:
        px.stop()
        broker.server.stop(timeout=1)


def test_handshake_timeout_closes(certs: CertSet, scanner: tuple) -> None:
    broker = FakeBroker()
    px = Proxy({"listen": _listen(certs, "enforcing", handshake_timeout=0.3)}, broker.addr, scanner)
    try:
        silent = socket.create_connection(("127.0.0.1", px.port), timeout=10)
        with gevent.Timeout(10):
            assert silent.recv(10) == b""
        assert px.tls.failures == 1
    finally:
        px.stop()
        broker.server.stop(timeout=1)


def test_reload_new_certificate_and_bad_files(certs: CertSet, other_certs: CertSet, tmp_path: Path,
                                              scanner: tuple) -> None:
    """Certificates are read again on reload (same paths, new content): new connections get the new
    certificate, open ones go on; a reload with a bad file keeps the running certificate."""
    cert, key = tmp_path / "live.pem", tmp_path / "live.key"
    shutil.copy(certs.server_cert, cert)
    shutil.copy(certs.server_key, key)
    broker = FakeBroker()
    sec_raw = {"listen": {"mode": "enforcing", "cert": str(cert), "key": str(key)}}
    px = Proxy(sec_raw, broker.addr, scanner)

    def served_serial() -> int:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        from gevent import ssl as gssl

        g = gssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        g.check_hostname = False
        g.verify_mode = ssl.CERT_NONE
        s = g.wrap_socket(socket.create_connection(("127.0.0.1", px.port), timeout=10))
        der = s.getpeercert(binary_form=True)
        s.close()
        return serial_of(der)

    try:
        first = serial_of(certs.server_cert.read_bytes())
        assert served_serial() == first
        before = tls_client(px.port, certs)
        _roundtrip(before, 3)
        shutil.copy(other_certs.server_cert, cert)
        shutil.copy(other_certs.server_key, key)
        assert px.tls.reload(parse_tls(sec_raw))
        assert served_serial() == serial_of(other_certs.server_cert.read_bytes())
        _roundtrip(before, 3)  # the connection made before the reload goes on
        # a bad file at reload: the running certificate stays
        key.write_text("garbage")
        assert not px.tls.reload(TlsSection.from_dict(parse_tls_unchecked(sec_raw)))
        assert served_serial() == serial_of(other_certs.server_cert.read_bytes())
        before.close()
    finally:
        px.stop()
        broker.server.stop(timeout=1)


def parse_tls_unchecked(raw: dict) -> dict:
    """The section as the worker gets it (from JSON, files not checked by the supervisor again)."""
    li = dict(raw["listen"])
    return {"listen": li, "upstream": {}}


def test_tls_socket_short_reads_leave_nothing_inside_openssl(certs: CertSet) -> None:
    """recv_into returns short only when nothing decrypted is left inside OpenSSL (the pump then
    waits for socket readiness, which would never come for bytes OpenSSL holds); a buffer smaller
    than a record is filled, and the rest of the record comes with the next calls."""
    a, b = socket.socketpair()
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(certs.server_cert, certs.server_key)
    cctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    cctx.load_verify_locations(certs.ca)
    from rmqfast.proxy.tls import _handshake

    server = gevent.spawn(_handshake, sctx, a, True, None, 5.0)
    client = _handshake(cctx, b, False, "localhost", 5.0)
    srv: TlsSocket = server.get(timeout=10)

    def drain(size: int, want: int) -> bytes:
        buf = bytearray(size)
        out = bytearray()
        with gevent.Timeout(10):
            while len(out) < want:
                try:
                    n = srv._sock.recv_into(memoryview(buf))
                except BlockingIOError:
                    gevent.sleep(0.005)
                    continue
                out += buf[:n]
                if n < size:
                    assert srv._sock.pending() == 0  # a short count: nothing decrypted left behind
        return bytes(out)

    payload = bytes(range(256)) * 300  # 76800 bytes: 4 full records and a short one
    client.sendall(payload)
    assert drain(1 << 20, len(payload)) == payload
    with pytest.raises(BlockingIOError):
        srv._sock.recv_into(memoryview(bytearray(100)))
    client.sendall(payload)
    assert drain(1000, len(payload)) == payload  # smaller than a record: filled, the rest follows
    client.close()  # close_notify: the end of the stream
    with gevent.Timeout(10):
        while True:
            try:
                assert srv._sock.recv_into(memoryview(bytearray(100))) == 0
                break
            except BlockingIOError:
                gevent.sleep(0.01)
    srv.close()


def test_proxy_own_connections_use_upstream_tls(certs: CertSet, other_certs: CertSet) -> None:
    """Broker health probes, moved sends and route lookups (rmqfast.clouds.remoting.Connection)
    speak TLS when [tls.upstream] covers the role; an untrusted certificate is a connect error."""
    from rmqfast.clouds.remoting import Connection, ConnectionPool, RemoteError

    broker = TlsFakeBroker(certs)
    addr = f"127.0.0.1:{broker.addr.port}"
    try:
        tls = TlsContexts(parse_tls({"upstream": {"enable": True, "ca": str(certs.ca), "roles": ["broker"]}}))
        conn = Connection(addr, connect_timeout=5, wrap=tls.wrapper("broker", 5.0))
        assert conn.request(C.HEART_BEAT, body=b"{}", timeout=10).code == C.SUCCESS
        big = b"z" * 300000  # several TLS records each way
        assert conn.request(C.SEND_MESSAGE_V2, {"a": "PG", "b": "T"}, big, timeout=10).code == C.SUCCESS
        assert broker.seen[-1].body == big
        conn.close()
        pool = ConnectionPool(5, wrap=tls.wrapper("broker", 5.0))
        assert pool.request(addr, C.HEART_BEAT, body=b"{}", timeout=10).code == C.SUCCESS
        pool.close()
        # the namesrv role is not covered: its connections stay plain (and fail against a TLS server)
        with pytest.raises(RemoteError):
            Connection(addr, connect_timeout=5, wrap=tls.wrapper("namesrv", 5.0)).request(
                C.HEART_BEAT, body=b"{}", timeout=2)
        wrong = TlsContexts(parse_tls({"upstream": {"enable": True, "ca": str(other_certs.ca)}}))
        with pytest.raises(RemoteError, match="CERTIFICATE_VERIFY_FAILED"):
            Connection(addr, connect_timeout=5, wrap=wrong.wrapper("broker", 5.0))
    finally:
        broker.server.stop(timeout=1)


def test_check_config_summary_names_tls(certs: CertSet, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rmqfast.cli import main

    f = tmp_path / "c.toml"
    f.write_text(f'[namesrv]\nupstreams = ["127.0.0.1:9876"]\n[tls.listen]\nmode = "permissive"\n'
                 f'cert = "{certs.server_cert}"\nkey = "{certs.server_key}"\n'
                 f'[tls.upstream]\nenable = true\nverify = false\nroles = ["broker"]\n')
    assert main(["check-config", str(f)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("TLS"))
    assert "namesrv and broker listeners permissive" in line
    assert "broker upstreams over TLS (certificates not verified)" in line


def test_tls_client_told_when_upstream_unreachable(certs: CertSet, scanner: tuple) -> None:
    """The refusal path (SYSTEM_ERROR to whatever the client sends, then close) works over TLS."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    px = Proxy({"listen": _listen(certs)}, HostPort("127.0.0.1", port), scanner)
    try:
        c = tls_client(px.port, certs)
        c.sendall(send_frame(9))
        resp = decode_frame(read_frame(c))
        assert resp.opaque == 9 and resp.code == C.SYSTEM_ERROR and "upstream unreachable" in (resp.remark or "")
        c.close()
    finally:
        px.stop()

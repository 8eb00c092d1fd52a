"""TLS in a real ``rmqfast serve`` (2 workers) in front of a fake name server that speaks only TLS:
the readiness probe reaches it over TLS, clients get the listener's certificate, and SIGHUP
reads the certificate files again (new connections get the new certificate, open ones go
on; a bad file is refused and the running certificate stays)."""

from __future__ import annotations

import itertools
import shutil
import socket
import socketserver
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode, make_response
from rmqfast.testing.proxy import ProxyProcess
from rmqfast.testing.standins import QUERY_NOT_FOUND, StandInServer
from rmqfast.testing.tlscerts import CertSet, make_certs, serial_of
from rmqfast.testing.wire import read_frame

pytest.importorskip("cryptography")

_opaques = itertools.count(1)


class _TlsNameServerHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv = self.server
        try:
            conn = srv.ctx.wrap_socket(self.request, server_side=True)  # type: ignore[attr-defined]
        except (ssl.SSLError, OSError):
            srv.plain_or_failed += 1  # type: ignore[attr-defined]
            return
        while True:
            try:
                data = read_frame(conn)
            except OSError:
                return
            if data is None:
                return
            cmd = decode_frame(data)
            code = QUERY_NOT_FOUND if cmd.code == C.GET_KV_CONFIG else C.SUCCESS
            conn.sendall(encode(make_response(cmd, code, remark="tls fake name server")))


def tls_name_server(certs: CertSet) -> StandInServer:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.server_cert, certs.server_key)
    srv = StandInServer.__new__(StandInServer)
    srv.ctx = ctx  # type: ignore[attr-defined]
    srv.plain_or_failed = 0  # type: ignore[attr-defined]
    StandInServer.__init__(srv, _TlsNameServerHandler)
    return srv


def kv(sock: ssl.SSLSocket) -> int:
    opaque = next(_opaques)
    sock.sendall(encode(RemotingCommand(code=C.GET_KV_CONFIG, opaque=opaque,
                                        ext_fields={"namespace": "ORDER_TOPIC_CONFIG", "key": "T"})))
    data = read_frame(sock)
    assert data is not None
    cmd = decode_frame(data)
    assert cmd.opaque == opaque
    return cmd.code


def tls_connect(addr: str, ca: Path | None) -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_verify_locations(ca)
    host, _, port = addr.rpartition(":")
    return ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=30), server_hostname="localhost")


def served_serial(addr: str) -> int:
    with tls_connect(addr, None) as s:
        der = s.getpeercert(binary_form=True)
        assert der is not None
        return serial_of(der)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertSet, CertSet, Path]:
    d = tmp_path_factory.mktemp("tls")
    return make_certs(d / "a"), make_certs(d / "b", prefix="b-"), d


def _records(p: ProxyProcess, msg: str) -> list[dict]:
    return [r for r in p.log_records() if r.get("msg") == msg]


def _wait_records(p: ProxyProcess, msg: str, count: int, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _records(p, msg)
        if len(found) >= count:
            return found
        assert p.proc is not None and p.proc.poll() is None, p.log_tail()
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} {msg!r} within {timeout}s:\n{p.log_tail()}")


@pytest.fixture
def served(certs: tuple[CertSet, CertSet, Path]) -> Iterator[tuple[ProxyProcess, StandInServer, Path, Path]]:
    a, _b, d = certs
    live_cert, live_key = d / "live.pem", d / "live.key"
    shutil.copy(a.server_cert, live_cert)
    shutil.copy(a.server_key, live_key)
    ns = tls_name_server(a)
    extra = (f'[tls.listen]\nmode = "enforcing"\ncert = "{live_cert}"\nkey = "{live_key}"\n'
             f'[tls.upstream]\nenable = true\nca = "{a.ca}"\nserver_name = "localhost"\n')
    try:
        with ProxyProcess([ns.addr], workers=2, extra_config=extra) as p:
            yield p, ns, live_cert, live_key
    finally:
        ns.close()


def test_tls_both_sides_and_readiness(served: tuple, certs: tuple) -> None:
    p, ns, _, _ = served
    a = certs[0]
    assert p.get("/readyz")[0] == 200  # the probe reached the TLS-only name server
    with tls_connect(p.namesrv_addr, a.ca) as s:
        assert kv(s) == QUERY_NOT_FOUND
    assert ns.plain_or_failed == 0  # type: ignore[attr-defined]
    plain = socket.create_connection(("127.0.0.1", p.namesrv_port), timeout=30)
    plain.sendall(b"\x00\x00\x00\x10not a TLS hello")  # the enforcing listener closes it
    try:
        assert plain.recv(10) == b""
    except ConnectionResetError:
        pass
    plain.close()

    def handshakes() -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for (name, labels), v in p.metrics().items():
            d = dict(labels)
            if name == "rmqfast_tls_handshakes_total" and d.get("role") == "namesrv":
                out[(d["side"], d["result"])] = v
        return out

    deadline = time.monotonic() + 30  # workers publish once a second
    while time.monotonic() < deadline:
        got = handshakes()
        if got.get(("client", "ok"), 0) >= 1 and got.get(("upstream", "ok"), 0) >= 1 and \
                got.get(("client", "failed"), 0) >= 1:
            break
        time.sleep(0.2)
    assert got.get(("client", "ok"), 0) >= 1 and got.get(("upstream", "ok"), 0) >= 1, got
    assert got.get(("client", "failed"), 0) >= 1, got


def test_sighup_reloads_certificates(served: tuple, certs: tuple) -> None:
    p, _ns, live_cert, live_key = served
    a, b, _ = certs
    assert served_serial(p.namesrv_addr) == serial_of(a.server_cert.read_bytes())
    before = tls_connect(p.namesrv_addr, a.ca)
    assert kv(before) == QUERY_NOT_FOUND
    loaded = len(_records(p, "TLS certificates loaded"))
    shutil.copy(b.server_cert, live_cert)
    shutil.copy(b.server_key, live_key)
    p.reload()
    _wait_records(p, "TLS certificates loaded", loaded + 2)  # both workers
    new = serial_of(b.server_cert.read_bytes())
    # SO_REUSEPORT spreads new connections over both workers: every one gets the new certificate
    assert [served_serial(p.namesrv_addr) for _ in range(12)] == [new] * 12
    with tls_connect(p.namesrv_addr, b.ca) as s:
        assert kv(s) == QUERY_NOT_FOUND
    assert kv(before) == QUERY_NOT_FOUND  # the connection made before the reload goes on
    # a broken key file: the reload is refused with the reason, the running certificate stays
    refused = len(_records(p, "reload refused; keeping the running configuration"))
    live_key.write_text("-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
    p.reload()
    rec = _wait_records(p, "reload refused; keeping the running configuration", refused + 1)[-1]
    assert "tls.listen" in rec["error"], rec
    assert [served_serial(p.namesrv_addr) for _ in range(6)] == [new] * 6
    assert kv(before) == QUERY_NOT_FOUND
    before.close()

"""``[tls.upstream]`` on the gRPC front's Remoting connections (rmqfast.grpcfront.upstream): a real
TLS socket stands in for a broker / name server; the front connects with TLS where the section
covers the role, fails with a clear error (not a hang) when verification fails, and stays plain
where it does not."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography")

from rmqfast.codec.command import RemotingCommand, decode_frame, encode  # noqa: E402
from rmqfast.grpcfront.upstream import Lanes, Pool, UpstreamError, UpstreamTls  # noqa: E402
from rmqfast.proxy.tls import TlsListenSection, TlsSection, TlsUpstreamSection, server_context  # noqa: E402
from rmqfast.testing.tlscerts import CertSet  # noqa: E402


class Seen:
    """What the stand-in server saw of each connection: TLS or not, the client certificate."""

    def __init__(self) -> None:
        self.tls: list[bool] = []
        self.peer_certs: list[Any] = []
        self.codes: list[int] = []


def _answerer(seen: Seen) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sslobj = writer.get_extra_info("ssl_object")
        seen.tls.append(sslobj is not None)
        seen.peer_certs.append(sslobj.getpeercert() if sslobj is not None else None)
        try:
            while True:
                head = await reader.readexactly(4)
                frame = decode_frame(head + await reader.readexactly(int.from_bytes(head, "big")))
                seen.codes.append(frame.code)
                writer.write(encode(RemotingCommand(code=0, opaque=frame.opaque, flag=1, remark=f"ok {frame.code}")))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    return serve


async def _server(seen: Seen, ctx: ssl.SSLContext | None) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(_answerer(seen), "127.0.0.1", 0, ssl=ctx)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _listen_ctx(certs: CertSet, verify_client: str = "none") -> ssl.SSLContext:
    return server_context(TlsListenSection(mode="enforcing", cert=str(certs.server_cert), key=str(certs.server_key),
                                           ca=str(certs.ca) if verify_client != "none" else "",
                                           verify_client=verify_client))


def _up(certs: CertSet, **kw: Any) -> TlsUpstreamSection:
    return TlsUpstreamSection(**{"enable": True, "ca": str(certs.ca), **kw})


def test_pool_and_lanes_speak_tls_with_a_client_certificate(certs: CertSet) -> None:
    """Broker role over TLS, the certificate checked against ``ca`` for ``server_name``, the client
    certificate presented to a server that requires one; the long-polling lanes too."""

    async def go() -> None:
        seen = Seen()
        server, addr = await _server(seen, _listen_ctx(certs, "require"))
        tls = UpstreamTls(_up(certs, server_name="localhost", cert=str(certs.client_cert), key=str(certs.client_key)),
                          ["10.0.0.1:9876"])
        pool = Pool(5.0, tls=tls)
        lanes = Lanes(5.0, shared=pool, tls=tls)
        try:
            assert (await pool.request(addr, 10, {"k": "v"}, timeout=10)).remark == "ok 10"
            assert (await lanes.request(addr, 11, {}, timeout=10)).remark == "ok 11"
        finally:
            await lanes.close()
            await pool.close()
            server.close()
        assert seen.tls == [True, True]
        assert seen.codes == [10, 11]
        subjects = [dict(x[0] for x in c["subject"]) for c in seen.peer_certs]
        assert all(s.get("commonName") for s in subjects)  # a client certificate was presented each time

    asyncio.run(go())


def test_host_name_checked_when_server_name_is_empty(certs: CertSet) -> None:
    """``server_name = ""``: the address's host is what the certificate must name (127.0.0.1 is in it)."""

    async def go() -> None:
        seen = Seen()
        server, addr = await _server(seen, _listen_ctx(certs))
        pool = Pool(5.0, tls=UpstreamTls(_up(certs), []))
        try:
            assert (await pool.request(addr, 12, {}, timeout=10)).remark == "ok 12"
        finally:
            await pool.close()
            server.close()
        assert seen.tls == [True]

    asyncio.run(go())


@pytest.mark.parametrize("case", ["unknown-ca", "wrong-name"])
def test_verification_failure_is_a_clear_error_not_a_hang(certs: CertSet, other_certs: CertSet, case: str) -> None:
    async def go() -> None:
        seen = Seen()
        server, addr = await _server(seen, _listen_ctx(certs))
        up = _up(other_certs) if case == "unknown-ca" else _up(certs, server_name="broker.example")
        pool = Pool(30.0, tls=UpstreamTls(up, []))
        t0 = time.monotonic()
        try:
            with pytest.raises(UpstreamError) as err:
                await pool.request(addr, 10, {}, timeout=30)
        finally:
            await pool.close()
            server.close()
        elapsed = time.monotonic() - t0
        msg = str(err.value)
        assert msg.startswith(f"TLS handshake with {addr} failed")
        assert ("unable to get local issuer certificate" in msg if case == "unknown-ca"
                else "Hostname mismatch" in msg and "broker.example" in msg), msg
        assert elapsed < 25, elapsed  # failed at the handshake, not at the 30 s bound
        assert seen.codes == []  # nothing reached the server

    asyncio.run(go())


def test_tls_front_at_a_plain_server_fails_within_the_connect_timeout(certs: CertSet) -> None:
    """A plain Remoting server reads the ClientHello as a frame length and waits: the handshake is
    bounded by the connect timeout and says so."""

    async def go() -> None:
        seen = Seen()
        server, addr = await _server(seen, None)
        pool = Pool(1.0, tls=UpstreamTls(_up(certs), []))
        t0 = time.monotonic()
        try:
            with pytest.raises(UpstreamError, match=rf"TLS (handshake with|connection to) {addr}"):
                await pool.request(addr, 10, {}, timeout=30)
        finally:
            await pool.close()
            server.close()
        assert time.monotonic() - t0 < 20

    asyncio.run(go())


@pytest.mark.parametrize("setting", ["off", "namesrv-only", "no-section"])
def test_plain_stays_plain(certs: CertSet, setting: str) -> None:
    """TLS off, or ``roles`` not covering the broker: the broker connection is plain TCP."""

    async def go() -> None:
        seen = Seen()
        server, addr = await _server(seen, None)
        tls = {"off": UpstreamTls(TlsUpstreamSection(enable=False, ca=str(certs.ca)), []),
               "namesrv-only": UpstreamTls(_up(certs, roles=["namesrv"]), ["10.0.0.1:9876"]),
               "no-section": None}[setting]
        pool = Pool(5.0, tls=tls)
        try:
            assert (await pool.request(addr, 13, {}, timeout=10)).remark == "ok 13"
        finally:
            await pool.close()
            server.close()
        assert seen.tls == [False]

    asyncio.run(go())


def test_roles_split_name_servers_and_brokers(certs: CertSet) -> None:
    """``roles = ["namesrv"]``: the configured name server over TLS, a broker of a route plain."""

    async def go() -> None:
        seen_ns, seen_b = Seen(), Seen()
        ns, ns_addr = await _server(seen_ns, _listen_ctx(certs))
        broker, b_addr = await _server(seen_b, None)
        pool = Pool(5.0, tls=UpstreamTls(_up(certs, roles=["namesrv"]), [ns_addr]))
        try:
            assert (await pool.request(ns_addr, 105, {}, timeout=10)).remark == "ok 105"
            assert (await pool.request(b_addr, 10, {}, timeout=10)).remark == "ok 10"
        finally:
            await pool.close()
            ns.close()
            broker.close()
        assert (seen_ns.tls, seen_b.tls) == ([True], [False])

    asyncio.run(go())


def test_messaging_service_takes_tls_upstream(certs: CertSet, tmp_path: Path) -> None:
    """The front's service builds its pool and lanes from the configuration's ``[tls.upstream]``."""
    pytest.importorskip("grpc")
    from rmqfast.grpcfront import protos
    from rmqfast.grpcfront.service import MessagingService
    from rmqfast.grpcfront.settings import GrpcSection

    async def go() -> None:
        pb = protos.load()
        on = MessagingService(pb, ["127.0.0.1:9876"], GrpcSection(enabled=True),
                              tls=TlsSection(upstream=_up(certs, roles=["broker"])))
        off = MessagingService(pb, ["127.0.0.1:9876"], GrpcSection(enabled=True), tls=TlsSection())
        assert on.pool.tls is not None and on.lanes.tls is on.pool.tls
        assert on.pool.tls.for_addr("127.0.0.1:9876", "127.0.0.1") is None  # name server: not in roles
        over = on.pool.tls.for_addr("127.0.0.1:10911", "127.0.0.1")
        assert over is not None and over[1] == "127.0.0.1"
        assert off.pool.tls is None and off.lanes.tls is None
        await on.close()
        await off.close()

    asyncio.run(go())

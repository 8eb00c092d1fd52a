"""The nghttp2 gRPC server against half-open, silent and idle connections (issue 30, findings 2):
a connection that never finishes its HTTP/2 handshake (preface and first SETTINGS) is closed at
``handshake_timeout``, one with no open stream at ``idle_timeout`` (after GOAWAY), half-open
connections cannot lock a real client out, and one client address holds at most
``max_connections_per_client`` connections."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
h2server = pytest.importorskip("rmqfast.grpcfront.h2server")
if h2server.lib is None:
    pytest.skip("rmqfast.grpcfront._h2 not built (libnghttp2-dev)", allow_module_level=True)

from tests.test_h2server import SVC, Service, pb, run  # noqa: E402,F401
from tests.test_h2server_attack import GOAWAY, PREFACE, SETTINGS, RawClient, frame  # noqa: E402


async def _server(pb: Any, ctx: Any = None, **kw: Any) -> tuple[Any, Service, int]:  # noqa: F811
    svc = Service(pb)
    server = h2server.H2Server(svc, 1 << 20, ctx, **kw)
    port = await server.start("127.0.0.1", 0)
    return server, svc, port


def _wait_closed(s: socket.socket, within: float) -> float | None:
    """Read (and drop) what the server sends until it closes; the seconds that took, None if it did
    not close within ``within`` seconds."""
    t0 = time.monotonic()
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return time.monotonic() - t0


def _raw(port: int, send: bytes, src: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    if send:
        s.sendall(send)
    return s


async def _heartbeat(pb: Any, port: int, name: str) -> str:  # noqa: F811
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        hb = ch.unary_unary(SVC + "Heartbeat", request_serializer=pb.HeartbeatRequest.SerializeToString,
                            response_deserializer=pb.HeartbeatResponse.FromString)
        resp = await hb(pb.HeartbeatRequest(group=pb.Resource(name=name)), timeout=30)
        return str(resp.status.message)


async def _until(cond: Any, what: str, within: float = 30.0) -> None:
    """Wait until ``cond()`` holds (the server's own progress), failing after ``within`` s."""
    end = time.monotonic() + within
    while not cond():
        assert time.monotonic() < end, f"not reached in {within} s: {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("sent", [PREFACE[:10], PREFACE, b""], ids=["half-preface", "preface-no-settings", "nothing"])
def test_an_unfinished_handshake_is_closed_at_the_deadline(pb: Any, sent: bytes) -> None:  # noqa: F811
    async def go() -> None:
        server, _, port = await _server(pb, handshake_timeout=0.5)
        loop = asyncio.get_running_loop()
        s = await loop.run_in_executor(None, _raw, port, sent)
        took = await loop.run_in_executor(None, _wait_closed, s, 20.0)
        s.close()
        assert took is not None, "the connection was still open 20 s after it stopped sending"
        assert took < 10.0, took
        await _until(lambda: not server.conns, "the connection forgotten")
        assert server.gate.closed["handshake_timeout"] == 1
        await server.stop(1.0)

    run(go())


def test_a_finished_handshake_is_not_cut_by_the_handshake_deadline_but_idle_is(pb: Any) -> None:  # noqa: F811
    """Preface + SETTINGS and then silence: past the handshake deadline it stays; with no stream for
    ``idle_timeout`` it gets GOAWAY and is closed.  A connection with an open stream is not idle."""

    async def go() -> None:
        server, svc, port = await _server(pb, handshake_timeout=0.3, idle_timeout=1.0)
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            route = ch.unary_unary(SVC + "QueryRoute", request_serializer=pb.QueryRouteRequest.SerializeToString,
                                   response_deserializer=pb.QueryRouteResponse.FromString)
            call = route(pb.QueryRouteRequest())  # open until cancelled: its connection is never idle
            await asyncio.wait_for(svc.started.wait(), 30)
            t0 = time.monotonic()
            c = await loop.run_in_executor(None, RawClient, port)

            def frames_until_closed() -> list[int]:
                seen = []
                while not c.closed:
                    f = c.read_frame(20.0)
                    if f is None:
                        break
                    seen.append(f[0])
                return seen

            seen = await loop.run_in_executor(None, frames_until_closed)
            took = time.monotonic() - t0
            assert GOAWAY in seen, seen
            assert await loop.run_in_executor(None, _wait_closed, c.s, 20.0) is not None
            assert 0.9 <= took < 15.0, took  # not at the 0.3 s handshake deadline: at the idle one
            c.s.close()
            assert server.gate.closed["idle"] == 1 and server.gate.closed["handshake_timeout"] == 0
            assert not call.done() and len(server.gate.established) == 1
            call.cancel()
        await server.stop(1.0)

    run(go())


def test_half_open_connections_cannot_lock_a_client_out(pb: Any) -> None:  # noqa: F811
    """Three times ``max_connections`` half-prefaces from other addresses, kept open well within the
    handshake deadline: a real client is still served; handshaken connections are what
    ``max_connections`` counts."""

    async def go() -> None:
        server, _, port = await _server(pb, max_connections=4, handshake_timeout=60.0)
        loop = asyncio.get_running_loop()
        half = [await loop.run_in_executor(None, _raw, port, PREFACE[:10], f"127.0.0.{2 + i}") for i in range(12)]
        await _until(lambda: server.gate.closed["handshake_evicted"] >= 8, "12 half-open connections accepted")
        assert await _heartbeat(pb, port, "G1") == "G1"
        await _until(lambda: not server.gate.established, "the heartbeat's connection closed")
        # four handshaken connections fill max_connections: the fifth is closed once it has shaken hands
        full = [await loop.run_in_executor(None, RawClient, port) for _ in range(4)]
        await _until(lambda: len(server.gate.established) == 4, "four established")
        fifth = await loop.run_in_executor(None, _raw, port, PREFACE + frame(SETTINGS, 0, 0))
        assert await loop.run_in_executor(None, _wait_closed, fifth, 20.0) is not None
        assert server.gate.closed["max_connections"] == 1
        assert server.refused == 1
        for s in half:
            s.close()
        for c in full:
            c.s.close()
        fifth.close()
        await _until(lambda: not server.conns, "all forgotten")
        assert not server.gate.by_client and not server.gate.pending
        await server.stop(1.0)

    run(go())


def test_one_address_holds_at_most_its_share(pb: Any) -> None:  # noqa: F811
    async def go() -> None:
        server, _, port = await _server(pb, max_connections_per_client=3)
        loop = asyncio.get_running_loop()
        kept = [await loop.run_in_executor(None, _raw, port, b"", "127.0.0.2") for _ in range(3)]
        await _until(lambda: server.gate.by_client.get("127.0.0.2") == 3, "three from 127.0.0.2")
        extra = await loop.run_in_executor(None, _raw, port, b"", "127.0.0.2")
        took = await loop.run_in_executor(None, _wait_closed, extra, 20.0)
        assert took is not None and took < 10.0, took
        assert server.gate.closed["per_client"] == 1
        assert await _heartbeat(pb, port, "G2") == "G2"  # another address is served
        for s in kept + [extra]:
            s.close()
        await server.stop(1.0)

    run(go())


def test_a_tls_handshake_that_never_starts_is_closed_at_the_deadline(pb: Any, tmp_path: Any) -> None:  # noqa: F811
    from rmqfast.testing.tlscerts import make_certs

    certs = make_certs(tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.server_cert, certs.server_key)

    async def go() -> None:
        server, _, port = await _server(pb, ctx, handshake_timeout=0.5)
        loop = asyncio.get_running_loop()
        s = await loop.run_in_executor(None, _raw, port, b"\x16\x03\x01")  # a TLS record header, then nothing
        took = await loop.run_in_executor(None, _wait_closed, s, 20.0)
        s.close()
        assert took is not None and took < 10.0, took
        await server.stop(1.0)

    run(go())


def test_deadline_settings_are_checked() -> None:
    from rmqfast.errors import ConfigError
    from rmqfast.grpcfront.settings import parse_grpc

    s = parse_grpc({})
    assert (s.handshake_timeout, s.idle_timeout, s.max_connections_per_client) == (10.0, 300.0, 1000)
    s = parse_grpc({"handshake_timeout": 2, "idle_timeout": 30.5, "max_connections_per_client": 7})
    assert (s.handshake_timeout, s.idle_timeout, s.max_connections_per_client) == (2.0, 30.5, 7)
    for key, bad in (("handshake_timeout", 0), ("handshake_timeout", "ten seconds"), ("idle_timeout", -1),
                     ("max_connections_per_client", 0), ("max_connections_per_client", 2.5)):
        with pytest.raises(ConfigError, match=f"grpc.{key}"):
            parse_grpc({key: bad})


def test_grpcio_server_closes_a_half_preface_at_the_deadline() -> None:
    """``[grpc] server = "grpcio"``: grpc core's handshake deadline (preface and SETTINGS) is set from
    ``handshake_timeout``."""
    from rmqfast.grpcfront.server import grpcio_server
    from rmqfast.grpcfront.settings import parse_grpc

    class Bare:
        def handler(self) -> Any:
            return grpc.method_handlers_generic_handler("x.Y", {})

    settings = parse_grpc({"server": "grpcio", "handshake_timeout": 0.5})
    settings.listen = "127.0.0.1:0"  # the port from the OS

    async def go() -> None:
        server, port = await grpcio_server(Bare(), settings, None)
        loop = asyncio.get_running_loop()
        s = await loop.run_in_executor(None, _raw, port, PREFACE[:10])
        took = await loop.run_in_executor(None, _wait_closed, s, 20.0)
        s.close()
        await server.stop(0.5)
        assert took is not None and took < 10.0, took

    run(go())


def test_the_free_heap_is_given_back_once_many_connections_closed(pb: Any) -> None:  # noqa: F811
    """After a peak of connections closes, the sweep calls malloc_trim (issue 30, finding 7: glibc
    kept the freed sessions' heap, so RSS stayed at its peak; bench/grpc_conn_memory.py measures it)."""
    from rmqfast import heap

    if heap._malloc_trim() is None:
        pytest.skip("no glibc malloc_trim")

    async def go() -> None:
        server, _, port = await _server(pb, idle_timeout=20.0)  # sweeps every 2 s, closes none of these
        loop = asyncio.get_running_loop()
        n = heap.TRIM_MIN_DROP + 16
        socks = [await loop.run_in_executor(None, _raw, port, PREFACE + frame(SETTINGS, 0, 0)) for _ in range(n)]
        await _until(lambda: len(server.gate.established) == n, f"{n} established")
        assert server.heap.trims == 0 and server.gate.peak == n
        for s in socks:
            s.close()
        await _until(lambda: server.heap.trims == 1, "one trim after they closed")
        assert not server.conns and server.gate.peak == 0 and server.gate.closed["idle"] == 0
        await server.stop(1.0)

    run(go())


def test_a_trim_waits_for_a_quarter_of_the_peak_to_close() -> None:
    from rmqfast import heap

    class G:
        peak = 1000

    t = heap.Trimmer()
    if t._fn is None:
        pytest.skip("no glibc malloc_trim")
    g = G()
    assert not t.maybe_trim(751, g) and t.trims == 0  # 249 closed of 1000: under a quarter
    assert t.maybe_trim(750, g) and t.trims == 1 and g.peak == 750  # the peak starts again from here
    g.peak = 100
    assert not t.maybe_trim(100 - heap.TRIM_MIN_DROP + 1, g)  # fewer than TRIM_MIN_DROP: not worth it
    assert t.maybe_trim(100 - heap.TRIM_MIN_DROP, g) and t.trims == 2


def test_closes_are_counted_in_the_metrics_scraped_over_http() -> None:
    """``rmqfast serve`` with the gRPC front: a half preface is closed at ``[grpc] handshake_timeout``
    and counted in ``rmqfast_grpc_connections_closed_total{reason="handshake_timeout"}`` on /metrics."""
    import urllib.request

    from rmqfast.testing.proxy import ProxyProcess
    from rmqfast.testing.standins import FakeNameServer

    def extra(p: Any) -> str:  # the last port of the proxy's reserved broker range: no broker here uses it
        return f'\n[grpc]\nenabled = true\nlisten = "127.0.0.1:{p.port_range[1]}"\nhandshake_timeout = 0.5\n'

    def scrape(url: str) -> float:
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith('rmqfast_grpc_connections_closed_total{reason="handshake_timeout"}'):
                    return float(line.split()[-1])
        return 0.0

    ns = FakeNameServer()  # /readyz wants a name server that answers
    with contextlib.ExitStack() as stack:
        stack.callback(ns.close)
        proxy = stack.enter_context(ProxyProcess([f"127.0.0.1:{ns.server_address[1]}"], workers=1,
                                                 extra_config=extra))
        port = proxy.port_range[1]
        end = time.monotonic() + 60
        while True:  # the worker starts its front after it is ready
            try:
                s = _raw(port, PREFACE[:10])
                break
            except ConnectionRefusedError:
                assert time.monotonic() < end, f"the gRPC front never listened:\n{proxy.log_tail()}"
                time.sleep(0.05)
        took = _wait_closed(s, 20.0)
        s.close()
        assert took is not None and took < 10.0, took
        while (n := scrape(f"{proxy.admin_url}/metrics")) < 1:
            assert time.monotonic() < end, f"not counted on /metrics:\n{proxy.log_tail()}"
            time.sleep(0.1)
        assert n == 1


def test_client_key_counts_ipv6_by_its_64() -> None:
    from rmqfast.grpcfront.gate import client_key

    assert client_key(("10.1.2.3", 5000)) == "10.1.2.3"
    assert client_key(("::ffff:10.1.2.3", 5000, 0, 0)) == "10.1.2.3"
    assert client_key(("2001:db8:1:2:aaaa::1", 5000, 0, 0)) == client_key(("2001:db8:1:2:bbbb::9", 1, 0, 0)) \
        == "2001:db8:1:2::/64"
    assert client_key(("2001:db8:1:3::1", 5000, 0, 0)) != client_key(("2001:db8:1:2::1", 5000, 0, 0))
    assert client_key(None) == "" and client_key("/tmp/sock") == ""


def test_refusals_log_one_line_per_reason_every_10_s(caplog: pytest.LogCaptureFixture) -> None:
    from rmqfast.grpcfront.gate import Gate

    now = [100.0]
    counted: list[str] = []
    gate = Gate(2, 1, 10.0, 300.0, lambda: now[0], counted.append)

    class C:
        def shut(self, reason: str) -> None:
            counted.append("shut:" + reason)

    first = C()
    assert gate.admit(first, "10.0.0.1")
    with caplog.at_level("WARNING", logger="rmqfast.grpc"):
        for _ in range(5):
            assert not gate.admit(C(), "10.0.0.1")  # over the per-address cap of 1
        now[0] += 10.0
        assert not gate.admit(C(), "10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "max_connections_per_client = 1" in lines[0], lines
    assert gate.closed["per_client"] == 6 and counted == ["per_client"] * 6
    assert gate.admit(C(), "10.0.0.2") and gate.admit(C(), "10.0.0.3")  # a third pending: the oldest goes
    assert counted[-2:] == ["handshake_evicted", "shut:handshake_evicted"] and first not in gate.pending
    assert gate.by_client == {"10.0.0.2": 1, "10.0.0.3": 1}

"""The nghttp2 gRPC server (rmqfast.grpcfront.h2server) on real sockets, driven by grpcio's client:
unary, server streaming, bidi, unknown method, oversized message, deadline, cancel, many concurrent
streams, garbage connections, TLS with ALPN, graceful stop."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
h2server = pytest.importorskip("rmqfast.grpcfront.h2server")
if h2server.lib is None:
    pytest.skip("rmqfast.grpcfront._h2 not built (libnghttp2-dev)", allow_module_level=True)

from rmqfast.grpcfront import protos  # noqa: E402

SVC = "/apache.rocketmq.v2.MessagingService/"


class Service:
    """A stand-in for MessagingService with the same handler shapes."""

    SERVED = ("Heartbeat", "QueryRoute", "ReceiveMessage", "Telemetry", "SendMessage")

    def __init__(self, pb: Any) -> None:
        self.pb = pb
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.seen: dict[str, Any] = {}

    async def Heartbeat(self, req: Any, ctx: Any) -> Any:
        self.seen["md"] = dict(ctx.invocation_metadata())
        self.seen["peer"] = ctx.peer()
        self.seen["left"] = ctx.time_remaining()
        return self.pb.HeartbeatResponse(status=self.pb.Status(code=self.pb.Code.OK, message=req.group.name))

    async def QueryRoute(self, req: Any, ctx: Any) -> Any:  # waits until cancelled
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return self.pb.QueryRouteResponse()

    async def SendMessage(self, req: Any, ctx: Any) -> Any:
        if req.messages and req.messages[0].topic.name == "boom":
            raise RuntimeError("handler failed")
        return self.pb.SendMessageResponse(entries=[self.pb.SendResultEntry(message_id=str(len(m.body)))
                                                    for m in req.messages])

    async def ReceiveMessage(self, req: Any, ctx: Any) -> AsyncIterator[Any]:
        for i in range(req.batch_size):
            yield self.pb.ReceiveMessageResponse(message=self.pb.Message(body=b"m%d" % i))
        yield self.pb.ReceiveMessageResponse(status=self.pb.Status(code=self.pb.Code.OK))

    async def Telemetry(self, requests: AsyncIterator[Any], ctx: Any) -> AsyncIterator[Any]:
        async for cmd in requests:
            yield self.pb.TelemetryCommand(status=self.pb.Status(code=self.pb.Code.OK,
                                                                 message=cmd.settings.client_type and "s" or "x"))


@pytest.fixture(scope="module")
def pb() -> Any:
    return protos.load()


def run(coro: Any) -> Any:
    """On the front's own loop (uvloop's when installed)."""
    from rmqfast.grpcfront.server import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(asyncio.wait_for(coro, 120))


async def _start(pb: Any, max_body: int = 1 << 20, ctx: Any = None) -> tuple[Any, Service, int]:
    svc = Service(pb)
    server = h2server.H2Server(svc, max_body, ctx)
    port = await server.start("127.0.0.1", 0)
    return server, svc, port


def _unary(ch: Any, pb: Any, name: str, req_cls: str, resp_cls: str) -> Any:
    return ch.unary_unary(SVC + name, request_serializer=getattr(pb, req_cls).SerializeToString,
                          response_deserializer=getattr(pb, resp_cls).FromString)


def test_unary_metadata_deadline_and_peer(pb: Any) -> None:
    async def go() -> None:
        server, svc, port = await _start(pb)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            hb = _unary(ch, pb, "Heartbeat", "HeartbeatRequest", "HeartbeatResponse")
            resp = await hb(pb.HeartbeatRequest(group=pb.Resource(name="G1")), timeout=30,
                            metadata=(("x-mq-client-id", "c-1"), ("authorization", "a b")))
            assert resp.status.message == "G1"
            assert svc.seen["md"]["x-mq-client-id"] == "c-1" and svc.seen["md"]["authorization"] == "a b"
            assert svc.seen["peer"].startswith("ipv4:127.0.0.1:")
            # gRPC encodes a timeout of 10-100 s in tenths of a second rounded up, from the time
            # left when it sends (30.001 s goes out as "301" tenths): at most 0.1 s more than asked
            assert 0 < svc.seen["left"] <= 30.1 + 1e-6
            for i in range(5):  # the connection serves call after call
                r = await hb(pb.HeartbeatRequest(group=pb.Resource(name=f"G{i}")))
                assert r.status.message == f"G{i}"
        await server.stop(1.0)

    run(go())


def test_server_stream_and_bidi(pb: Any) -> None:
    async def go() -> None:
        server, _, port = await _start(pb)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            recv = ch.unary_stream(SVC + "ReceiveMessage",
                                   request_serializer=pb.ReceiveMessageRequest.SerializeToString,
                                   response_deserializer=pb.ReceiveMessageResponse.FromString)
            got = [r async for r in recv(pb.ReceiveMessageRequest(batch_size=5))]
            assert [r.message.body for r in got[:5]] == [b"m%d" % i for i in range(5)]
            assert got[5].status.code == pb.Code.OK
            tele = ch.stream_stream(SVC + "Telemetry", request_serializer=pb.TelemetryCommand.SerializeToString,
                                    response_deserializer=pb.TelemetryCommand.FromString)
            call = tele()
            for _ in range(3):  # the client writes over time and reads each answer before the next
                await call.write(pb.TelemetryCommand(settings=pb.Settings(client_type=pb.ClientType.PRODUCER)))
                answer = await call.read()
                assert answer.status.message == "s"
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        await server.stop(1.0)

    run(go())


def test_unknown_method_oversized_handler_error(pb: Any) -> None:
    async def go() -> None:
        server, _, port = await _start(pb, max_body=1000)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            pull = _unary(ch, pb, "PullMessage", "PullMessageRequest", "PullMessageResponse")
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await pull(pb.PullMessageRequest())
            assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
            send = _unary(ch, pb, "SendMessage", "SendMessageRequest", "SendMessageResponse")
            ok = await send(pb.SendMessageRequest(messages=[pb.Message(body=b"x" * 100)]))
            assert ok.entries[0].message_id == "100"
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await send(pb.SendMessageRequest(messages=[pb.Message(body=b"x" * 5000)]))
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            big = await send(pb.SendMessageRequest(messages=[pb.Message(body=b"y" * 900)]))  # the connection lives on
            assert big.entries[0].message_id == "900"
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await send(pb.SendMessageRequest(messages=[pb.Message(topic=pb.Resource(name="boom"))]))
            assert ei.value.code() == grpc.StatusCode.UNKNOWN
        await server.stop(1.0)

    run(go())


def test_deadline_and_cancel_cancel_the_handler(pb: Any) -> None:
    async def go() -> None:
        server, svc, port = await _start(pb)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            route = _unary(ch, pb, "QueryRoute", "QueryRouteRequest", "QueryRouteResponse")
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await route(pb.QueryRouteRequest(), timeout=0.5)
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(svc.cancelled.wait(), 30)
            svc.cancelled.clear()
            svc.started.clear()
            call = route(pb.QueryRouteRequest())
            await asyncio.wait_for(svc.started.wait(), 30)
            call.cancel()  # RST_STREAM from the client
            await asyncio.wait_for(svc.cancelled.wait(), 30)
            hb = _unary(ch, pb, "Heartbeat", "HeartbeatRequest", "HeartbeatResponse")
            assert (await hb(pb.HeartbeatRequest())).status.code == pb.Code.OK
        await server.stop(1.0)

    run(go())


def test_many_concurrent_streams(pb: Any) -> None:
    async def go() -> None:
        server, _, port = await _start(pb)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            send = _unary(ch, pb, "SendMessage", "SendMessageRequest", "SendMessageResponse")
            answers = await asyncio.gather(*(send(pb.SendMessageRequest(messages=[pb.Message(body=b"z" * i)]))
                                             for i in range(400)))
            assert [a.entries[0].message_id for a in answers] == [str(i) for i in range(400)]
        await server.stop(1.0)

    run(go())


def test_garbage_and_silent_connections_do_not_harm(pb: Any) -> None:
    async def go() -> None:
        server, _, port = await _start(pb)
        loop = asyncio.get_running_loop()
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 100, preface + b"\xff" * 64):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(junk)
            await w.drain()
            data = await asyncio.wait_for(r.read(), 30)  # the server closes it (after its SETTINGS/GOAWAY)
            assert isinstance(data, bytes)
            w.close()
        s = socket.create_connection(("127.0.0.1", port))
        s.close()  # connect and go: nothing to do
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            hb = _unary(ch, pb, "Heartbeat", "HeartbeatRequest", "HeartbeatResponse")
            with pytest.raises(grpc.aio.AioRpcError):  # past SETTINGS_MAX_HEADER_LIST_SIZE: the call fails
                await hb(pb.HeartbeatRequest(), metadata=tuple((f"x-big-{i}", "v" * 1000) for i in range(40)))
            assert (await hb(pb.HeartbeatRequest())).status.code == pb.Code.OK
        assert len(server.conns) <= 1
        await loop.run_in_executor(None, lambda: None)
        await server.stop(1.0)

    run(go())


def test_tls_with_alpn(pb: Any, tmp_path: Any) -> None:
    import ssl

    from rmqfast.testing.tlscerts import make_certs

    certs = make_certs(tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.server_cert, certs.server_key)

    async def go() -> None:
        server, _, port = await _start(pb, ctx=ctx)
        creds = grpc.ssl_channel_credentials(root_certificates=open(certs.ca, "rb").read())
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
            hb = _unary(ch, pb, "Heartbeat", "HeartbeatRequest", "HeartbeatResponse")
            assert (await hb(pb.HeartbeatRequest(group=pb.Resource(name="T")))).status.message == "T"
        await server.stop(1.0)

    run(go())


def test_graceful_stop_lets_a_running_call_finish(pb: Any) -> None:
    async def go() -> None:
        server, svc, port = await _start(pb)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            route = _unary(ch, pb, "QueryRoute", "QueryRouteRequest", "QueryRouteResponse")
            call = route(pb.QueryRouteRequest())
            await asyncio.wait_for(svc.started.wait(), 30)
            await server.stop(0.5)  # GOAWAY; the call outlives the grace and is cancelled
            assert svc.cancelled.is_set()
            with pytest.raises(grpc.aio.AioRpcError):
                await call
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    run(go())


def test_server_setting() -> None:
    from rmqfast.errors import ConfigError
    from rmqfast.grpcfront.settings import parse_grpc

    assert parse_grpc({"enabled": True, "server": "grpcio"}).server == "grpcio"
    assert parse_grpc({"enabled": True, "server": "h2"}).server == "h2"
    with pytest.raises(ConfigError, match="grpc.server"):
        parse_grpc({"server": "netty"})


def test_connections_past_max_connections_are_closed_and_counted(pb: Any) -> None:
    """``max_connections`` counts connections that finished their handshake (preface and SETTINGS):
    one more is closed once it has shaken hands, and served again when one of them closes."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + SETTINGS

    async def go() -> None:
        svc = Service(pb)
        server = h2server.H2Server(svc, 1 << 20, None, max_connections=2)
        port = await server.start("127.0.0.1", 0)
        held = []
        for _ in range(2):  # two connections the server keeps (handshaken, then silent)
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(preface)
            held.append((r, w))
        while len(server.gate.established) < 2:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(preface)
        got = b""
        while chunk := await asyncio.wait_for(reader.read(1000), 30):  # SETTINGS, GOAWAY, then closed
            got += chunk
        types, pos = [], 0
        while pos + 9 <= len(got):  # the frames it sent: its SETTINGS, ..., GOAWAY (7)
            types.append(got[pos + 3])
            pos += 9 + int.from_bytes(got[pos:pos + 3], "big")
        assert types[0] == 4 and types[-1] == 7, types
        writer.close()
        assert server.refused == 1 and len(server.conns) == 2
        held[0][1].close()  # one closes: a new connection is served again
        while len(server.conns) > 1:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            hb = _unary(ch, pb, "Heartbeat", "HeartbeatRequest", "HeartbeatResponse")
            resp = await hb(pb.HeartbeatRequest(group=pb.Resource(name="G9")), timeout=30)
            assert resp.status.message == "G9"
        assert server.refused == 1
        held[1][1].close()
        await server.stop(1.0)

    run(go())


def test_max_connections_setting_is_checked() -> None:
    from rmqfast.errors import ConfigError
    from rmqfast.grpcfront.settings import parse_grpc

    assert parse_grpc({}).max_connections == 10000
    assert parse_grpc({"max_connections": 50}).max_connections == 50
    for bad in (0, -1, "many", 1.5):
        with pytest.raises(ConfigError, match="grpc.max_connections"):
            parse_grpc({"max_connections": bad})

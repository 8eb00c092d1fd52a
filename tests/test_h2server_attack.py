"""The nghttp2 gRPC server against a raw HTTP/2 client that obeys flow control but never finishes
its calls: what the server holds for such a connection stays within the connection's window."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any

import pytest

pytest.importorskip("grpc")
h2server = pytest.importorskip("rmqfast.grpcfront.h2server")
if h2server.lib is None:
    pytest.skip("rmqfast.grpcfront._h2 not built (libnghttp2-dev)", allow_module_level=True)

from tests.test_h2server import _start, pb, run  # noqa: E402,F401

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def frame(typ: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([typ, flags]) + struct.pack(">I", sid) + payload


def literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name (lengths under 127)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def request_headers(method: str) -> bytes:
    return (b"\x83\x86"  # :method POST, :scheme http (static table)
            + literal(b":path", f"/apache.rocketmq.v2.MessagingService/{method}".encode())
            + literal(b":authority", b"x") + literal(b"content-type", b"application/grpc")
            + literal(b"te", b"trailers"))


class RawClient:
    """A blocking HTTP/2 client that keeps to the windows the server gives."""

    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.conn_win = 65535
        self.initial = 65535
        self.win: dict[int, int] = {}
        self.closed = False
        self.s.sendall(PREFACE + frame(SETTINGS, 0, 0))
        while not self._settings_seen:
            self.read_frame()

    _settings_seen = False

    def read_frame(self, timeout: float = 30.0) -> tuple[int, int, int, bytes] | None:
        self.s.settimeout(timeout)
        try:
            head = self._exact(9)
        except TimeoutError:
            return None
        if head is None:
            self.closed = True
            return None
        n = int.from_bytes(head[:3], "big")
        typ, flags, sid = head[3], head[4], struct.unpack(">I", head[5:])[0] & 0x7FFFFFFF
        self.s.settimeout(30)
        payload = self._exact(n) or b""
        if typ == SETTINGS and not flags & ACK:
            for i in range(0, len(payload), 6):
                key, val = struct.unpack_from(">HI", payload, i)
                if key == 4:
                    for k in self.win:
                        self.win[k] += val - self.initial
                    self.initial = val
            self.s.sendall(frame(SETTINGS, ACK, 0))
            self._settings_seen = True
        elif typ == WINDOW_UPDATE:
            inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.conn_win += inc
            elif sid in self.win:
                self.win[sid] += inc
        elif typ == GOAWAY:
            self.closed = True
        return typ, flags, sid, payload

    def _exact(self, n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            try:
                got = self.s.recv(n - len(out))
            except ConnectionResetError:
                got = b""
            if not got:
                return None
            out += got
        return out

    def settle(self) -> None:
        """Read until the server has answered a PING (it read all before it) and a moment more."""
        self.s.sendall(frame(PING, 0, 0, b"attack!!"))
        while not self.closed:
            f = self.read_frame()
            if f is None or (f[0] == PING and f[1] & ACK):
                break
        while not self.closed and self.read_frame(0.5) is not None:
            pass

    def send_message(self, sid: int, method: str, msg: bytes, end: bool) -> bool:
        """HEADERS and one gRPC message on a new stream, within the windows; False when the server
        gives no more window (flow control holds the client back)."""
        self.win[sid] = self.initial
        self.s.sendall(frame(HEADERS, END_HEADERS, sid, request_headers(method)))
        data = b"\x00" + struct.pack(">I", len(msg)) + msg
        while data:
            room = min(16384, self.conn_win, self.win[sid])
            if room <= 0:
                self.settle()
                if self.closed or min(self.conn_win, self.win[sid]) <= 0:
                    return False
                continue
            chunk, data = data[:room], data[room:]
            self.conn_win -= len(chunk)
            self.win[sid] -= len(chunk)
            self.s.sendall(frame(DATA, END_STREAM if end and not data else 0, sid, chunk))
        return True


def held(server: Any) -> int:
    """Bytes of request messages the server keeps for calls not handed to a handler yet."""
    total = 0
    for conn in server.conns:
        for call in conn.calls.values():
            total += len(call.msg or b"") + len(call.inbuf or b"")
    return total


def test_calls_never_half_closed_hold_no_more_than_the_connection_window(pb: Any) -> None:  # noqa: F811
    max_body = 1 << 20

    async def go() -> None:
        server, _, port = await _start(pb, max_body=max_body)
        loop = asyncio.get_running_loop()
        window = server.conn_window
        streams = 2 * window // max_body + 8  # what the server would keep if each were given back

        def attack() -> tuple[int, RawClient]:
            c = RawClient(port)
            sent = 0
            for i in range(streams):
                if not c.send_message(2 * i + 1, "SendMessage", b"\x0a" * (max_body - 16), end=False):
                    break
                sent += 1
            c.settle()
            return sent, c  # kept open (and referenced) until measured

        t0 = time.monotonic()
        sent, client = await loop.run_in_executor(None, attack)
        kept = held(server)
        assert kept <= window + 16 * 1024, (kept, window, sent, client.closed)
        client.s.close()
        assert time.monotonic() - t0 < 100
        await server.stop(1.0)

    run(go())


def test_floods_leave_the_server_bounded_and_serving(pb: Any) -> None:  # noqa: F811
    """A CONTINUATION flood, a HEADERS + RST_STREAM flood, a 4 GiB message prefix and a compressed
    message: the server closes or refuses each, keeps no call of them, and serves the next client."""
    import grpc

    from tests.test_h2server import SVC

    async def go() -> None:
        server, _, port = await _start(pb)
        loop = asyncio.get_running_loop()

        def continuation_flood() -> bool:
            c = RawClient(port)
            c.s.sendall(frame(HEADERS, 0, 1, request_headers("Heartbeat")))
            burst = frame(9, 0, 1, b"") * 1000  # CONTINUATION, empty, never END_HEADERS
            try:
                for _ in range(200):
                    c.s.sendall(burst)
            except OSError:
                return True  # the server closed the connection
            c.settle()
            return c.closed

        def reset_flood() -> RawClient:
            c = RawClient(port)
            out = bytearray()
            for i in range(5000):
                sid = 2 * i + 1
                out += frame(HEADERS, END_HEADERS, sid, request_headers("Telemetry"))
                out += frame(RST, 0, sid, struct.pack(">I", 8))
            try:
                c.s.sendall(out)
                c.settle()
            except OSError:
                c.closed = True
            return c

        def odd_messages() -> list[bytes]:
            c = RawClient(port)
            c.s.sendall(frame(HEADERS, END_HEADERS, 1, request_headers("Heartbeat"))
                        + frame(DATA, 0, 1, b"\x00\xff\xff\xff\xff" + b"x" * 100)  # announces 4 GiB
                        + frame(HEADERS, END_HEADERS, 3, request_headers("Heartbeat"))
                        + frame(DATA, END_STREAM, 3, b"\x01\x00\x00\x00\x02\x08\x01"))  # compressed
            trailers = []
            while len(trailers) < 2 and not c.closed:
                f = c.read_frame()
                if f is None:
                    break
                if f[0] == HEADERS and f[1] & END_STREAM:
                    trailers.append(f[3])
            c.s.close()
            return trailers

        assert await loop.run_in_executor(None, continuation_flood)
        flooder = await loop.run_in_executor(None, reset_flood)
        assert sum(len(conn.calls) for conn in server.conns) == 0
        assert len(await loop.run_in_executor(None, odd_messages)) == 2
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            hb = ch.unary_unary(SVC + "Heartbeat", request_serializer=pb.HeartbeatRequest.SerializeToString,
                                response_deserializer=pb.HeartbeatResponse.FromString)
            assert (await hb(pb.HeartbeatRequest())).status.code == pb.Code.OK
        flooder.s.close()
        await server.stop(1.0)

    run(go())


def test_a_nul_in_a_header_value_cannot_add_metadata(pb: Any) -> None:  # noqa: F811
    """The server passes metadata to Python NUL-separated: a value with a NUL must not reach a
    handler as extra keys (an ``authorization`` of its making); nghttp2 refuses such a field."""

    async def go() -> None:
        server, svc, port = await _start(pb)
        loop = asyncio.get_running_loop()

        def call(extra: bytes) -> list[int]:
            c = RawClient(port)
            req = b"\x00\x00\x00\x00\x00"  # an empty HeartbeatRequest
            c.s.sendall(frame(HEADERS, END_HEADERS, 1, request_headers("Heartbeat") + extra)
                        + frame(DATA, END_STREAM, 1, req))
            seen = []
            while not c.closed:
                f = c.read_frame()
                if f is None:
                    break
                seen.append(f[0])
                if (f[0] == HEADERS and f[1] & END_STREAM) or f[0] == RST:
                    break
            c.s.close()
            return seen

        seen = await loop.run_in_executor(None, call, literal(b"x-a", b"v\x00authorization\x00forged"))
        assert "authorization" not in svc.seen.get("md", {}) and RST in seen
        seen = await loop.run_in_executor(None, call, literal(b"x-a", b"v"))
        assert svc.seen["md"].get("x-a") == "v" and HEADERS in seen
        await server.stop(1.0)

    run(go())

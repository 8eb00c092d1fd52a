"""Small stand-ins for upstream servers in unit tests (the real RocketMQ ones: tests/integration).

* :class:`FakeNameServer` answers every Remoting request with a response carrying its opaque
  (``QUERY_NOT_FOUND`` for ``GET_KV_CONFIG``, as a real name server does for an unknown key).
* :class:`NotRemotingServer` accepts TCP connections and answers with an HTTP error page.
* :func:`kv_roundtrip` sends one ``GET_KV_CONFIG`` through a proxy and returns the answer.
"""

from __future__ import annotations

import itertools
import socket
import socketserver
import threading

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode, make_response
from rmqfast.testing.wire import read_frame

_opaques = itertools.count(1000)
QUERY_NOT_FOUND = 22  # ResponseCode.QUERY_NOT_FOUND: what a name server answers for an unknown KV key


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, handler: type[socketserver.BaseRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.requests = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _NameServerHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: _Server = self.server  # type: ignore[assignment]
        while True:
            try:
                data = read_frame(self.request)
            except OSError:
                return
            if data is None:
                return
            cmd = decode_frame(data)
            with srv.lock:
                srv.requests += 1
            code = QUERY_NOT_FOUND if cmd.code == C.GET_KV_CONFIG else C.SUCCESS
            self.request.sendall(encode(make_response(cmd, code, remark="fake name server")))


class _NotRemotingHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: _Server = self.server  # type: ignore[assignment]
        with srv.lock:
            srv.requests += 1
        try:
            self.request.recv(4096)
            self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass


def FakeNameServer() -> _Server:  # noqa: N802 (reads like a class at the call site)
    return _Server(_NameServerHandler)


def NotRemotingServer() -> _Server:  # noqa: N802
    return _Server(_NotRemotingHandler)


def kv_roundtrip(addr: str, timeout: float = 10.0) -> RemotingCommand:
    """One GET_KV_CONFIG request to ``addr`` (host:port); the decoded answer."""
    host, _, port = addr.rpartition(":")
    opaque = next(_opaques)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(encode(RemotingCommand(code=C.GET_KV_CONFIG, opaque=opaque,
                                         ext_fields={"namespace": "ORDER_TOPIC_CONFIG", "key": "T"})))
        data = read_frame(s)
    assert data is not None, f"{addr} closed the connection without answering"
    cmd = decode_frame(data)
    assert cmd.opaque == opaque and cmd.is_response, cmd
    return cmd

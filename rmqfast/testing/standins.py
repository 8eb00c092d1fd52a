"""Small stand-ins for upstream servers, for unit tests and benchmarks (real RocketMQ: cluster.py).

* :func:`FakeNameServer` answers every Remoting request with a response carrying its opaque
  (``QUERY_NOT_FOUND`` for ``GET_KV_CONFIG``, as a real name server does for an unknown key;
  route queries with the ``route`` body it was given, if any).
* :func:`NotRemotingServer` accepts TCP connections and answers with an HTTP error page.

Both serve on a free loopback port from a daemon thread; ``addr`` is their ``host:port``,
``requests`` counts what they were asked, ``close()`` stops them.
"""

from __future__ import annotations

import socketserver
import threading

from rmqfast.codec import codes as C
from rmqfast.codec.command import decode_frame, encode, make_response
from rmqfast.testing.wire import read_frame

QUERY_NOT_FOUND = 22  # ResponseCode.QUERY_NOT_FOUND: what a name server answers for an unknown KV key


class StandInServer(socketserver.ThreadingTCPServer):
    """A threaded TCP server on 127.0.0.1 (a port from the OS), already serving."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, handler: type[socketserver.BaseRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.requests = 0
        self.lock = threading.Lock()
        self.route: bytes | None = None  # FakeNameServer: the body of every route answer
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _NameServerHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: StandInServer = self.server  # type: ignore[assignment]
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
            body = (srv.route if cmd.code == C.GET_ROUTEINFO_BY_TOPIC else None) or b""
            self.request.sendall(encode(make_response(cmd, code, remark="fake name server", body=body)))


class _NotRemotingHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: StandInServer = self.server  # type: ignore[assignment]
        with srv.lock:
            srv.requests += 1
        try:
            self.request.recv(4096)
            self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass


def FakeNameServer(route: bytes | None = None) -> StandInServer:  # noqa: N802 (reads like a class at the call site)
    srv = StandInServer(_NameServerHandler)
    srv.route = route
    return srv


def NotRemotingServer() -> StandInServer:  # noqa: N802
    return StandInServer(_NotRemotingHandler)

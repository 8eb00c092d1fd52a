"""The admin HTTP endpoint: /metrics, /healthz, /readyz, /limits and live limit changes.

It runs in the supervisor's process (threads), so nothing a client sends may take it down or
make it grow: every request is bounded.

* One thread accepts and reads every request head (:mod:`rmqfast.server.admin_heads`): a slow
  or idle client costs no thread, and ``/healthz`` is answered from that thread, so no number
  of slow clients can starve the liveness probe.
* Before anything else is read, ``Host`` must name the endpoint, and a change (POST, PUT,
  DELETE, PATCH) must be ``Content-Type: application/json`` from no foreign ``Origin``
  (:mod:`rmqfast.server.admin_names`; 421 and 403 otherwise).
* One request per connection (HTTP/1.0), at most ``MAX_CONNECTIONS`` handler threads at once
  and at most ``MAX_PER_CLIENT`` connections from one client address other than loopback (more
  get a 503 and are closed); each socket read waits at most ``READ_TIMEOUT`` and a whole
  connection lives at most ``CONNECTION_DEADLINE`` (slowloris: a client dribbling bytes is cut
  off), its head included.
* The request line and headers together are at most ``MAX_HEAD`` bytes (else 431).
* Request bodies (PUT) need a ``Content-Length`` of at most ``MAX_BODY`` bytes (else 411/413,
  read before anything is allocated); JSON nested too deeply is a 400, not a crash.
* Limit changes need ``Authorization: Bearer <admin.token>`` (compared in constant time).
  Without a token they are accepted only when the endpoint's bound address *and* the client's
  address are loopback addresses, both parsed with :mod:`ipaddress` (a host name such as
  ``127.attacker.example`` is not an address, so it is not loopback).
* Every answer is JSON (or the Prometheus text) with a status that says who must act:
  4xx with an ``error`` explaining what to change, 5xx when the proxy could not do it.

The server knows the supervisor only through :class:`AdminBackend`.
"""

from __future__ import annotations

import hmac
import http.client
import io
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs

from rmqfast.config import HostPort
from rmqfast.errors import ConfigError
from rmqfast.limits import rules as limits_rules
from rmqfast.limits.rules import LimitsSection
from rmqfast.log import ctx
from rmqfast.server.admin_heads import Conn, HeadReader
from rmqfast.server.admin_names import OwnNames, pod_ips

log = logging.getLogger("rmqfast.admin")

MAX_BODY = 64 * 1024
MAX_HEAD = 64 * 1024  # request line and headers together
READ_TIMEOUT = 5.0
CONNECTION_DEADLINE = 15.0
MAX_CONNECTIONS = 32  # handler threads (a connection takes one once its head is read)
# connections waiting for their head at once, and their bytes: past either, the one waiting
# longest is closed (rmqfast.server.admin_heads); answered ones lingering before their close.
# The supervisor keeps its open-files limit (often 1024): the endpoint holds at most about
# MAX_PENDING + MAX_ANSWERING + MAX_CONNECTIONS descriptors.
MAX_PENDING = 256
MAX_PENDING_BYTES = 8 << 20
MAX_ANSWERING = 128
# Connections one client address other than loopback may hold at once: slow or idle clients
# from one place cannot take every slot from the probes and scrapes (kubelet, Prometheus) that
# come from elsewhere.  Loopback clients are on the host already and are not counted.
MAX_PER_CLIENT = 8
GET_PATHS = ("/metrics", "/healthz", "/readyz", "/limits")
PROBE_PATHS = ("/healthz",)  # answered from the head reader's thread, never waiting for a handler


class AdminBackend(Protocol):
    """What the endpoint asks the supervisor."""

    def health(self) -> tuple[bool, dict[str, Any]]: ...

    def ready(self) -> tuple[bool, str]: ...

    def ready_detail(self) -> dict[str, Any]: ...

    def metrics_text(self) -> bytes: ...

    def limits_view(self) -> dict[str, Any]: ...

    def admin_token(self) -> str: ...

    def change_limits(self, change: Callable[[LimitsSection], LimitsSection]) -> bool:
        """Apply ``change(current limits)`` in every worker, one change at a time; True once applied."""
        ...


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback IP address (IPv4-mapped IPv6 included); names never are."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


class _HeadBudget:
    """The handler's ``rfile``, with one budget for every line read (request line and headers).

    http.server bounds each header line (64 KiB) and their count (100), which still lets one
    connection hold 6.5 MB; this bounds the whole head.  Bodies (``read``) are bounded apart.
    """

    def __init__(self, raw: Any, budget: int) -> None:
        self.raw = raw
        self.left = budget
        self.request_line = True  # the first line read

    def readline(self, size: int = -1) -> bytes:
        want = self.left + 1 if size < 0 else min(size, self.left + 1)
        line = self.raw.readline(want)
        self.left -= len(line)
        if self.request_line:
            # http.server answers 414 for a request line over 65536 bytes (MAX_HEAD): raising
            # here would close the connection without an answer
            self.request_line = False
            return bytes(line)
        if self.left < 0:
            raise http.client.HTTPException(f"request line and headers over {MAX_HEAD} bytes")
        return bytes(line)

    def read(self, size: int = -1) -> bytes:
        return bytes(self.raw.read(size))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class _Prefixed:
    """A connection's ``rfile`` with the bytes the head reader read already in front."""

    def __init__(self, head: bytes, raw: Any) -> None:
        self.head = head
        self.raw = raw

    def readline(self, size: int = -1) -> bytes:
        if not self.head:
            return bytes(self.raw.readline(size))
        limit = len(self.head) if size < 0 else min(size, len(self.head))
        nl = self.head.find(b"\n", 0, limit)
        if nl >= 0 or limit < len(self.head):
            cut = nl + 1 if nl >= 0 else limit
            line, self.head = self.head[:cut], self.head[cut:]
            return line
        line, self.head = self.head, b""
        return line + bytes(self.raw.readline(-1 if size < 0 else size - len(line)))

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return bytes(self.raw.read(size))
        if 0 <= size <= len(self.head):
            data, self.head = self.head[:size], self.head[size:]
            return data
        data, self.head = self.head, b""
        return data + bytes(self.raw.read(-1 if size < 0 else size - len(data)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def _answer(code: int, body: object) -> bytes:
    """A whole HTTP/1.0 answer with a JSON body, sent by the head reader."""
    data = json.dumps(body, indent=1).encode() + b"\n"
    return (f"HTTP/1.0 {code} {HTTPStatus(code).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # connections the kernel queues before accept (socketserver's default, 5, left a burst of
    # probes unanswered for seconds once it overflowed)
    request_queue_size = 128
    backend: AdminBackend

    def __init__(self, addr: tuple[str, int], backend: AdminBackend, allowed_hosts: Iterable[str] = ()) -> None:
        self.backend = backend
        pods = pod_ips()  # before binding: a bad POD_IP is a clear error, not a half-made server
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.per_client: dict[str, int] = {}  # open connections by client address (not loopback)
        self.per_client_lock = threading.Lock()
        self.heads: dict[Any, tuple[bytes, float]] = {}  # head bytes read, by socket, for its handler
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, _Handler)
        self.pods = pods
        self.names = OwnNames.build(addr[0], int(self.server_address[1]), allowed_hosts, pods)
        self.reader = HeadReader(self.socket, self, idle=READ_TIMEOUT, deadline=CONNECTION_DEADLINE,
                                 max_head=MAX_HEAD, max_pending=MAX_PENDING, max_pending_bytes=MAX_PENDING_BYTES,
                                 max_answering=MAX_ANSWERING)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self.reader.run()

    def shutdown(self) -> None:
        self.reader.stop()

    def process_request(self, request: Any, client_address: Any) -> None:
        """A connection accepted: its head is read by the head reader (no thread yet)."""
        client = self._counted_client(client_address)
        if client is not None and not self._take_client(client):
            self._refuse(request, b"too many admin connections open from this address; retry shortly")
            return
        self.reader.adopt(request, client_address, client)

    def conn_closed(self, conn: Conn) -> None:
        self._give_client(conn.client)

    def head_done(self, conn: Conn, complete: bool) -> bytes | None:
        """The head is read: refuse, answer a probe, or hand the connection to a handler thread."""
        if complete:
            answer = self._check_head(conn)
            if answer is not None:
                return answer
        # a head without its end (over MAX_HEAD) goes on too: the handler answers 414 or 431
        if not self.slots.acquire(blocking=False):
            return _answer(503, {"error": "too many admin connections open; retry shortly"})
        self.heads[conn.sock] = (bytes(conn.buf), conn.since)
        try:
            conn.sock.setblocking(True)
            super().process_request(conn.sock, conn.addr)
        except BaseException:
            self.heads.pop(conn.sock, None)
            self.slots.release()
            raise
        return None

    def _check_head(self, conn: Conn) -> bytes | None:
        """The answer to a head refused by its Host, Origin or Content-Type, or to a probe; None
        when a handler must read it (a head http.server cannot parse gets its 400/431 there)."""
        line, _, rest = bytes(conn.buf).partition(b"\n")
        words = line.decode("iso-8859-1").split()
        if not 2 <= len(words) <= 3:
            return None
        try:
            headers = http.client.parse_headers(io.BytesIO(rest))
        except (http.client.HTTPException, ValueError):
            return None
        method, target = words[0], words[1]
        refusal = self.names.refusal(method, headers, conn.local_ip)
        if refusal is not None:
            code, why = refusal
            log.info("admin request refused", extra=ctx(client=str(conn.addr), method=method[:16], status=code,
                                                        reason=why[:300]))
            return _answer(code, {"error": why})
        if method == "GET" and target.split("?", 1)[0] in PROBE_PATHS:
            alive, body = self.backend.health()
            return _answer(200 if alive else 503, body)
        return None

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()
            self._give_client(self._counted_client(client_address))

    def _refuse(self, request: Any, why: bytes) -> None:
        try:  # answer at once, hold nothing (and never wait long: this is the accept loop)
            request.settimeout(1.0)
            request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b'Connection: close\r\n\r\n{"error": "' + why + b'"}\n')
        except OSError:
            pass
        self.shutdown_request(request)

    @staticmethod
    def _counted_client(client_address: Any) -> str | None:
        """The address MAX_PER_CLIENT counts (None: loopback or unknown, not counted); an IPv6
        client counts by its /64, which one host can rotate through."""
        host = str(client_address[0]) if isinstance(client_address, tuple) and client_address else ""
        if not host or is_loopback(host):
            return None
        try:
            addr = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return host
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is None:
            return str(ipaddress.ip_network(f"{addr}/64", strict=False))
        return str(addr.ipv4_mapped) if isinstance(addr, ipaddress.IPv6Address) else host

    def _take_client(self, client: str) -> bool:
        with self.per_client_lock:
            n = self.per_client.get(client, 0)
            if n >= MAX_PER_CLIENT:
                return False
            self.per_client[client] = n + 1
            return True

    def _give_client(self, client: str | None) -> None:
        if client is None:
            return
        with self.per_client_lock:
            n = self.per_client.get(client, 0) - 1
            if n > 0:
                self.per_client[client] = n
            else:
                self.per_client.pop(client, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that vanished or timed out is not the proxy's error: one debug line
        log.debug("admin connection ended with an error", exc_info=True, extra=ctx(client=str(client_address)))

    @property
    def bound_host(self) -> str:
        return str(self.server_address[0])


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = READ_TIMEOUT  # every socket read (request line, headers, body)
    protocol_version = "HTTP/1.0"  # one request per connection
    # a malformed request line is answered with a status line too (http.server's HTTP/0.9
    # default would send the error body alone)
    default_request_version = "HTTP/1.0"

    def setup(self) -> None:
        head, since = self.server.heads.pop(self.request, (b"", time.monotonic()))
        super().setup()
        self.rfile = _HeadBudget(_Prefixed(head, self.rfile), MAX_HEAD)  # type: ignore[assignment]
        # the whole connection is bounded too: a client sending one byte per READ_TIMEOUT is cut off
        left = CONNECTION_DEADLINE - (time.monotonic() - since)
        self._watchdog = threading.Timer(max(0.0, left), self._cut)
        self._watchdog.daemon = True
        self._watchdog.start()

    def finish(self) -> None:
        try:
            super().finish()
            if getattr(self, "_linger", False):
                self._drain_unread()
        except OSError:
            pass
        finally:
            self._watchdog.cancel()

    def _drain_unread(self) -> None:
        """Close gently after refusing a body: closing with unread data would send a reset that
        can destroy the 413 before the client reads it.  Bounded (1 MiB, 1 s), then closed."""
        self.connection.shutdown(socket.SHUT_WR)
        self.connection.settimeout(1.0)
        deadline = time.monotonic() + 1.0
        left = 1 << 20
        while left > 0 and time.monotonic() < deadline:
            chunk = self.connection.recv(min(left, 65536))
            if not chunk:
                break
            left -= len(chunk)

    def _cut(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    @property
    def backend(self) -> AdminBackend:
        return self.server.backend

    # GET --------------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        b = self.backend
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST

            try:
                body = b.metrics_text()
            except Exception as exc:  # a scrape must get an answer, not a dropped connection
                log.exception("cannot collect metrics")
                self._send(500, f"cannot collect metrics: {exc}\n".encode(), "text/plain")
                return
            self._send(200, body, CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            alive, body = b.health()
            self._json(200 if alive else 503, body)
        elif path == "/readyz":
            ok, why = b.ready()
            self._json(200 if ok else 503, {"ready": ok, "reason": why, **b.ready_detail()})
        elif path == "/limits":
            self._json(200, b.limits_view())
        elif path == "/gray":  # gray (canary) releases (rmqfast.gray.admin)
            from rmqfast.gray.admin import admin_gray

            self._json(*admin_gray(self, "GET", path, self.path.partition("?")[2]))
        else:
            self._json(404, {"error": f"GET {path}: unknown path; try {', '.join(GET_PATHS)}"})

    # Changes ----------------------------------------------------------------------------------

    def do_PUT(self) -> None:  # noqa: N802
        self._change("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._change("DELETE")

    def do_POST(self) -> None:  # noqa: N802
        path, _, query = self.path.partition("?")
        if path == "/delay/cancel":  # cancel held delayed messages (rmqfast.delay.cancel)
            from rmqfast.delay.cancel import admin_cancel

            self._json(*admin_cancel(self, query))
            return
        if path.startswith("/gray/"):  # promote / abort / reset a gray release (rmqfast.gray.admin)
            from rmqfast.gray.admin import admin_gray

            self._json(*admin_gray(self, "POST", path, query))
            return
        self._not_allowed("POST")

    def do_PATCH(self) -> None:  # noqa: N802
        self._not_allowed("PATCH")

    def do_HEAD(self) -> None:  # noqa: N802
        self._not_allowed("HEAD")

    def _not_allowed(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        allow = "PUT, DELETE" if path == "/limits/rule" else "GET"
        self._json(405, {"error": f"{method} is not supported on {path}; use {allow}"}, {"Allow": allow})

    def _change(self, method: str) -> None:
        path, _, query = self.path.partition("?")
        if path != "/limits/rule":
            self._json(404, {"error": f"{method} {path}: unknown path; use {method} /limits/rule"})
            return
        refusal = self.write_refusal()
        if refusal is not None:
            self._json(*refusal)
            return
        if method == "PUT":
            body = self._read_json()
            if body is _NO_BODY:
                return

            def change(cur: LimitsSection) -> LimitsSection:
                return limits_rules.upsert(cur, limits_rules.parse_rule("rule", body))
        else:
            q = parse_qs(query)
            topic, tag = q.get("topic", [""])[0], q.get("tag", [None])[0]
            if not topic:
                self._json(400, {"error": "DELETE /limits/rule needs ?topic=NAME[&tag=TAG]"})
                return

            def change(cur: LimitsSection) -> LimitsSection:
                return limits_rules.remove(cur, topic, tag)
        try:
            applied = self.backend.change_limits(change)
        except (ConfigError, ValueError, TypeError) as exc:
            self._json(400, {"error": str(exc)})
            return
        except RecursionError:
            self._json(400, {"error": "the rule is nested too deeply; send a flat JSON object"})
            return
        if not applied:
            self._json(503, {"error": "the supervisor did not apply the change within 5 s; retry"})
            return
        self._json(200, self.backend.limits_view())

    def write_refusal(self) -> tuple[int, dict[str, str]] | None:
        """Why a limit change is refused (status, body), or None when allowed."""
        token = self.backend.admin_token()
        if token:
            given = self.headers.get("Authorization", "")
            expected = f"Bearer {token}"
            if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                       expected.encode("utf-8", "surrogateescape")):
                return 401, {"error": "limit changes need the header 'Authorization: Bearer <admin.token>'"}
            return None
        if not is_loopback(self.server.bound_host):
            return 403, {"error": "the admin endpoint listens beyond loopback and admin.token is not set: limit "
                                  "changes over HTTP are refused; set admin.token (then send it as a Bearer token)"}
        if not is_loopback(str(self.client_address[0])):
            return 403, {"error": f"limit changes without admin.token are accepted from loopback clients only, "
                                  f"not from {self.client_address[0]}"}
        return None

    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            self._json(411, {"error": "send the body with a Content-Length (chunked bodies are not accepted)"})
            return _NO_BODY
        raw = self.headers.get("Content-Length")
        if raw is None:
            self._json(411, {"error": "PUT /limits/rule needs a Content-Length and a JSON object body"})
            return _NO_BODY
        try:
            length = int(raw)
            if length < 0:
                raise ValueError
        except ValueError:
            self._json(400, {"error": f"Content-Length: {raw!r} is not a byte count"})
            return _NO_BODY
        if length > MAX_BODY:
            self._json(413, {"error": f"body of {length} bytes is over the limit of {MAX_BODY} bytes; "
                                      "a limit rule is a small JSON object"})
            self._linger = True
            return _NO_BODY
        data = self.rfile.read(length)
        if len(data) != length:
            self._json(400, {"error": f"body ended after {len(data)} of {length} bytes"})
            return _NO_BODY
        try:
            return json.loads(data or b"null")
        except RecursionError:
            self._json(400, {"error": "JSON nested too deeply; a limit rule is a flat JSON object"})
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            self._json(400, {"error": f"the body is not valid JSON: {exc}"})
        return _NO_BODY

    # Output -----------------------------------------------------------------------------------

    def _json(self, code: int, body: object, headers: dict[str, str] | None = None) -> None:
        self._send(code, json.dumps(body, indent=1).encode() + b"\n", "application/json", headers)

    def _send(self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own errors (bad request line, 431 headers too long...): JSON like the rest
        if code in (414, 431):
            self._linger = True  # the rest of the head is unread: close gently (see _drain_unread)
        try:
            text = message or self.responses.get(code, ("error",))[0]
            self._json(code, {"error": f"{text}: {explain}" if explain else text})
        except OSError:
            pass

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


_NO_BODY = object()


def _import_prometheus() -> None:
    """Import prometheus_client completely, in the thread that starts the endpoint.

    The scrape path imports it lazily (the supervisor sets PROMETHEUS_MULTIPROC_DIR first).  Left
    to the first scrapes, several handler threads import it at once under a flood, and a thread
    can see the package half-initialised: ``ImportError: cannot import name 'Counter' from
    partially initialized module`` became ``/metrics`` 500s (issue 30, hostile run of 22:00).
    """
    import prometheus_client  # noqa: F401
    import prometheus_client.multiprocess  # noqa: F401


class AdminServer:
    """The endpoint on ``listen``; ``start()`` serves it from a daemon thread."""

    def __init__(self, listen: HostPort, backend: AdminBackend, allowed_hosts: Iterable[str] = ()) -> None:
        try:
            self.httpd = _Server((listen.host, listen.port), backend, allowed_hosts)
        except OSError as exc:
            raise ConfigError(f"admin.listen: cannot listen on {listen} ({exc.strerror or exc})") from None
        self.listen = listen

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def set_allowed_hosts(self, allowed_hosts: Iterable[str]) -> None:
        """Names of ``admin.allowed_hosts`` (on reload): in force for the next request head."""
        h = self.httpd
        h.names = OwnNames.build(self.listen.host, self.port, allowed_hosts, h.pods)

    def start(self) -> None:
        _import_prometheus()  # before any handler thread can race to import it
        threading.Thread(target=self.httpd.serve_forever, name="admin-http", daemon=True).start()
        log.info("admin endpoint listening", extra=ctx(admin=str(self.listen)))

    def shutdown(self) -> None:
        """Stop serving and close the listening socket."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def server_close(self) -> None:
        self.httpd.server_close()

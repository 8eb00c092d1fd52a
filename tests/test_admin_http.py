"""The admin HTTP endpoint over real HTTP: bounded input, real loopback check, token, serialized changes.

Most tests run :class:`rmqfast.server.admin.AdminServer` in-process over a small backend (so
limits and addresses can be chosen); the concurrency and readiness tests use a real
supervisor (``rmqfast serve`` or :class:`Supervisor` with a stand-in worker).
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fake_remoting import FakeNameServer, NotRemotingServer

from rmqfast import config as config_mod
from rmqfast.config import HostPort
from rmqfast.limits.rules import LimitsSection
from rmqfast.server import admin as admin_mod
from rmqfast.server.admin import AdminServer, is_loopback
from rmqfast.server.probe import probe_remoting
from rmqfast.testing.proxy import ProxyProcess


class Backend:
    """A stand-in supervisor: limits held in memory, changes applied at once."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self.limits = LimitsSection()
        self.changes = 0

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {"status": "ok"}

    def ready(self) -> tuple[bool, str]:
        return True, "ok"

    def ready_detail(self) -> dict[str, Any]:
        return {}

    def metrics_text(self) -> bytes:
        return b"# nothing\n"

    def limits_view(self) -> dict[str, Any]:
        return {"rules": [{"topic": r.topic, "rate": r.rate} for r in self.limits.rules]}

    def admin_token(self) -> str:
        return self.token

    def change_limits(self, change: Callable[[LimitsSection], LimitsSection]) -> bool:
        self.limits = change(self.limits)
        self.changes += 1
        return True


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[AdminServer, Backend]]]:
    servers: list[AdminServer] = []

    def start(host: str = "127.0.0.1", token: str = "") -> tuple[AdminServer, Backend]:
        backend = Backend(token)
        srv = AdminServer(HostPort(host, 0), backend)
        srv.start()
        servers.append(srv)
        return srv, backend

    yield start
    for srv in servers:
        srv.shutdown()


def request(port: int, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = 10) -> tuple[int, dict[str, Any]]:
    """One request as the project's clients send it: Host 127.0.0.1:port (http.client's), and
    changes as ``Content-Type: application/json`` (unless ``headers`` says otherwise)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = dict(headers or {})
    if method in ("POST", "PUT", "DELETE", "PATCH"):
        sent.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=body, headers=sent)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    return r.status, (json.loads(data) if data.startswith((b"{", b"[")) else {"text": data.decode()})


RULE = json.dumps({"topic": "T", "rate": 10}).encode()


def test_put_rule_and_clear_errors(serve) -> None:
    srv, backend = serve()
    code, body = request(srv.port, "PUT", "/limits/rule", RULE)
    assert code == 200 and body["rules"] == [{"topic": "T", "rate": 10}]
    code, body = request(srv.port, "PUT", "/limits/rule", b'{"topic": "T", "rate": "fast"}')
    assert code == 400 and "rate" in body["error"]
    code, body = request(srv.port, "PUT", "/limits/rule", b"{nope")
    assert code == 400 and body["error"].startswith("the body is not valid JSON")
    code, body = request(srv.port, "PUT", "/limits/rule", b'\xff\xfe{"x": 1}')
    assert code == 400 and "not valid JSON" in body["error"]
    code, body = request(srv.port, "DELETE", "/limits/rule")
    assert code == 400 and "?topic=NAME" in body["error"]
    code, body = request(srv.port, "POST", "/limits/rule", RULE)
    assert code == 405 and "use PUT, DELETE" in body["error"]
    code, body = request(srv.port, "GET", "/nope")
    assert code == 404 and "/metrics, /healthz, /readyz, /limits" in body["error"]
    code, body = request(srv.port, "PUT", "/limits", RULE)
    assert code == 404 and "use PUT /limits/rule" in body["error"]
    assert backend.changes == 1


def test_body_over_the_limit_is_refused_before_it_is_read(serve) -> None:
    srv, backend = serve()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        # announces 200 MB and sends none of it: the answer comes at once, nothing is allocated
        s.sendall(f"PUT /limits/rule HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
                  "Content-Length: 200000000\r\n\r\n".encode())
        head = b""
        while chunk := s.recv(65536):
            head += chunk
    assert head.startswith(b"HTTP/1.0 413 "), head
    assert b"over the limit of 65536 bytes" in head
    code, body = request(srv.port, "PUT", "/limits/rule", b" " * (admin_mod.MAX_BODY + 1))
    assert code == 413
    # just under the limit is read (and is valid JSON padded with spaces)
    padded = RULE + b" " * (admin_mod.MAX_BODY - len(RULE))
    assert request(srv.port, "PUT", "/limits/rule", padded)[0] == 200
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(f"PUT /limits/rule HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n"
                  "Content-Type: application/json\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 411 ") and b"needs a Content-Length" in answer, answer
    code, body = request(srv.port, "PUT", "/limits/rule", None, {"Content-Length": "-5"})
    assert code == 400
    assert backend.changes == 1


def test_deeply_nested_json_is_a_400_not_a_crash(serve) -> None:
    srv, backend = serve()
    deep = b"[" * 30000 + b"]" * 30000
    code, body = request(srv.port, "PUT", "/limits/rule", deep)
    assert code == 400 and "nested too deeply" in body["error"]
    deep_obj = b'{"a":' * 10000 + b"1" + b"}" * 10000
    assert request(srv.port, "PUT", "/limits/rule", deep_obj)[0] == 400
    assert request(srv.port, "GET", "/healthz")[0] == 200
    assert backend.changes == 0


def test_slow_clients_are_cut_off(serve, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin_mod._Handler, "timeout", 0.5)
    monkeypatch.setattr(admin_mod, "READ_TIMEOUT", 0.5)  # the head reader's idle time
    monkeypatch.setattr(admin_mod, "CONNECTION_DEADLINE", 2.0)
    srv, _ = serve()
    # silent after a partial request line: cut at the read timeout
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"GET /hea")
        t0 = time.monotonic()
        assert s.recv(1024) == b""
        assert time.monotonic() - t0 < 10
    # one byte at a time, each within the read timeout: cut at the connection deadline
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        t0 = time.monotonic()
        closed = False
        for byte in (b"PUT /limits/rule HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 1000):
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            s.settimeout(0.2)
            try:
                if s.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:  # closed while a byte was on its way
                closed = True
                break
        assert closed, "a dribbling client kept its connection past the deadline"
        assert 1.5 < time.monotonic() - t0 < 15
    assert request(srv.port, "GET", "/healthz")[0] == 200


def test_connection_count_is_bounded(serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """Handler threads are bounded: connections whose head is read and whose body never comes hold
    them; past MAX_CONNECTIONS a request gets a 503 at once (/healthz needs no handler:
    tests/test_admin_slow.py)."""
    monkeypatch.setattr(admin_mod, "MAX_CONNECTIONS", 4)
    srv, _ = serve()
    head = (f"PUT /limits/rule HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 10\r\n\r\n").encode()
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(4)]
    try:
        for s in idle:
            s.sendall(head)
        deadline = time.monotonic() + 60
        while True:  # the four reach their handlers (each holds a slot) before or soon after this one
            code, body = request(srv.port, "GET", "/limits")
            if code == 503 or time.monotonic() > deadline:
                break
        assert code == 503 and "too many admin connections" in body["error"]
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 60
    while request(srv.port, "GET", "/limits")[0] != 200:  # slots come back as the idle ones close
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("127.attacker.example", False), ("localhost", False), ("127.0.0.1.nip.io", False),
    ("10.0.0.1", False), ("0.0.0.0", False), ("::", False), ("", False), ("::ffff:10.0.0.1", False),
])
def test_is_loopback_parses_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_changes_without_token_need_a_loopback_bind(serve) -> None:
    srv, backend = serve(host="0.0.0.0")
    code, body = request(srv.port, "PUT", "/limits/rule", RULE)
    assert code == 403 and "set admin.token" in body["error"]
    assert request(srv.port, "GET", "/limits")[0] == 200  # reading stays open
    assert backend.changes == 0


def test_token_is_required_when_set(serve) -> None:
    srv, backend = serve(host="0.0.0.0", token="s3cret")
    for auth in ({}, {"Authorization": "Bearer s3cre"}, {"Authorization": "Bearer s3cret!"},
                 {"Authorization": "bearer s3cret"}, {"Authorization": "Bearer s3crét"}):
        code, body = request(srv.port, "PUT", "/limits/rule", RULE, auth)
        assert code == 401 and "Authorization: Bearer" in body["error"], auth
    assert request(srv.port, "PUT", "/limits/rule", RULE, {"Authorization": "Bearer s3cret"})[0] == 200
    assert backend.changes == 1


# A real supervisor --------------------------------------------------------------------------


def test_concurrent_limit_changes_are_all_applied() -> None:
    """Twelve PUTs at once on a real ``rmqfast serve``: every rule ends up in force."""
    ns = FakeNameServer()
    try:
        with ProxyProcess([ns.addr], workers=2) as proxy:
            def put(i: int) -> int:
                return request(proxy.admin_port, "PUT", "/limits/rule",
                               json.dumps({"topic": f"T{i}", "rate": 100 + i}).encode())[0]

            with ThreadPoolExecutor(12) as pool:
                assert list(pool.map(put, range(12))) == [200] * 12
            code, body = request(proxy.admin_port, "GET", "/limits")
            assert sorted(r["topic"] for r in body["rules"]) == sorted(f"T{i}" for i in range(12))
            # and the supervisor is unharmed by the hostile bodies above
            deep = b"[" * 60000 + b"]" * 5000
            assert request(proxy.admin_port, "PUT", "/limits/rule", deep)[0] == 400
            assert proxy.proc is not None and proxy.proc.poll() is None
            assert request(proxy.admin_port, "GET", "/readyz")[0] == 200
    finally:
        ns.close()


class _ReadyProc:
    pid = 4242

    def poll(self) -> int | None:
        return None


@pytest.fixture
def supervisor_for() -> Iterator[Callable[[str], Any]]:
    """A real Supervisor (admin endpoint on a free port, one stand-in worker that said ready)."""
    from rmqfast.server.supervisor import Supervisor, WorkerProc

    made: list[Any] = []

    def make(upstream: str) -> Any:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = config_mod.from_dict({"namesrv": {"upstreams": [upstream]}, "admin": {"listen": f"127.0.0.1:{port}"}})
        sup = Supervisor(cfg, lambda: cfg)
        sup._start_admin()
        sup.state.workers[0] = WorkerProc(0, _ReadyProc(), -1, 0.0, ready=True)  # type: ignore[arg-type]
        sup.admin_port = port
        made.append(sup)
        return sup

    yield make
    for sup in made:
        sup.admin.shutdown()
        shutil.rmtree(sup.runtime, ignore_errors=True)


def test_readyz_needs_an_upstream_that_speaks_remoting(supervisor_for) -> None:
    bad = NotRemotingServer()
    good = FakeNameServer()
    try:
        # TCP connects fine, but the answer is HTTP: not ready
        sup = supervisor_for(bad.addr)
        code, body = request(sup.admin_port, "GET", "/readyz")
        assert code == 503 and body["ready"] is False
        assert "no name server answers Remoting" in body["reason"] and "not a Remoting frame" in body["reason"]
        assert bad.requests >= 1
        assert body["upstreams"][bad.addr].startswith("failed: not a Remoting frame")
        # a Remoting server: ready, one round trip
        sup = supervisor_for(good.addr)
        code, body = request(sup.admin_port, "GET", "/readyz")
        assert code == 200 and body["ready"] is True, body
        assert body["upstreams"][good.addr].startswith("ok: Remoting response code 22")
        # answers are cached: many probes of /readyz, at most one round trip per cache period
        before = good.requests
        for _ in range(10):
            assert request(sup.admin_port, "GET", "/readyz")[0] == 200
        assert good.requests - before <= 1
    finally:
        bad.close()
        good.close()


def test_probe_of_silent_refusing_and_remoting_servers() -> None:
    with socket.socket() as silent:  # accepts (backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        t0 = time.monotonic()
        r = probe_remoting("127.0.0.1", silent.getsockname()[1], timeout=0.5)
        assert not r.ok and ("timed out" in r.detail or "within the probe timeout" in r.detail), r
        assert time.monotonic() - t0 < 3
        port = silent.getsockname()[1]
    r = probe_remoting("127.0.0.1", port, timeout=0.5)
    assert not r.ok and "refused" in r.detail.lower(), r
    good = FakeNameServer()
    try:
        host, _, p = good.addr.rpartition(":")
        r = probe_remoting(host, int(p))
        assert r.ok and "code 22" in r.detail
    finally:
        good.close()


def test_probe_refuses_a_request_frame_and_a_wrong_opaque() -> None:
    from rmqfast.codec.command import RemotingCommand, encode

    def one(answer: Callable[[bytes], bytes]) -> str:
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen()

            def serve() -> None:
                c, _ = srv.accept()
                with c:
                    c.sendall(answer(c.recv(65536)))
                    c.recv(1)

            t = threading.Thread(target=serve, daemon=True)
            t.start()
            r = probe_remoting("127.0.0.1", srv.getsockname()[1], timeout=5)
            t.join(10)
        assert not r.ok
        return r.detail

    assert "is a request" in one(lambda _: encode(RemotingCommand(code=10, opaque=1)))
    assert "opaque" in one(lambda _: encode(RemotingCommand(code=0, opaque=0, flag=1)))


def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read the whole answer."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server may answer and close while we still send
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer


def test_overlong_request_line_and_garbage_get_an_answer_with_a_status(serve) -> None:
    srv, _ = serve()
    answer = _raw(srv.port, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 414 "), answer[:200]
    answer = _raw(srv.port, b"GARBAGE\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 400 ") and b"Bad request syntax" in answer, answer[:200]
    assert request(srv.port, "GET", "/healthz")[0] == 200


def test_a_burst_of_connections_waits_in_the_listen_queue(serve) -> None:
    srv, _ = serve()
    assert srv.httpd.request_queue_size >= 128
    # 100 clients at once, more than MAX_CONNECTIONS and fewer than the queue: each gets an
    # answer (200, or 503 at once); with socketserver's backlog of 5, 200 clients were left
    # unanswered for tens of seconds in an attacker's run
    with ThreadPoolExecutor(100) as pool:
        codes = list(pool.map(lambda _: request(srv.port, "GET", "/healthz", timeout=60)[0], range(100)))
    assert set(codes) <= {200, 503} and 200 in codes, codes


def test_request_head_is_bounded(serve) -> None:
    srv, _ = serve()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        answer = b""
        try:
            for i in range(50):  # 50 headers of 8 KiB: each allowed by http.server, 400 KiB together
                s.sendall(f"X-Pad-{i}: ".encode() + b"a" * 8192 + b"\r\n")
            s.sendall(b"\r\n")
        except OSError:
            pass  # the server may close while we still send
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer.startswith(b"HTTP/1.0 431 ") and b"over 65536 bytes" in answer, answer[:300]
    assert request(srv.port, "GET", "/healthz")[0] == 200
    # a normal head with a few headers still works
    assert request(srv.port, "GET", "/healthz", headers={"X-A": "b" * 4000, "X-B": "c" * 4000})[0] == 200


def _cancel_backend(tmp_path: Any, delay_topics: list[str]) -> Backend:
    backend = Backend()
    cfg = config_mod.Config()
    cfg.proxy.state_dir = str(tmp_path)
    cfg.proxy.workers = 2
    cfg.delay.topics = delay_topics
    backend.cfg = cfg  # type: ignore[attr-defined]  # what admin_cancel reads
    return backend


def test_cancel_without_delay_is_refused_at_once_and_writes_nothing(serve, tmp_path) -> None:
    srv, _ = serve()
    srv.httpd.backend = _cancel_backend(tmp_path, [])
    t0 = time.monotonic()
    code, body = request(srv.port, "POST", "/delay/cancel?msg_id=abc", b"")
    assert code == 409 and "[delay] is not enabled" in body["error"], body
    assert time.monotonic() - t0 < 5  # no 10 s wait for workers that never read requests
    assert not list(tmp_path.rglob("*"))  # no request file left behind
    code, body = request(srv.port, "POST", "/delay/cancel?msg_id=" + "a" * 2000, b"")
    assert code == 400 and "at most 1024 bytes" in body["error"]


def test_cancels_waiting_at_once_are_bounded(serve, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cancel waits for every worker's answer; no more than MAX_CANCELS_AT_ONCE wait at once,
    so they cannot hold every admin connection (the others get a 503 at once)."""
    from rmqfast.delay import cancel as cancel_mod

    monkeypatch.setattr(cancel_mod, "CANCEL_WAIT", 30.0)
    srv, _ = serve()
    srv.httpd.backend = _cancel_backend(tmp_path, ["Delayed"])  # no worker runs: nobody answers
    n = cancel_mod.MAX_CANCELS_AT_ONCE
    with ThreadPoolExecutor(n) as pool:
        waiting = [pool.submit(request, srv.port, "POST", f"/delay/cancel?msg_id=m{i}", b"", None, 60)
                   for i in range(n)]
        requests_dir = tmp_path / "delay" / "cancel"
        deadline = time.monotonic() + 30
        while len(list(requests_dir.glob("*.req"))) < n:  # all of them are waiting now
            assert time.monotonic() < deadline, "the cancels did not start waiting"
            time.sleep(0.02)
        code, body = request(srv.port, "POST", "/delay/cancel?msg_id=one-more", b"")
        assert code == 503 and "already waiting" in body["error"], body
        assert request(srv.port, "GET", "/healthz")[0] == 200
        for f in requests_dir.glob("*.req"):  # answer them as the workers would: they end now
            rid = f.name[:-4]
            for w in range(2):
                (requests_dir / f"{rid}.w{w}.json").write_text(json.dumps({"worker": w, "cancelled": []}))
        assert [fut.result()[0] for fut in waiting] == [200] * n


def test_one_client_address_cannot_take_every_slot(serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle connections from one address other than loopback hold at most MAX_PER_CLIENT slots:
    the next from it gets a 503 at once, and a probe from elsewhere is still answered."""
    monkeypatch.setattr(admin_mod._Handler, "timeout", 120)  # the idle ones stay while the test looks
    monkeypatch.setattr(admin_mod, "CONNECTION_DEADLINE", 120)
    srv, _ = serve()
    httpd = srv.httpd
    pairs = [socket.socketpair() for _ in range(admin_mod.MAX_PER_CLIENT + 1)]
    try:
        for ours, _theirs in pairs:  # as if accepted from 10.1.2.3, each sending nothing yet
            httpd.process_request(ours, ("10.1.2.3", 40000))
        refused = pairs[-1][1]
        refused.settimeout(10)
        answer = b""
        while chunk := refused.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.0 503 ") and b"from this address" in answer, answer
        assert httpd.per_client == {"10.1.2.3": admin_mod.MAX_PER_CLIENT}
        assert request(srv.port, "GET", "/healthz")[0] == 200  # loopback, not counted
    finally:
        for _ours, theirs in pairs:
            theirs.close()
    deadline = time.monotonic() + 60
    while httpd.per_client:  # every slot comes back as those connections end
        assert time.monotonic() < deadline, httpd.per_client
        time.sleep(0.02)
    # an IPv6 client counts by its /64 (one host holds many addresses); IPv4-mapped as IPv4
    counted = admin_mod._Server._counted_client
    assert counted(("2001:db8:1:2::5", 1)) == counted(("2001:db8:1:2:ffff::9", 1)) == "2001:db8:1:2::/64"
    assert counted(("::ffff:10.1.2.3", 1)) == counted(("10.1.2.3", 1)) == "10.1.2.3"
    assert counted(("127.0.0.1", 1)) is None and counted(("::1", 1)) is None


def test_prometheus_client_is_imported_before_the_first_scrape() -> None:
    """Issue 30, hostile run of 22:00: the first scrapes of an admin flood imported
    prometheus_client lazily from several handler threads at once, and some saw it half
    initialised (``ImportError: cannot import name 'Counter' from partially initialized module``):
    /metrics answered 500.  The endpoint imports it in the thread that starts it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from rmqfast.config import HostPort\n"
        "from rmqfast.server.admin import AdminServer\n"
        "assert 'prometheus_client' not in sys.modules, 'imported before: the test proves nothing'\n"
        "srv = AdminServer(HostPort('127.0.0.1', 0), object())\n"
        "srv.start()\n"
        "srv.shutdown()\n"
        "assert 'prometheus_client.multiprocess' in sys.modules, 'not imported at start'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

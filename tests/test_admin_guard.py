"""The admin endpoint is drivable only by its own origin (issue 30, finding 3).

With no token on a loopback admin listener, a web page could abort a gray release with a
cross-site ``POST`` (``Content-Type: text/plain``, a foreign ``Origin``), cancel delayed messages,
and, by DNS rebinding (``Host: evil.example``), change limits.  Now ``Host`` must name the
endpoint (else 421, before anything else is read) and a change must be
``application/json`` from no foreign ``Origin`` (else 403): :mod:`rmqfast.server.admin_names`.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

import pytest
from test_admin_http import RULE, Backend, request, serve  # noqa: F401  (serve: the fixture)

from rmqfast import config as config_mod
from rmqfast.config import HostPort
from rmqfast.errors import ConfigError
from rmqfast.server.admin import AdminServer
from rmqfast.server.admin_names import OwnNames, split_host


def raw(port: int, head: str, body: bytes = b"", to: str = "127.0.0.1") -> tuple[int, dict[str, Any]]:
    """Send ``head`` (CRLF added) and ``body`` on a fresh connection to ``to``: (status, JSON body)."""
    with socket.create_connection((to, port), timeout=30) as s:
        try:
            s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        except OSError:
            pass  # answered and closed while we still sent
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.partition(b"\r\n\r\n")[2] or b"{}")


def test_the_attacks_of_the_finding_are_refused(serve, tmp_path) -> None:  # noqa: F811
    srv, backend = serve()
    cfg = config_mod.Config()
    cfg.proxy.state_dir = str(tmp_path)
    backend.cfg = cfg  # type: ignore[attr-defined]  # what /gray and /delay/cancel read
    own = f"127.0.0.1:{srv.port}"
    # a cross-site form: text/plain, foreign Origin
    for path in ("/gray/abort?group=G", "/delay/cancel?msg_id=m1"):
        code, body = raw(srv.port, f"POST {path} HTTP/1.1\nHost: {own}\nOrigin: http://evil.example\n"
                                   f"Content-Type: text/plain\nContent-Length: 3\n", b"x=1")
        assert code == 403 and "Origin 'http://evil.example'" in body["error"], (path, code, body)
    # DNS rebinding: the page's own name in Host
    code, body = raw(srv.port, f"PUT /limits/rule HTTP/1.1\nHost: evil.example:{srv.port}\n"
                               f"Content-Type: application/json\nContent-Length: {len(RULE)}\n", RULE)
    assert code == 421 and "'evil.example:" in body["error"] and "admin.allowed_hosts" in body["error"], body
    assert backend.changes == 0 and not list(tmp_path.rglob("*"))  # nothing changed, no request written


def test_a_foreign_host_is_refused_before_anything_else_is_read(serve) -> None:  # noqa: F811
    srv, backend = serve()
    p = srv.port
    for host in (f"evil.example:{p}", f"127.0.0.1.nip.io:{p}", f"127.0.0.1:{p + 1 if p < 65535 else 1}",
                 "127.0.0.1", f"localhost.evil.example:{p}", f"user@127.0.0.1:{p}", f"127.0.0.1:{p}/x",
                 f"::1:{p}", "", f"127.0.0.1:{p}, evil.example"):
        for method, path in (("GET", "/healthz"), ("GET", "/metrics"), ("PUT", "/limits/rule")):
            # a body of 200 MB announced and never sent: the answer comes at once all the same
            code, body = raw(p, f"{method} {path} HTTP/1.1\nHost: {host}\nContent-Type: application/json\n"
                                "Content-Length: 200000000\n")
            assert code == 421 and "is not a name of this admin endpoint" in body["error"], (host, method, body)
    code, body = raw(p, "GET /healthz HTTP/1.0\n")  # no Host at all
    assert code == 421 and "no Host header" in body["error"], body
    code, body = raw(p, f"GET /healthz HTTP/1.1\nHost: 127.0.0.1:{p}\nHost: evil.example\n")
    assert code == 421 and "2 Host headers" in body["error"], body
    assert backend.changes == 0


def test_own_names_are_accepted(serve) -> None:  # noqa: F811
    srv, backend = serve()
    p = srv.port
    for host in (f"127.0.0.1:{p}", f"localhost:{p}", f"LocalHost.:{p}", f"[::1]:{p}"):
        assert raw(p, f"GET /healthz HTTP/1.1\nHost: {host}\n")[0] == 200, host
    # http.client and urllib (every client of the project) send Host 127.0.0.1:port
    assert request(p, "GET", "/limits")[0] == 200


def test_a_wildcard_listener_accepts_the_address_a_connection_arrived_at(serve) -> None:  # noqa: F811
    srv, _ = serve(host="0.0.0.0")
    p = srv.port
    # 127.0.0.2 is this machine too (the whole of 127/8 is loopback): as a pod IP would be
    assert raw(p, f"GET /healthz HTTP/1.1\nHost: 127.0.0.2:{p}\n", to="127.0.0.2")[0] == 200
    assert raw(p, f"GET /healthz HTTP/1.1\nHost: 127.0.0.3:{p}\n", to="127.0.0.2")[0] == 421


def test_allowed_hosts_and_the_pod_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_IP", "10.9.8.7")
    srv = AdminServer(HostPort("127.0.0.1", 0), Backend(), ["proxy-1.example.internal", "fwd.example:19400"])
    srv.start()
    try:
        p = srv.port

        def host(h: str) -> int:
            return raw(p, f"GET /healthz HTTP/1.1\nHost: {h}\n")[0]

        assert host("proxy-1.example.internal:9400") == 200  # a configured name: any port
        assert host("PROXY-1.example.internal") == 200
        assert host("fwd.example:19400") == 200  # a configured name:port: that port only
        assert host(f"fwd.example:{p}") == 421
        assert host(f"10.9.8.7:{p}") == 200  # POD_IP, on the endpoint's port
        assert host("10.9.8.7:1") == 421
        assert host(f"proxy-2.example.internal:{p}") == 421
        srv.set_allowed_hosts(["proxy-2.example.internal"])  # a reload
        assert host(f"proxy-2.example.internal:{p}") == 200
        assert host("proxy-1.example.internal:9400") == 421
    finally:
        srv.shutdown()
    monkeypatch.setenv("POD_IP", "not-an-ip")
    with pytest.raises(ConfigError, match="environment POD_IP='not-an-ip'.*status.podIP"):
        AdminServer(HostPort("127.0.0.1", 0), Backend())


def test_a_change_needs_json_and_no_foreign_origin(serve) -> None:  # noqa: F811
    srv, backend = serve()
    p = srv.port
    refused = [
        ({"Content-Type": "text/plain"}, "'Content-Type: application/json' (got text/plain)"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, "got application/x-www-form-urlencoded"),
        ({"Content-Type": "multipart/form-data; boundary=x"}, "got multipart/form-data"),
        ({"Content-Type": ""}, "Content-Type: application/json"),
        ({"Content-Type": "application/jsonx"}, "got application/jsonx"),
        ({"Origin": "http://evil.example"}, "Origin 'http://evil.example'"),
        ({"Origin": "null"}, "Origin 'null'"),
        ({"Origin": f"http://127.0.0.1:{p}.evil.example"}, "refused"),
        ({"Origin": f"http://evil.example:{p}"}, "refused"),
        ({"Origin": f"file://127.0.0.1:{p}"}, "refused"),
    ]
    for headers, why in refused:
        for method, path in (("PUT", "/limits/rule"), ("DELETE", "/limits/rule?topic=T"),
                             ("POST", "/gray/abort?group=G"), ("POST", "/delay/cancel?msg_id=m"),
                             ("PATCH", "/limits/rule")):
            code, body = request(p, method, path, RULE if method == "PUT" else b"", headers)
            assert code == 403 and why in body["error"], (headers, method, code, body)
    code, body = raw(p, f"DELETE /limits/rule?topic=T HTTP/1.1\nHost: 127.0.0.1:{p}\n")  # no Content-Type
    assert code == 403 and "(got none)" in body["error"], body
    assert backend.changes == 0
    # the same change with its own origin, or none, and JSON goes through
    for headers in ({}, {"Origin": f"http://127.0.0.1:{p}"}, {"Origin": f"http://localhost:{p}"},
                    {"Content-Type": "Application/JSON; charset=utf-8"}):
        assert request(p, "PUT", "/limits/rule", RULE, headers)[0] == 200, headers
    assert backend.changes == 4
    # reading is no change: a foreign Origin may GET (a browser cannot read the answer anyway)
    assert request(p, "GET", "/limits", headers={"Origin": "http://evil.example"})[0] == 200


def test_the_token_is_still_asked_after_the_origin_checks(serve) -> None:  # noqa: F811
    srv, backend = serve(host="0.0.0.0", token="s3cret")
    code, body = request(srv.port, "PUT", "/limits/rule", RULE)
    assert code == 401
    code, body = request(srv.port, "PUT", "/limits/rule", RULE,
                         {"Authorization": "Bearer s3cret", "Content-Type": "text/plain"})
    assert code == 403  # a good token does not make a form post acceptable
    assert request(srv.port, "PUT", "/limits/rule", RULE, {"Authorization": "Bearer s3cret"})[0] == 200
    assert backend.changes == 1


def test_the_project_clients_pass_the_checks(serve, tmp_path) -> None:  # noqa: F811
    """`rmqfast limits`, `rmqfast gray` and `rmqfast delay cancel` send their own Host and JSON."""
    srv, backend = serve()
    cfg = config_mod.Config()
    cfg.proxy.state_dir = str(tmp_path)
    backend.cfg = cfg  # type: ignore[attr-defined]
    backend.limits_view = lambda: {"rules": [  # type: ignore[method-assign]  # the fields the CLI prints
        {"topic": r.topic, "tag": r.tag, "mode": r.mode, "rate": r.rate, "burst": r.burst,
         "bytes_rate": r.bytes_rate, "admitted": 0, "rejected": 0} for r in backend.limits.rules]}
    url = f"http://127.0.0.1:{srv.port}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-P", "-m", "rmqfast", *args], capture_output=True, text=True,
                              timeout=120)

    out = cli("limits", "--admin", url, "set", "--topic", "T", "--rate", "10")
    assert out.returncode == 0 and "T" in out.stdout, out.stderr
    out = cli("limits", "--admin", url, "delete", "--topic", "T")
    assert out.returncode == 0, out.stderr
    assert backend.changes == 2
    # past the checks, these get the endpoint's own answers (no such group, [delay] off)
    out = cli("gray", "--admin", url, "abort", "G")
    assert out.returncode == 1 and "HTTP 404: unknown gray group 'G'" in out.stderr, out.stderr
    out = cli("delay", "cancel", "--admin", url, "--msg-id", "m1")
    assert out.returncode == 1 and "409" in out.stderr and "[delay] is not enabled" in out.stderr, out.stderr


@pytest.mark.parametrize("value,parsed", [
    ("a.example:80", ("a.example", 80)), ("A.Example.", ("a.example", None)), ("[::1]:9", ("::1", 9)),
    ("[::ffff:127.0.0.1]:9", ("127.0.0.1", 9)), ("10.0.0.1", ("10.0.0.1", None)),
    ("::1", None), ("a.example:0", None), ("a.example:99999", None), ("a b", None), ("u@a.example", None),
    ("a.example/x", None), ("[::1%eth0]:9", None), ("a.example:+9", None), ("-a.example", None), ("", None),
])
def test_host_values_are_parsed_strictly(value: str, parsed: tuple[str, int | None] | None) -> None:
    assert split_host(value) == parsed


def test_allowed_hosts_setting_is_validated() -> None:
    base = {"namesrv": {"upstreams": ["127.0.0.1:9876"]}}
    cfg = config_mod.from_dict({**base, "admin": {"allowed_hosts": ["proxy-1.example.internal", "localhost:19400"]}})
    assert cfg.admin.allowed_hosts == ["proxy-1.example.internal", "localhost:19400"]
    assert config_mod.from_json(cfg.to_json()).admin.allowed_hosts == cfg.admin.allowed_hosts
    assert config_mod.Config().admin.allowed_hosts == []
    for bad, msg in (("proxy-1", "expected a list of host names"),
                     (["http://proxy-1"], r"admin.allowed_hosts\[0\]: 'http://proxy-1' is not allowed"),
                     (["ok.example", "x:0"], r"admin.allowed_hosts\[1\]"), ([1], "expected a list")):
        with pytest.raises(ConfigError, match=msg):
            config_mod.from_dict({**base, "admin": {"allowed_hosts": bad}})


def test_own_names_port_rules() -> None:
    names = OwnNames.build("0.0.0.0", 9400, ["any.example", "pinned.example:80"])
    assert names.accepts("localhost", 9400, "") and not names.accepts("localhost", None, "")
    assert names.accepts("10.1.1.1", 9400, "10.1.1.1") and not names.accepts("10.1.1.1", 9400, "10.1.1.2")
    assert names.accepts("any.example", None, "") and names.accepts("any.example", 1, "")
    assert names.accepts("pinned.example", 80, "") and names.accepts("pinned.example", None, "")
    assert not names.accepts("pinned.example", 9400, "")
    assert not names.accepts("0.0.0.0", 9400, "")  # the wildcard is no name of the endpoint
    on80 = OwnNames.build("127.0.0.1", 80)
    assert on80.accepts("localhost", None, "")  # no port in Host: HTTP's 80

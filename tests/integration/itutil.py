"""Helpers of the rmqfast integration tests (real RocketMQ, real Java clients, real proxy).

Raw Remoting frames are built here by hand (JSON header, stdlib only) rather than with
``rmqfast.codec``: the tests must not share a codec bug with the proxy they check.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import struct
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rmqfast.testing import DriverProcess, run_driver
from rmqfast.testing.proxy import ProxyProcess

T = TypeVar("T")

# Request / response codes used by the tests (apache/rocketmq RequestCode, ResponseCode).
SUCCESS = 0
SYSTEM_ERROR = 1
NO_PERMISSION = 16
TOPIC_NOT_EXIST = 17
UPDATE_BROKER_CONFIG = 25
GET_BROKER_CONFIG = 26
GET_MAX_OFFSET = 30
HEART_BEAT = 34
GET_CONSUMER_LIST_BY_GROUP = 38
GET_ROUTEINFO_BY_TOPIC = 105
GET_BROKER_CLUSTER_INFO = 106
SEND_MESSAGE_V2 = 310
UPDATE_NAMESRV_CONFIG = 318
GET_NAMESRV_CONFIG = 319

#: The first request version whose route answers are standard JSON (MQVersion V4_9_4 ordinal).
STANDARD_JSON_VERSION = 401

PROTOCOL_ERROR_MSG = "protocol error; closing connection"


#: Seconds an awaited event may take on a loaded machine (2 cores at a load average of 10): a
#: bound that catches a hang, never a speed target (those live in bench/).
BOUND = 120.0


def unique(prefix: str) -> str:
    """A topic / group name no other test (or earlier run) uses."""
    return f"it_{prefix}_{uuid.uuid4().hex[:10]}"


def wait_until(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Polls ``pred`` until it returns something truthy (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: T = pred()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what} (last: {last!r})")
        time.sleep(interval)
        last = pred()
    return last


# --------------------------------------------------------------------------- raw frames

_opaques = itertools.count(1000)


@dataclass
class Response:
    code: int
    remark: str | None
    ext_fields: dict[str, str]
    body: bytes
    header: dict[str, Any] = field(repr=False)
    flag: int = 0


def build_request(
    code: int,
    ext_fields: Mapping[str, object] | None = None,
    body: bytes = b"",
    *,
    version: int = STANDARD_JSON_VERSION,
    flag: int = 0,
    opaque: int | None = None,
) -> tuple[bytes, int]:
    """A JSON-header request frame and its opaque."""
    op = next(_opaques) if opaque is None else opaque
    header: dict[str, object] = {
        "code": code,
        "flag": flag,
        "language": "JAVA",
        "opaque": op,
        "serializeTypeCurrentRPC": "JSON",
        "version": version,
    }
    if ext_fields:
        header["extFields"] = {k: str(v) for k, v in ext_fields.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">ii", 4 + len(hb) + len(body), len(hb)) + hb + body, op


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> Response:
    (total,) = struct.unpack(">i", recv_exact(sock, 4))
    data = recv_exact(sock, total)
    (mark,) = struct.unpack(">i", data[:4])
    stype, hlen = (mark >> 24) & 0xFF, mark & 0xFFFFFF
    assert stype == 0, f"expected a JSON header, got serialize type {stype}"
    hdr = json.loads(data[4 : 4 + hlen])
    return Response(
        code=int(hdr.get("code", -1)),
        remark=hdr.get("remark"),
        ext_fields=dict(hdr.get("extFields") or {}),
        body=data[4 + hlen :],
        header=hdr,
        flag=int(hdr.get("flag", 0)),
    )


def connect(addr: str, timeout: float = 30.0) -> socket.socket:
    host, _, port = addr.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.settimeout(timeout)
    return s


def call(
    sock: socket.socket,
    code: int,
    ext_fields: Mapping[str, object] | None = None,
    body: bytes = b"",
    *,
    version: int = STANDARD_JSON_VERSION,
) -> Response:
    """One request on an open connection; skips frames that are not the answer (none expected)."""
    frame, op = build_request(code, ext_fields, body, version=version)
    sock.sendall(frame)
    while True:
        r = read_frame(sock)
        if r.flag & 1 and r.header.get("opaque") == op:
            return r


def request(
    addr: str,
    code: int,
    ext_fields: Mapping[str, object] | None = None,
    body: bytes = b"",
    *,
    version: int = STANDARD_JSON_VERSION,
    timeout: float = 30.0,
) -> Response:
    """One request on a fresh connection."""
    with connect(addr, timeout) as s:
        return call(s, code, ext_fields, body, version=version)


def wait_closed(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Reads until the peer closes; returns what arrived before (b"" normally).

    A reset (the peer closed with unread data) counts as closed too. Fails after ``timeout``.
    """
    sock.settimeout(timeout)
    got = bytearray()
    deadline = time.monotonic() + timeout
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(got)
        except TimeoutError:
            raise AssertionError(f"connection still open after {timeout} s (received {bytes(got[:80])!r})") from None
        if not chunk:
            return bytes(got)
        got += chunk
        if time.monotonic() > deadline:
            raise AssertionError(f"connection still open after {timeout} s (received {bytes(got[:80])!r})")


def properties(body: bytes) -> dict[str, str]:
    """Parse a Java properties text (GET_BROKER_CONFIG / GET_NAMESRV_CONFIG answers)."""
    out = {}
    for line in body.decode("utf-8", "replace").splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


# --------------------------------------------------------------------------- routes

_ADDR = re.compile(rb'"(\d{1,3}(?:\.\d{1,3}){3}:\d+)"')


def broker_addrs(body: bytes) -> list[str]:
    """Every "host:port" string in a route / cluster-info body (any dialect)."""
    return [m.decode() for m in _ADDR.findall(body)]


def proxy_broker_endpoint(proxy: ProxyProcess, topic: str = "TBW102") -> str:
    """The proxy's endpoint for the (only) broker, learnt from a route through the proxy
    (which also makes the proxy allocate it)."""
    r = request(proxy.namesrv_addr, GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
    assert r.code == SUCCESS, f"route of {topic} through the proxy: {r.code} {r.remark}"
    addrs = broker_addrs(r.body)
    assert len(addrs) == 1, r.body
    return addrs[0]


def in_port_range(proxy: ProxyProcess, addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    lo, hi = proxy.port_range
    return host == "127.0.0.1" and lo <= int(port) <= hi


# --------------------------------------------------------------------------- metrics

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric(m: Metrics, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for (n, lab), v in m.items():
        if n == name and all((k, v2) in lab for k, v2 in labels.items()):
            total += v
    return total


def wait_metric(proxy: ProxyProcess, name: str, at_least: float, timeout: float = BOUND, **labels: str) -> float:
    """Polls /metrics (workers publish scanner counts once a second) until the value reaches
    ``at_least``; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        v = metric(proxy.metrics(), name, **labels)
        if v >= at_least:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} is {v} after {timeout:.1f} s; expected >= {at_least}")
        time.sleep(0.2)


def wait_published(proxy: ProxyProcess, timeout: float = BOUND) -> Metrics:
    """Waits until every worker has published its counters twice since the call, so that the
    whole of one publish began after it (a worker publishes in one go, between frames); returns
    the metrics then.  What a test sent and saw answered before the call is in them."""
    def counts(m: Metrics) -> dict[tuple[tuple[str, str], ...], float]:
        return {lab: v for (n, lab), v in m.items() if n == "rmqfast_worker_publishes_total"}

    start = counts(proxy.metrics())
    assert start, "no worker has published its counters yet (rmqfast_worker_publishes_total)"
    deadline = time.monotonic() + timeout
    while True:
        m = proxy.metrics()
        now = counts(m)
        if all(now.get(lab, 0.0) >= v + 2 for lab, v in start.items()):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"workers did not publish twice within {timeout:.1f} s: {start} -> {now}")
        time.sleep(0.1)


# --------------------------------------------------------------------------- logs


def log_records(proxy: ProxyProcess, msg: str | None = None, **fields: object) -> list[dict[str, Any]]:
    out = []
    for r in proxy.log_records():
        if msg is not None and r.get("msg") != msg:
            continue
        if all(r.get(k) == v for k, v in fields.items()):
            out.append(r)
    return out


# --------------------------------------------------------------------------- driver results


def checked(res: dict[str, Any]) -> dict[str, Any]:
    """A driver result, after checking that it used every option given (a misspelled option
    would otherwise be ignored silently and the test would check less than it says)."""
    assert not res.get("unused_options"), f"driver ignored options {res['unused_options']}"
    return res


#: Send timeout of producing scenarios. The clients' default (5 s) covers route lookup and topic
#: auto-creation too, which a busy 2-core machine (JVMs starting alongside) can exceed.
SEND_TIMEOUT_MS = 15000
_PRODUCING = {"produce", "roundtrip", "transaction"}


def drive(scenario: str, namesrv: str, client: str, **options: Any) -> dict[str, Any]:
    """``run_driver`` + :func:`checked`, with :data:`SEND_TIMEOUT_MS` for producers."""
    if scenario in _PRODUCING:
        options.setdefault("send_timeout_ms", SEND_TIMEOUT_MS)
    return checked(run_driver(scenario, namesrv, client, **options))  # type: ignore[arg-type]


def finish(proc: DriverProcess, timeout: float = 90.0) -> dict[str, Any]:
    """``proc.result`` + :func:`checked`."""
    return checked(proc.result(timeout))


def assert_roundtrip(res: dict[str, Any], count: int) -> None:
    """A roundtrip result: every sent message received exactly once, identical content."""
    assert res["ok"], {k: res.get(k) for k in ("error", "lost", "duplicates", "mismatched", "timed_out")}
    assert res["failed"] == [], res["failed"][:3]
    sent = res["sent"]
    assert sorted(s["idx"] for s in sent) == list(range(count))
    assert res["lost"] == [] and res["duplicates"] == [] and res["mismatched"] == []
    received = [d for d in res["consumed"]["received"] if d["run"] == res["run_id"]]
    acked = Counter(d["idx"] for d in received if d["acked"])
    assert sorted(acked) == list(range(count)), f"lost/extra: {sorted(set(range(count)) ^ set(acked))}"
    assert all(n == 1 for n in acked.values()), f"duplicates: {[i for i, n in acked.items() if n > 1]}"
    by_idx = {d["idx"]: d for d in received}
    for s in sent:
        d = by_idx[s["idx"]]
        assert d["topic"] == res["topic"]
        assert d["body_sha256"] == s["body_sha256"] and d["body_len"] == s["body_len"], s["idx"]
        assert d["body"] == s["body"]
        assert d["keys"] == s["keys"]
        assert d["tags"] == s["tag"]
        assert d["props"] == s["props"]
        if res.get("mode") != "batch":
            # 5.3.3's client gives batched messages the batch's UNIQ_KEY on the consumer side
            # (also without a proxy), so msg ids are compared for single sends only
            assert d["msg_id"] == s["msg_id"]
        assert d["reconsume_times"] == 0
        if s.get("queue_offset") is not None:  # one-way sends have no send result
            assert (d["queue_id"], d["queue_offset"]) == (s["queue_id"], s["queue_offset"]), s["idx"]


# --------------------------------------------------------------------------- /proc


def _tcp_table() -> dict[str, tuple[int, int]]:
    """socket inode -> (local port, remote port) of every TCP socket of this network namespace."""
    out: dict[str, tuple[int, int]] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            lport = int(parts[1].rsplit(":", 1)[1], 16)
            rport = int(parts[2].rsplit(":", 1)[1], 16)
            out[parts[9]] = (lport, rport)
    return out


def tcp_connections(pid: int) -> list[tuple[int, int]]:
    """(local port, remote port) of the TCP sockets process ``pid`` holds."""
    table = _tcp_table()
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            conn = table.get(target[8:-1])
            if conn is not None:
                out.append(conn)
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not reaped yet) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

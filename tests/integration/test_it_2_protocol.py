"""The proxy at the frame level: route rewriting, admin-code denial, malformed input, metrics.

Raw frames are built by ``itutil`` (not by rmqfast's codec) and compared with what the real
name server / broker answer when asked directly.
"""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest
from itutil import (
    BOUND,
    GET_BROKER_CLUSTER_INFO,
    GET_BROKER_CONFIG,
    GET_MAX_OFFSET,
    GET_NAMESRV_CONFIG,
    GET_ROUTEINFO_BY_TOPIC,
    NO_PERMISSION,
    PROTOCOL_ERROR_MSG,
    SEND_TIMEOUT_MS,
    SUCCESS,
    UPDATE_BROKER_CONFIG,
    UPDATE_NAMESRV_CONFIG,
    broker_addrs,
    build_request,
    call,
    connect,
    drive,
    finish,
    in_port_range,
    log_records,
    metric,
    pid_alive,
    properties,
    proxy_broker_endpoint,
    request,
    unique,
    wait_closed,
    wait_metric,
    wait_published,
    wait_until,
)

from rmqfast.testing import RocketMQCluster, start_driver
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration


# --------------------------------------------------------------------------- 6. route rewrite


@pytest.mark.parametrize(
    ("version", "legacy"),
    [(0, True), (400, True), (401, False), (479, False)],
    ids=["v0-legacy", "v400-legacy", "v401-json", "v479-json"],
)
def test_route_rewrite_keeps_dialect(cluster: RocketMQCluster, proxy: ProxyProcess, version: int, legacy: bool) -> None:
    """GET_ROUTEINFO_BY_TOPIC through the proxy: the answer is the name server's, byte for byte,
    except that the real broker address became a proxy endpoint; a request ``version`` < 401
    gets fastjson's legacy unquoted integer keys and the rewritten body keeps them."""
    topic = unique("route")
    cluster.create_topic(topic, queues=3)
    real = request(cluster.namesrv_addr, GET_ROUTEINFO_BY_TOPIC, {"topic": topic}, version=version)
    assert real.code == SUCCESS
    assert broker_addrs(real.body) == [cluster.broker_addr]
    before = metric(proxy.metrics(), "rmqfast_route_rewrites_total", code="105")
    got = request(proxy.namesrv_addr, GET_ROUTEINFO_BY_TOPIC, {"topic": topic}, version=version)
    assert got.code == SUCCESS, got.remark
    addrs = broker_addrs(got.body)
    assert len(addrs) == 1 and in_port_range(proxy, addrs[0]), (addrs, proxy.port_range)
    assert cluster.broker_addr.encode() not in got.body
    assert f":{cluster.broker_port}".encode() not in got.body
    # exactly the name server's answer with the address patched
    assert got.body == real.body.replace(cluster.broker_addr.encode(), addrs[0].encode())
    if legacy:
        assert f'{{0:"{addrs[0]}"}}'.encode() in got.body, got.body
        assert b'"0":' not in got.body
    else:
        assert json.loads(got.body)["brokerDatas"][0]["brokerAddrs"] == {"0": addrs[0]}
    # and the client can use it: the endpoint relays to the real broker
    r = request(addrs[0], GET_MAX_OFFSET, {"topic": topic, "queueId": 0})
    assert r.code == SUCCESS and r.ext_fields.get("offset") == "0", r
    wait_metric(proxy, "rmqfast_route_rewrites_total", before + 1, code="105")


@pytest.mark.parametrize("version", [0, 401])
def test_cluster_info_rewritten(cluster: RocketMQCluster, proxy: ProxyProcess, version: int) -> None:
    """GET_BROKER_CLUSTER_INFO (106) through the proxy: broker addresses are proxy endpoints."""
    real = request(cluster.namesrv_addr, GET_BROKER_CLUSTER_INFO, version=version)
    assert real.code == SUCCESS and broker_addrs(real.body) == [cluster.broker_addr]
    got = request(proxy.namesrv_addr, GET_BROKER_CLUSTER_INFO, version=version)
    assert got.code == SUCCESS, got.remark
    addrs = broker_addrs(got.body)
    assert len(addrs) == 1 and in_port_range(proxy, addrs[0]), addrs
    assert cluster.broker_addr.encode() not in got.body
    assert got.body == real.body.replace(cluster.broker_addr.encode(), addrs[0].encode())
    assert addrs[0] == proxy_broker_endpoint(proxy)  # the same endpoint as in topic routes


# --------------------------------------------------------------------------- 7. admin codes


def test_admin_codes_denied(cluster: RocketMQCluster, proxy: ProxyProcess) -> None:
    """UPDATE_BROKER_CONFIG (25) to a broker endpoint and UPDATE_NAMESRV_CONFIG (318) to the
    name-server port: NO_PERMISSION naming the code, nothing changed upstream, counted."""
    endpoint = proxy_broker_endpoint(proxy)
    broker_before = properties(request(cluster.broker_addr, GET_BROKER_CONFIG).body)
    ns_before = properties(request(cluster.namesrv_addr, GET_NAMESRV_CONFIG).body)
    assert "fileReservedTime" in broker_before and "clientRequestThreadPoolNums" in ns_before
    m0 = proxy.metrics()

    new_reserved = int(broker_before["fileReservedTime"]) + 7
    with connect(endpoint) as s:
        r = call(s, UPDATE_BROKER_CONFIG, body=f"fileReservedTime={new_reserved}\n".encode())
        assert r.code == NO_PERMISSION, r
        assert r.remark and "25" in r.remark, r.remark
        # the connection stays usable for data-plane requests
        ok = call(s, GET_MAX_OFFSET, {"topic": "TBW102", "queueId": 0})
        assert ok.code == SUCCESS, ok
    new_threads = int(ns_before["clientRequestThreadPoolNums"]) + 3
    r = request(proxy.namesrv_addr, UPDATE_NAMESRV_CONFIG, body=f"clientRequestThreadPoolNums={new_threads}\n".encode())
    assert r.code == NO_PERMISSION, r
    assert r.remark and "318" in r.remark, r.remark
    # a read-only admin code is denied too (it is not data plane)
    r = request(endpoint, GET_BROKER_CONFIG)
    assert r.code == NO_PERMISSION and "26" in (r.remark or ""), r

    assert (
        properties(request(cluster.broker_addr, GET_BROKER_CONFIG).body)["fileReservedTime"]
        == (broker_before["fileReservedTime"])
    )
    assert (
        properties(request(cluster.namesrv_addr, GET_NAMESRV_CONFIG).body)["clientRequestThreadPoolNums"]
        == (ns_before["clientRequestThreadPoolNums"])
    )
    denied = "rmqfast_denied_requests_total"
    wait_metric(proxy, denied, metric(m0, denied, role="broker", code="25") + 1, role="broker", code="25")
    wait_metric(proxy, denied, metric(m0, denied, role="namesrv", code="318") + 1, role="namesrv", code="318")
    wait_metric(proxy, denied, metric(m0, denied, role="broker", code="26") + 1, role="broker", code="26")
    assert log_records(proxy, "denied request", code=318), "no log line for the denied 318"


def test_allowlisted_admin_code_passes(cluster: RocketMQCluster) -> None:
    """``[policy] allow_codes = [26]``: GET_BROKER_CONFIG reaches the broker; 25 stays denied."""
    with ProxyProcess([cluster.namesrv_addr], extra_config="[policy]\nallow_codes = [26]\n") as p:
        endpoint = proxy_broker_endpoint(p)
        r = request(endpoint, GET_BROKER_CONFIG)
        assert r.code == SUCCESS, r
        assert properties(r.body).get("brokerName") == cluster.broker_name
        r = request(endpoint, UPDATE_BROKER_CONFIG, body=b"fileReservedTime=1\n")
        assert r.code == NO_PERMISSION, r
        assert metric(p.metrics(), "rmqfast_denied_requests_total", code="26") == 0


# --------------------------------------------------------------------------- 8. bad input


def _json_header(code: int = 105) -> bytes:
    return json.dumps({"code": code, "flag": 0, "language": "JAVA", "opaque": 1, "version": 401}).encode()


_h = _json_header()
BAD_INPUTS = {
    # length word -1
    "garbage": (b"\xff" * 48, "shorter than"),
    # 100 MiB frame (limit 16 MiB)
    "oversized": (struct.pack(">ii", 100 << 20, len(_h)) + _h, "exceeds the limit"),
    "serialize_type": (struct.pack(">ii", 4 + len(_h), (7 << 24) | len(_h)) + _h, "serialize type 7"),
    "invalid_json": (struct.pack(">ii", 4 + 11, 11) + b"{code: 105}", "invalid JSON header"),
}


def test_bad_input_closes_only_that_connection(proxy: ProxyProcess) -> None:
    """Each malformed frame closes its own connection (one log line, a counted protocol error);
    a healthy connection opened before, and a producer running meanwhile, are unaffected."""
    endpoint = proxy_broker_endpoint(proxy)
    topic = unique("badinput")
    m0 = proxy.metrics()
    healthy_ns = connect(proxy.namesrv_addr)
    healthy_br = connect(endpoint)
    producer = start_driver(
        "produce", proxy.namesrv_addr, "5", topic=topic, count=40, mode="sync", send_timeout_ms=SEND_TIMEOUT_MS
    )
    try:
        # warm: the healthy connections work before
        assert call(healthy_ns, GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}).code == SUCCESS
        assert call(healthy_br, GET_MAX_OFFSET, {"topic": "TBW102", "queueId": 0}).code == SUCCESS
        cases = [(name, proxy.namesrv_addr, "namesrv", data, err) for name, (data, err) in BAD_INPUTS.items()]
        cases.append(("invalid_json@broker", endpoint, "broker", *BAD_INPUTS["invalid_json"]))
        clients = {}
        for name, addr, role, data, err in cases:
            with connect(addr) as s:
                local = "{}:{}".format(*s.getsockname())
                s.sendall(data)
                t0 = time.monotonic()
                # at once, not after proxy.frame_timeout (30 s): 15 s leaves room for a loaded machine
                got = wait_closed(s, timeout=15.0)
                assert got == b"", f"{name}: the proxy answered {got[:60]!r} instead of closing"
                assert time.monotonic() - t0 < 15.0
            clients[name] = (local, role, err)

        for name, (local, role, err) in clients.items():
            recs = wait_until(
                lambda local=local: log_records(proxy, PROTOCOL_ERROR_MSG, client=local),
                BOUND,
                f"protocol-error log line for {name}",
            )
            assert len(recs) == 1, recs  # one line per bad connection
            assert recs[0]["role"] == role and recs[0]["side"] == "client", recs[0]
            assert err in recs[0]["error"], (name, recs[0]["error"])
            assert recs[0]["level"] == "warning"

        errs = "rmqfast_protocol_errors_total"
        ns_errs = wait_metric(proxy, errs, metric(m0, errs, role="namesrv") + 4, role="namesrv")
        br_errs = wait_metric(proxy, errs, metric(m0, errs, role="broker") + 1, role="broker")
        assert ns_errs == metric(m0, errs, role="namesrv") + 4
        assert br_errs == metric(m0, errs, role="broker") + 1

        # the connections opened before still work
        r = call(healthy_ns, GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"})
        assert r.code == SUCCESS and broker_addrs(r.body) == [endpoint]
        assert call(healthy_br, GET_MAX_OFFSET, {"topic": "TBW102", "queueId": 0}).code == SUCCESS
        res = finish(producer, 60)
        assert res["sent_count"] == 40 and res["failed"] == []
        assert all(x["status"] == "SEND_OK" for x in res["sent"])
        assert pid_alive(proxy.proc.pid) and all(pid_alive(p) for p in proxy.worker_pids())
        assert proxy.health()["restarts"] == 0
    finally:
        producer.kill()
        healthy_ns.close()
        healthy_br.close()


def test_truncated_frame_then_close(proxy: ProxyProcess) -> None:
    """Half a frame, then the client closes its side: the proxy closes the connection and
    (the frame was not malformed, only cut short) counts no protocol error."""
    endpoint = proxy_broker_endpoint(proxy)
    frame, _ = build_request(GET_MAX_OFFSET, {"topic": "TBW102", "queueId": 0})
    for addr in (proxy.namesrv_addr, endpoint):
        m0 = proxy.metrics()
        with connect(addr) as s:
            local = "{}:{}".format(*s.getsockname())
            s.sendall(frame[: len(frame) // 2])
            s.shutdown(socket.SHUT_WR)
            assert wait_closed(s) == b""
        # a healthy request afterwards on a new connection
        with connect(addr) as s:
            if addr == endpoint:
                assert call(s, GET_MAX_OFFSET, {"topic": "TBW102", "queueId": 0}).code == SUCCESS
            else:
                assert call(s, GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}).code == SUCCESS
        assert log_records(proxy, PROTOCOL_ERROR_MSG, client=local) == []
        after = wait_published(proxy)  # a wrongly counted error would show by now
        assert metric(after, "rmqfast_protocol_errors_total") == metric(m0, "rmqfast_protocol_errors_total")


# --------------------------------------------------------------------------- 10. metrics


def test_metrics_after_traffic(proxy: ProxyProcess) -> None:
    """/metrics over HTTP counts sends per code and role, batch inner messages per topic;
    /healthz and /readyz answer 200."""
    t_sync, t_batch = unique("msync"), unique("mbatch")
    req = "rmqfast_requests_total"
    m0 = proxy.metrics()
    sync = drive("produce", proxy.namesrv_addr, "4", topic=t_sync, count=25, mode="sync", timeout=60)
    batch = drive("produce", proxy.namesrv_addr, "5", topic=t_batch, count=30, mode="batch", batch_size=10, timeout=60)
    assert sync["sent_count"] == 25 and batch["sent_count"] == 30
    sends_310 = wait_metric(proxy, req, metric(m0, req, code="310", role="broker") + 25, code="310", role="broker")
    assert sends_310 >= 25
    wait_metric(proxy, req, metric(m0, req, code="320", role="broker") + 3, code="320", role="broker")
    m = proxy.metrics()
    # every send ended with a result, and was timed in a histogram that resolves sub-millisecond latency
    assert metric(m, req, code="310", role="broker", result="success") - metric(
        m0, req, code="310", role="broker", result="success") >= 25
    hist = "rmqfast_request_duration_seconds"
    labels = {"code": "310", "role": "broker"}
    assert metric(m, f"{hist}_count", **labels) - metric(m0, f"{hist}_count", **labels) >= 25
    assert metric(m, f"{hist}_bucket", code="310", role="broker", le="0.0001") <= metric(
        m, f"{hist}_bucket", code="310", role="broker", le="0.001") <= metric(m, f"{hist}_count", code="310")
    assert 0 < metric(m, f"{hist}_sum", code="310", role="broker") < metric(m, f"{hist}_count", code="310") * 5
    # per-topic counters: 25 single messages; 3 batch frames carrying 30 messages
    assert metric(m, "rmqfast_topic_sends_total", topic=t_sync) >= 25
    assert metric(m, "rmqfast_topic_messages_total", topic=t_sync) == metric(
        m, "rmqfast_topic_sends_total", topic=t_sync
    )
    batch_frames = metric(m, "rmqfast_topic_sends_total", topic=t_batch)
    batch_msgs = metric(m, "rmqfast_topic_messages_total", topic=t_batch)
    assert batch_frames >= 3 and batch_msgs >= 30
    assert batch_msgs == 10 * batch_frames, (batch_frames, batch_msgs)
    assert metric(m, "rmqfast_topic_bytes_total", topic=t_batch) > 30 * 20
    # responses and bytes are counted too, and the connection gauges are sane
    assert metric(m, "rmqfast_responses_total", role="broker", code="0") >= 28
    assert metric(m, "rmqfast_bytes_total", role="broker") > 0
    assert metric(m, "rmqfast_connections_total", role="namesrv") >= 2
    # the drivers have exited: their sessions are gone (no leaked sessions in the gauge)
    wait_until(
        lambda: metric(proxy.metrics(), "rmqfast_connections_active") == 0,
        BOUND,
        "rmqfast_connections_active to return to 0",
    )
    assert metric(m, "rmqfast_worker_up") == 2
    assert {dict(lab)["worker"] for (n, lab) in m if n == "rmqfast_worker_publishes_total"} == {"0", "1"}

    code, body = proxy.get("/healthz")
    assert code == 200
    health = json.loads(body)
    assert health["status"] == "ok" and health["workers_alive"] == 2
    assert len(health["worker_pids"]) == 2 and all(pid_alive(p) for p in health["worker_pids"])
    code, body = proxy.get("/readyz")
    assert code == 200 and json.loads(body)["ready"] is True
    assert proxy.get("/nope")[0] == 404

"""Broker addresses inside messages, and read-only admin through the proxy.

Real Java clients (5.3.3, 4.9.4), the real ``mqadmin`` 5.3.3 and the real Go client, each
reaching RocketMQ only through the proxy: a :class:`ConnectionWatch` samples every client
process's TCP connections while it runs, and no connection may go to a real RocketMQ port.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from itutil import (
    NO_PERMISSION,
    SUCCESS,
    drive,
    in_port_range,
    metric,
    proxy_broker_endpoint,
    request,
    unique,
    wait_metric,
    wait_published,
)

from rmqfast.codec import codes as C
from rmqfast.codec.msgaddr import format_host
from rmqfast.testing import RocketMQCluster, ToolMissingError
from rmqfast.testing.connwatch import ConnectionWatch
from rmqfast.testing.goclient import ensure_godriver, run_godriver
from rmqfast.testing.javaclient import Client
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

COUNT = 12


def real_ports(cluster: RocketMQCluster) -> set[int]:
    """Ports a client that reaches only the proxy never connects to."""
    return {int(cluster.namesrv_addr.rpartition(":")[2]), cluster.broker_port, cluster.broker_port - 2}


def offset_id_addr(mid: str) -> str:
    return format_host(bytes.fromhex(mid[:16]))


@pytest.fixture(scope="module")
def admin_proxy(cluster: RocketMQCluster) -> Iterator[ProxyProcess]:
    """A proxy with ``policy.preset = "read-only-admin"`` and ``message_addresses = "all"``
    (send answers' offset ids rewritten too)."""
    extra = '[policy]\npreset = "read-only-admin"\nmessage_addresses = "all"\n'
    with ProxyProcess([cluster.namesrv_addr], extra_config=extra) as p:
        yield p


@pytest.mark.parametrize("client", ["5", "4"])
def test_java_send_back_and_addresses_through_proxy_only(proxy: ProxyProcess, cluster: RocketMQCluster,
                                                         client: Client) -> None:
    """Every other message fails its first delivery: the Java client sends it back
    (CONSUMER_SEND_MSG_BACK) and gets it again from the retry topic.  Store hosts and offset
    message ids name proxy endpoints; identity (UNIQ_KEY, keys, body) is what was sent."""
    topic = unique(f"sendback{client}")
    cluster.create_topic(topic, queues=2)
    with ConnectionWatch() as watch:
        res = drive("roundtrip", proxy.namesrv_addr, client, topic=topic, count=COUNT, mode="sync",
                    consumer="push", fail_every=2, retry_delay_level=1, timeout_ms=45000, settle_ms=500,
                    timeout=90)
    assert not watch.touched(real_ports(cluster)), f"client reached real ports {watch.touched(real_ports(cluster))}"
    assert watch.pids, "no client connection was seen at all"
    sent = {s["idx"]: s for s in res["sent"]}
    assert sorted(sent) == list(range(COUNT)), res.get("failed")
    for s in sent.values():  # the default ("all"): send answers' offset ids name the proxy's endpoint too
        assert in_port_range(proxy, offset_id_addr(s["offset_msg_id"])), s
    received = [d for d in res["consumed"]["received"] if d["run"] == res["run_id"]]
    acked = Counter(d["idx"] for d in received if d["acked"])
    assert sorted(acked) == list(range(COUNT)) and set(acked.values()) == {1}, acked
    retried = [d for d in received if d["acked"] and d["reconsume_times"] >= 1]
    assert {d["idx"] for d in retried} == {i for i in range(COUNT) if i % 2 == 0}, "send-back did not happen"
    for d in received:
        assert in_port_range(proxy, d["store_host"]), d
        assert offset_id_addr(d["offset_msg_id"]) == d["store_host"], d
        s = sent[d["idx"]]
        assert d["body"] == s["body"] and d["keys"] == s["keys"]
        assert d["msg_id"] == s["msg_id"]  # UNIQ_KEY, also for the copy from the retry topic


@pytest.mark.parametrize("mode", ["sync", "batch"])
def test_go_send_answers_name_proxy_endpoints(godriver: Path, admin_proxy: ProxyProcess, cluster: RocketMQCluster,
                                             mode: str) -> None:
    """With ``message_addresses = "all"`` the offset ids in send answers (a batch: one per
    message, comma-separated) name the proxy's endpoint; the commit-log offsets are the broker's."""
    topic = unique(f"go_ids_{mode}")
    cluster.create_topic(topic, queues=1)
    sent = run_godriver("produce", admin_proxy.namesrv_addr, topic=topic, count=16, mode=mode, timeout=90)
    assert sent["ok"], sent
    ids = [one for mid in sent["offset_msg_ids"] for one in mid.split(",")]
    assert len(ids) == 16, sent["offset_msg_ids"]
    assert all(in_port_range(admin_proxy, offset_id_addr(i)) for i in ids), ids
    offsets = [int(i[16:], 16) for i in ids]
    assert offsets == sorted(offsets) and len(set(offsets)) == 16
    got = run_godriver("consume-pull", admin_proxy.namesrv_addr, topic=topic, group=unique("goids"), expect=16,
                       timeout_ms=45000, timeout=90)
    assert sorted(r["offset_msg_id"] for r in got["received"]) == sorted(ids)  # both sides agree


def test_mqadmin_query_msg_by_offset_id_through_proxy(admin_proxy: ProxyProcess, cluster: RocketMQCluster) -> None:
    """``mqadmin queryMsgById`` with the offset message id of a send: the tool connects to the
    address in the id (VIEW_MESSAGE_BY_ID), which is the proxy's endpoint; the answer's store
    host is the endpoint too, and the read-only preset lets the consume-track queries through."""
    topic = unique("viewmsg")
    cluster.create_topic(topic, queues=1)
    res = drive("produce", admin_proxy.namesrv_addr, "5", topic=topic, count=1, mode="sync", timeout=90)
    (s,) = res["sent"]
    endpoint = offset_id_addr(s["offset_msg_id"])
    assert in_port_range(admin_proxy, endpoint), s
    with ConnectionWatch() as watch:
        out = cluster.mqadmin("queryMsgById", "-n", admin_proxy.namesrv_addr, "-t", topic, "-i", s["offset_msg_id"])
    assert not watch.touched(real_ports(cluster)), watch.touched(real_ports(cluster))
    # the VIEW_MESSAGE_BY_ID reached the broker through the endpoint in the id (the proxy counted
    # it): sampling connections can miss a short-lived JVM's on a loaded machine, this cannot
    wait_metric(admin_proxy, "rmqfast_requests_total", 1, role="broker", code=str(C.VIEW_MESSAGE_BY_ID))
    assert re.search(rf"OffsetID:\s+{s['offset_msg_id']}", out), out
    assert re.search(rf"Topic:\s+{topic}", out), out
    assert re.search(rf"Store Host:\s+/?{re.escape(endpoint)}", out), out
    assert s["keys"] in out, out


@pytest.mark.parametrize("client", ["5", "4"])
def test_default_query_msg_by_id_goes_through_the_proxy(proxy: ProxyProcess, cluster: RocketMQCluster,
                                                        client: Client) -> None:
    """With default settings (the shared proxy: no preset, default message_addresses) the offset
    msgId a send returns names the proxy's endpoint, so ``mqadmin queryMsgById`` on it connects to
    the proxy (VIEW_MESSAGE_BY_ID counted there) and neither the client nor mqadmin ever connects
    to the real broker.  The consume-track query mqadmin adds (an admin code) is refused with a
    remark naming the preset; the message itself is shown."""
    r = request(proxy_broker_endpoint(proxy), 28, {})  # GET_BROKER_RUNTIME_INFO: read-only, but no preset here
    assert r.code == NO_PERMISSION and 'policy.preset = "read-only-admin"' in (r.remark or ""), r.remark
    topic = unique(f"defview{client}")
    cluster.create_topic(topic, queues=1)
    with ConnectionWatch() as watch:  # the client's and mqadmin's connections, all along
        res = drive("produce", proxy.namesrv_addr, client, topic=topic, count=3, mode="sync", timeout=90)
        sent = res["sent"]
        assert len(sent) == 3, res.get("failed")
        for s in sent:
            assert in_port_range(proxy, offset_id_addr(s["offset_msg_id"])), s
        before = metric(wait_published(proxy), "rmqfast_requests_total", role="broker",
                        code=str(C.VIEW_MESSAGE_BY_ID))
        s = sent[1]
        # Twice in one loaded run mqadmin printed nothing to stdout and exited 0 (not seen in 4 quieter
        # runs, its stderr not kept then); the likely cause, not established, is its view of the message
        # timing out in a cold JVM (it then looks the id up as a UNIQ_KEY, finds nothing, and prints that
        # to stderr).  At most 3 tries; each goes through the proxy like the first.
        for _ in range(3):
            out = cluster.mqadmin("queryMsgById", "-n", proxy.namesrv_addr, "-t", topic, "-i", s["offset_msg_id"])
            if "OffsetID:" in out:
                break
    assert watch.pids, "no client connection was seen at all"
    assert not watch.touched(real_ports(cluster)), f"reached the real broker: {watch.touched(real_ports(cluster))}"
    # sampling connections can miss a short-lived JVM's on a loaded machine; the proxy's count cannot
    wait_metric(proxy, "rmqfast_requests_total", before + 1, role="broker", code=str(C.VIEW_MESSAGE_BY_ID))
    assert re.search(rf"OffsetID:\s+{s['offset_msg_id']}", out), out
    assert re.search(rf"Topic:\s+{topic}", out), out
    assert re.search(rf"Store Host:\s+/?{re.escape(offset_id_addr(s['offset_msg_id']))}", out), out
    assert s["keys"] in out, out


def test_mqadmin_cluster_list_topic_status_consumer_progress(admin_proxy: ProxyProcess, proxy: ProxyProcess,
                                                             cluster: RocketMQCluster) -> None:
    """The read-only preset: clusterList shows the proxy's endpoint with the broker's real
    runtime stats, topicStatus and consumerProgress show real offsets; without the preset the
    runtime info is denied (the shared proxy's defaults)."""
    topic, group = unique("adm"), unique("admgrp")
    cluster.create_topic(topic, queues=2)
    # The consumer's last offsets go to the broker in its shutdown, as oneway requests: the driver
    # waits for that whole shutdown here, not its default 1.5 s before the JVM exits.  On a fresh
    # clone on a busy machine one queue's offset once never reached the broker (consumerProgress
    # showed its 3 messages unconsumed for 120 s); the likely cause, not established, is a JVM
    # that exited before those writes went out (the proxy's own log showed nothing).
    drive("roundtrip", admin_proxy.namesrv_addr, "5", topic=topic, count=6, mode="sync", consumer="push",
          group=group, timeout_ms=45000, shutdown_wait_ms=30000, timeout=120)
    with ConnectionWatch() as watch:
        out = cluster.mqadmin("clusterList", "-n", admin_proxy.namesrv_addr)
        status = cluster.mqadmin("topicStatus", "-n", admin_proxy.namesrv_addr, "-t", topic)
        progress = cluster.mqadmin("consumerProgress", "-n", admin_proxy.namesrv_addr, "-g", f"{group}_c")
    assert not watch.touched(real_ports(cluster)), watch.touched(real_ports(cluster))
    rows = [line for line in out.splitlines() if re.search(r"\d+\.\d+\.\d+\.\d+:\d+", line)]
    addrs = [a for line in rows for a in re.findall(r"\d+\.\d+\.\d+\.\d+:\d+", line)]
    assert addrs and all(in_port_range(admin_proxy, a) for a in addrs), out
    assert any("V5_3_3" in line for line in rows), out  # GET_BROKER_RUNTIME_INFO answered via the endpoint
    # topicStatus: "#Broker Name #QID #Min Offset #Max Offset ..." rows; 6 messages over 2 queues
    queue_rows = [p for p in (line.split() for line in status.splitlines())
                  if len(p) >= 4 and p[1].isdigit() and p[2].isdigit() and p[3].isdigit()]
    assert len(queue_rows) == 2 and sum(int(p[3]) for p in queue_rows) == 6, status
    # the consumer's offsets reach the broker asynchronously: ask again until they are all in
    deadline = time.monotonic() + 120
    while not re.search(r"Diff Total:\s*0\b", progress) and time.monotonic() < deadline:
        progress = cluster.mqadmin("consumerProgress", "-n", admin_proxy.namesrv_addr, "-g", f"{group}_c")
    assert topic in progress and re.search(r"Diff Total:\s*0\b", progress), progress
    # the same admin request without the preset: denied, so no version in the row
    denied = cluster.mqadmin("clusterList", "-n", proxy.namesrv_addr)
    assert "V5_3_3" not in denied, denied


def test_read_only_preset_still_denies_writes(admin_proxy: ProxyProcess, cluster: RocketMQCluster) -> None:
    """Raw frames: the preset's read codes are answered by the broker, write codes are not relayed."""
    endpoint = proxy_broker_endpoint(admin_proxy)
    r = request(endpoint, 28, {})  # GET_BROKER_RUNTIME_INFO
    assert r.code == SUCCESS, (r.code, r.remark)
    r = request(admin_proxy.namesrv_addr, 206, {})  # GET_ALL_TOPIC_LIST_FROM_NAMESERVER
    assert r.code == SUCCESS, (r.code, r.remark)
    topic = unique("nowrite")
    for addr, code, fields in (
        (endpoint, C.UPDATE_AND_CREATE_TOPIC, {"topic": topic, "defaultTopic": "TBW102", "readQueueNums": "1",
                                              "writeQueueNums": "1", "perm": "6", "topicFilterType": "SINGLE_TAG"}),
        (endpoint, C.UPDATE_BROKER_CONFIG, {}),
        (endpoint, 215, {"topic": topic}),  # DELETE_TOPIC_IN_BROKER
        (endpoint, 222, {"topic": topic, "group": "g", "timestamp": "0"}),  # INVOKE_BROKER_TO_RESET_OFFSET
        (admin_proxy.namesrv_addr, C.UPDATE_NAMESRV_CONFIG, {}),
        (admin_proxy.namesrv_addr, C.PUT_KV_CONFIG, {"namespace": "n", "key": "k", "value": "v"}),
        (admin_proxy.namesrv_addr, 205, {"brokerName": "x"}),  # WIPE_WRITE_PERM_OF_BROKER
    ):
        r = request(addr, code, fields)
        assert r.code == NO_PERMISSION, (code, r.code, r.remark)
        # the remark says what was set and what would let it through
        assert 'policy.preset = "read-only-admin"' in (r.remark or "") and "policy.allow_codes" in (r.remark or ""), \
            r.remark
    # mqadmin reports the failure and exits 0: what counts is that the topic was not created
    cluster.mqadmin("updateTopic", "-b", endpoint, "-t", topic)
    wait_metric(admin_proxy, "rmqfast_denied_requests_total", 1, role="broker", code=str(C.UPDATE_AND_CREATE_TOPIC))
    r = request(cluster.broker_addr, 351, {"topic": topic})  # GET_TOPIC_CONFIG, straight at the broker
    assert r.code == C.TOPIC_NOT_EXIST, (r.code, r.remark)


@pytest.fixture(scope="module")
def godriver() -> Path:
    try:
        return ensure_godriver()
    except ToolMissingError as e:
        pytest.skip(str(e))


def test_without_rewrite_the_go_client_goes_around_the_proxy(godriver: Path, cluster: RocketMQCluster) -> None:
    """The control: with ``policy.message_addresses = "off"`` the Go orderly consumer sends its
    exhausted message back to the store host in the record, i.e. straight to the real broker.
    (With the default, test_it_10_go's DLQ tests see no such connection.)"""
    topic, group = unique("go_norw"), unique("gonorw")
    cluster.create_topic(topic, queues=1)
    cluster.create_topic(f"%RETRY%{group}", queues=1)
    cluster.create_topic(f"%DLQ%{group}", queues=1)
    with ProxyProcess([cluster.namesrv_addr], extra_config='[policy]\nmessage_addresses = "off"\n') as p:
        sent = run_godriver("produce", p.namesrv_addr, topic=topic, count=1, mode="sync", prefix="n", timeout=90)
        assert not in_port_range(p, offset_id_addr(sent["offset_msg_ids"][0]))  # the real broker's id
        with ConnectionWatch() as watch:
            res = run_godriver("retry-dlq", p.namesrv_addr, topic=topic, group=group, expect=1, max_reconsume=1,
                               orderly=True, timeout_ms=40000, linger_ms=500, timeout=90, check=False)
    assert res["received"] and res["received"][0]["store_host"] == cluster.broker_addr, res
    assert res["ok"], res.get("error")
    assert watch.touched({cluster.broker_port}), ("expected the send-back to go to the real broker", watch.ports)

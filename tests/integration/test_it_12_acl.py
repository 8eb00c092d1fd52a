"""ACL through the proxy: a RocketMQ 5.3.3 broker with ACL 2.0 on (authentication and
authorization), real Java clients 5.3.3 and 4.9.4 signing with AclClientRPCHook, real mqadmin.

* Signed requests pass through unchanged and work (sends, push and lite pulls, send-back,
  mqadmin reads with answers rewritten by the proxy); unsigned or wrongly signed ones are refused
  by the broker, not by the proxy.
* ``[acl] topics``: the proxy's own per-AccessKey allowlist refuses, with NO_PERMISSION and a
  remark, what the broker would allow; it follows a SIGHUP reload.
"""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from itutil import (
    BOUND,
    NO_PERMISSION,
    connect,
    drive,
    log_records,
    proxy_broker_endpoint,
    read_frame,
    unique,
    wait_metric,
    wait_until,
)

from rmqfast.codec import codes as C
from rmqfast.testing import ClusterError, JarPaths, RocketMQCluster
from rmqfast.testing.javaclient import Client
from rmqfast.testing.proxy import ProxyProcess
from rmqfast.testing.remoting import remoting_request

pytestmark = pytest.mark.integration

ALICE = ("alice", "alice-secret")
BOB = ("bob", "bob-secret")
COUNT = 8


def creds(c: tuple[str, str]) -> dict[str, str]:
    return {"access_key": c[0], "secret_key": c[1]}


@pytest.fixture(scope="module")
def acl_cluster(jars: JarPaths) -> Iterator[RocketMQCluster]:
    """Broker ACL: alice may publish and subscribe every topic, bob only AclB; both every group."""
    with RocketMQCluster(jars=jars, acl=True) as c:
        c.create_user(*ALICE)
        c.create_user(*BOB)
        c.grant(ALICE[0], ["Topic:*", "Group:*"])
        c.grant(BOB[0], ["Topic:AclB", "Group:*"])
        for t in ("AclA1", "AclB"):
            c.create_topic(t, queues=2)
        yield c


@pytest.fixture(scope="module")
def acl_proxy(acl_cluster: RocketMQCluster) -> Iterator[ProxyProcess]:
    """No allowlist; read-only admin preset; every broker address in answers rewritten ("all")."""
    extra = '[policy]\npreset = "read-only-admin"\nmessage_addresses = "all"\n'
    with ProxyProcess([acl_cluster.namesrv_addr], extra_config=extra) as p:
        yield p


ALLOWLIST = '[acl]\ntopics = {{ alice = [{alice}], bob = ["AclB"] }}\n'


@pytest.fixture(scope="module")
def allowlist_proxy(acl_cluster: RocketMQCluster) -> Iterator[ProxyProcess]:
    """The proxy's allowlist: alice only AclA* (the broker lets her use every topic), bob AclB."""
    with ProxyProcess([acl_cluster.namesrv_addr], extra_config=ALLOWLIST.format(alice='"AclA*"')) as p:
        yield p


def adrive(scenario: str, namesrv: str, client: str, **options: Any) -> dict[str, Any]:
    """``drive`` with a 10 s client API timeout: route lookups of JVMs starting on a loaded machine."""
    options.setdefault("api_timeout_ms", 10000)
    return drive(scenario, namesrv, client, **options)


def failures(res: dict[str, Any]) -> list[str]:
    return [str(f.get("error")) for f in res["failed"]]


def received_once(res: dict[str, Any], count: int) -> None:
    assert res["ok"], {k: res.get(k) for k in ("error", "lost", "duplicates", "failed")}
    received = [d for d in res["consumed"]["received"] if d["run"] == res["run_id"]]
    acked = Counter(d["idx"] for d in received if d["acked"])
    assert sorted(acked) == list(range(count)) and set(acked.values()) == {1}, acked
    by_idx = {d["idx"]: d for d in received}
    for s in res["sent"]:
        assert by_idx[s["idx"]]["body_sha256"] == s["body_sha256"]


@pytest.mark.parametrize("client,consumer,mode", [("5", "push", "sync"), ("4", "push", "sync"),
                                                 ("5", "litepull", "sync"), ("5", "push", "batch"),
                                                 ("4", "push", "batch")])
def test_signed_clients_work_through_the_proxy(acl_proxy: ProxyProcess, acl_cluster: RocketMQCluster,
                                               client: Client, consumer: str, mode: str) -> None:
    """Signed sends (310, batches 320), pulls (11 / lite 361) and send-backs (36, every other
    message refused once by the push consumer) pass through unchanged: the broker verifies every
    signature."""
    topic = unique(f"AclA_rt{client}{consumer[0]}{mode[0]}")
    acl_cluster.create_topic(topic, queues=2)
    opts: dict[str, Any] = {"fail_every": 2, "retry_delay_level": 1} if consumer == "push" else {}
    res = adrive("roundtrip", acl_proxy.namesrv_addr, client, topic=topic, count=COUNT, mode=mode,
                consumer=consumer, timeout_ms=60000, settle_ms=500, timeout=120, **opts, **creds(ALICE))
    received_once(res, COUNT)
    if consumer == "push":
        retried = [d for d in res["consumed"]["received"] if d["acked"] and d["reconsume_times"] >= 1]
        assert retried, "no message came back through the retry topic"
    wait_metric(acl_proxy, "rmqfast_requests_total", 1, role="broker", code=str(C.PULL_MESSAGE if consumer == "push"
                                                                                else C.LITE_PULL_MESSAGE))
    if mode == "batch":
        wait_metric(acl_proxy, "rmqfast_requests_total", 1, role="broker", code=str(C.SEND_BATCH_MESSAGE))


@pytest.mark.parametrize("client", ["5", "4"])
def test_unsigned_and_wrong_secret_refused_by_the_broker(acl_proxy: ProxyProcess, client: Client) -> None:
    for extra in ({}, creds((ALICE[0], "not-the-secret"))):
        res = adrive("produce", acl_proxy.namesrv_addr, client, topic="AclA1", count=2, mode="sync", retries=0,
                    allow_failures=True, send_timeout_ms=15000, timeout=90, **extra)
        errs = failures(res)
        assert len(errs) == 2 and res["sent"] == [], res
        assert not any("rmqfast" in e for e in errs), errs  # the broker refused, not the proxy


def test_mqadmin_signed_reads_through_read_only_preset(acl_proxy: ProxyProcess, acl_cluster: RocketMQCluster) -> None:
    """mqadmin signs with tools.yml: topicStatus, consumerProgress and queryMsgById (whose
    VIEW_MESSAGE_BY_ID goes to the endpoint named in the rewritten offset id) work signed."""
    topic = unique("AclA_adm")
    acl_cluster.create_topic(topic, queues=2)
    res = adrive("roundtrip", acl_proxy.namesrv_addr, "5", topic=topic, count=4, mode="sync", consumer="push",
                timeout_ms=60000, settle_ms=500, timeout=120, **creds(ALICE))
    received_once(res, 4)
    status = acl_cluster.mqadmin("topicStatus", "-n", acl_proxy.namesrv_addr, "-t", topic)
    rows = [line for line in status.splitlines() if re.match(r"\s*broker-a\s+\d+\s+\d+\s+\d+", line)]
    assert len(rows) == 2 and sum(int(r.split()[3]) for r in rows) == 4, status
    s = res["sent"][0]
    out = acl_cluster.mqadmin("queryMsgById", "-n", acl_proxy.namesrv_addr, "-t", topic, "-i", s["offset_msg_id"])
    wait_metric(acl_proxy, "rmqfast_requests_total", 1, role="broker", code=str(C.VIEW_MESSAGE_BY_ID))
    assert re.search(rf"Topic:\s+{topic}", out), out
    # the same through a per-call tools.yml: with the admin's secret the rows are there, with a
    # wrong one the broker refuses mqadmin's requests (none of the topic's queues)
    again = acl_cluster.mqadmin("topicStatus", "-n", acl_proxy.namesrv_addr, "-t", topic,
                                credentials=acl_cluster.ADMIN)
    assert len([line for line in again.splitlines() if re.match(r"\s*broker-a\s+\d+\s+\d+\s+\d+", line)]) == 2
    try:
        refused = acl_cluster.mqadmin("topicStatus", "-n", acl_proxy.namesrv_addr, "-t", topic,
                                      credentials=(ALICE[0], "wrong"))
    except ClusterError as exc:  # mqadmin exits non-zero on some failures, prints them on others
        refused = str(exc)
    assert not [line for line in refused.splitlines() if re.match(r"\s*broker-a\s+\d+\s+\d+\s+\d+", line)], refused


def test_allowlist_refuses_what_the_broker_allows(allowlist_proxy: ProxyProcess, acl_cluster: RocketMQCluster) -> None:
    p = allowlist_proxy
    # alice: AclA* works through the proxy (5.3.3 client; sends and batches, checked in Python and
    # relayed byte for byte: the broker verifies their signatures)
    res = adrive("roundtrip", p.namesrv_addr, "5", topic="AclA1", count=4, mode="sync", consumer="push",
                timeout_ms=60000, settle_ms=500, timeout=120, **creds(ALICE))
    received_once(res, 4)
    res = adrive("roundtrip", p.namesrv_addr, "5", topic="AclA1", count=4, mode="batch", consumer="push",
                timeout_ms=60000, settle_ms=500, timeout=120, **creds(ALICE))
    received_once(res, 4)
    # AclB: the broker lets alice publish (straight to the cluster) ...
    direct = adrive("produce", acl_cluster.namesrv_addr, "5", topic="AclB", count=1, mode="sync", timeout=90,
                   **creds(ALICE))
    assert direct["sent_count"] == 1
    # ... the proxy does not, with a remark that says who, what and how to allow it (both clients)
    for client in ("5", "4"):
        res = adrive("produce", p.namesrv_addr, client, topic="AclB", count=2, mode="sync", retries=0,
                    allow_failures=True, timeout=90, **creds(ALICE))
        errs = failures(res)
        assert len(errs) == 2, res
        assert all("16" in e and "rmqfast: AccessKey 'alice' may not send to topic 'AclB'" in e for e in errs), errs
        assert all("acl.topics['alice']" in e for e in errs), errs
    # unsigned: refused by the proxy (acl.unsigned defaults to deny)
    res = adrive("produce", p.namesrv_addr, "4", topic="AclA1", count=1, mode="sync", retries=0,
                allow_failures=True, timeout=90)
    assert any("unsigned request (no AccessKey)" in e for e in failures(res)), res
    # bob (4.9.4 client) keeps AclB
    res = adrive("roundtrip", p.namesrv_addr, "4", topic="AclB", count=4, mode="sync", consumer="push",
                timeout_ms=60000, settle_ms=500, timeout=120, **creds(BOB))
    received_once(res, 4)
    wait_metric(p, "rmqfast_denied_requests_total", 1, role="broker", code=str(C.SEND_MESSAGE_V2))
    assert log_records(p, "request refused by the topic allowlist", access_key="alice", topic="AclB")


def test_allowlist_pulls_and_ambiguous_keys(allowlist_proxy: ProxyProcess) -> None:
    """Raw signed frames: bob may not pull AclA1; a header naming AccessKey twice is refused."""
    endpoint = proxy_broker_endpoint(allowlist_proxy, "AclA1")
    pull = {"consumerGroup": "g_acl", "topic": "AclA1", "queueId": 0, "queueOffset": 0, "maxMsgNums": 1,
            "sysFlag": 0, "commitOffset": 0, "suspendTimeoutMillis": 0, "subVersion": 0}
    r = remoting_request(endpoint, C.PULL_MESSAGE, pull, credentials=BOB, timeout=BOUND)
    assert r.code == NO_PERMISSION and "AccessKey 'bob' may not consume from topic 'AclA1'" in (r.remark or ""), r
    r = remoting_request(endpoint, C.PULL_MESSAGE, pull, credentials=ALICE, timeout=BOUND)
    assert r.code != NO_PERMISSION, (r.code, r.remark)  # the broker answered (found / not found)
    # {"AccessKey":"alice", ..., "AccessKey":"bob"}: fastjson and the proxy could disagree: refused
    ext = ('{"AccessKey":"alice","topic":"AclA1","queueId":"0","consumerGroup":"g","queueOffset":"0",'
           '"maxMsgNums":"1","sysFlag":"0","commitOffset":"0","suspendTimeoutMillis":"0","AccessKey":"bob",'
           '"Signature":"x"}')
    hdr = ('{"code":11,"extFields":' + ext + ',"flag":0,"language":"JAVA","opaque":77,'
           '"serializeTypeCurrentRPC":"JSON","version":453}').encode()
    with connect(endpoint, BOUND) as s:
        s.sendall(struct.pack(">ii", 4 + len(hdr), len(hdr)) + hdr)
        ans = read_frame(s)
    assert ans.code == NO_PERMISSION and "AccessKey more than once" in (ans.remark or ""), ans


def test_allowlist_follows_sighup(acl_cluster: RocketMQCluster, jars: JarPaths) -> None:
    with ProxyProcess([acl_cluster.namesrv_addr], extra_config=ALLOWLIST.format(alice='"AclA*"')) as p:
        res = adrive("produce", p.namesrv_addr, "5", topic="AclB", count=1, mode="sync", retries=0,
                    allow_failures=True, timeout=90, **creds(ALICE))
        assert res["sent"] == [] and "may not send to topic 'AclB'" in failures(res)[0]
        pids = p.worker_pids()
        p.config_path.write_text(p.config_path.read_text().replace('alice = ["AclA*"]', 'alice = ["AclA*", "AclB"]'))
        assert 'alice = ["AclA*", "AclB"]' in p.config_path.read_text()
        p.reload()
        wait_until(lambda: {r["pid"] for r in log_records(p, "configuration reloaded") if "worker" in r} >= set(pids),
                   BOUND, "both workers to log 'configuration reloaded'")
        res = adrive("produce", p.namesrv_addr, "5", topic="AclB", count=2, mode="sync", timeout=90, **creds(ALICE))
        assert res["sent_count"] == 2, res
        assert json.loads(p.get("/healthz")[1])["worker_pids"] == pids


def stored(cluster: RocketMQCluster, topic: str, queues: int, credentials: tuple[str, str] | None) -> int:
    """Messages ``cluster``'s broker holds for ``topic`` (GET_MAX_OFFSET of every queue)."""
    total = 0
    for q in range(queues):
        r = remoting_request(cluster.broker_addr, 30, {"topic": topic, "queueId": q}, credentials=credentials,
                             timeout=BOUND)
        assert r.code == 0, (r.code, r.remark)
        total += int(r.ext_fields.get("offset", 0))
    return total


def test_cross_cloud_copies_signed_with_the_proxys_own_credentials(acl_cluster: RocketMQCluster,
                                                                   jars: JarPaths) -> None:
    """A local cluster without ACL, the ACL cluster as the remote cloud: copies reach it only when
    ``[[clouds.remote]]`` gives the proxy credentials of its own there (a user allowed to publish)."""
    topic = unique("AclRepl")
    acl_cluster.create_user("rmqfast-proxy", "proxy-secret")
    acl_cluster.grant("rmqfast-proxy", [f"Topic:{topic}"], actions=("Pub",))
    acl_cluster.create_topic(topic, queues=2)

    def clouds(creds: str) -> str:
        return (f'[clouds]\nlocal = "local"\n[[clouds.remote]]\nname = "acl-cloud"\n'
                f'namesrv = ["{acl_cluster.namesrv_addr}"]\n{creds}'
                f'[replicate]\nretry_initial = 0.05\nretry_max = 0.5\n'
                f'[[replicate.topic]]\nname = "{topic}"\nreplicate = "always"\n')

    with RocketMQCluster(jars=jars, cluster_name="LocalCloud", broker_name="broker-l") as local:
        local.create_topic(topic, queues=2)
        # without credentials: the remote broker refuses the copies (they wait in the spill, retried)
        with ProxyProcess([local.namesrv_addr], extra_config=clouds("")) as p:
            res = adrive("produce", p.namesrv_addr, "5", topic=topic, count=3, mode="sync", timeout=90)
            assert res["sent_count"] == 3
            wait_metric(p, "rmqfast_deliver_retries_total", 3)
            assert stored(acl_cluster, topic, 2, acl_cluster.ADMIN) == 0
        # with them: every copy is stored (the 3 left in the spill by the first proxy need not be:
        # each proxy keeps its own state directory)
        creds = 'access_key = "rmqfast-proxy"\nsecret_key = "proxy-secret"\n'
        with ProxyProcess([local.namesrv_addr], extra_config=clouds(creds)) as p:
            res = adrive("produce", p.namesrv_addr, "4", topic=topic, count=10, mode="sync", timeout=90)
            assert res["sent_count"] == 10
            wait_until(lambda: stored(acl_cluster, topic, 2, acl_cluster.ADMIN) >= 10, BOUND,
                       "10 copies stored in the ACL cluster")
            assert stored(acl_cluster, topic, 2, acl_cluster.ADMIN) == 10
            assert stored(local, topic, 2, None) == 13

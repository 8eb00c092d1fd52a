"""The copy path (filter + replicator) against a fake deliver process on a real Unix socket and
a real RocksDB spill; the deliver side's request building."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import gevent
import pytest
from gevent import socket
from gevent.server import StreamServer

from rmqfast import config as config_mod
from rmqfast.clouds.send import build_request, with_origin
from rmqfast.codec import codes as C
from rmqfast.codec.batch import BatchEntry, decode_batch, encode_batch
from rmqfast.codec.command import RemotingCommand, decode_frame, encode, make_response
from rmqfast.codec.properties import format_properties, parse_properties
from rmqfast.deliver import protocol as P
from rmqfast.errors import ConfigError
from rmqfast.filters.api import Frame
from rmqfast.replicate.filter import ReplicateFilter
from rmqfast.replicate.replicator import Replicator
from rmqfast.spill.record import CopyRecord


class FakeSession:
    def __init__(self) -> None:
        self.role = "broker"
        self.client_addr = "127.0.0.1:1"
        self.upstream_addr = "127.0.0.1:2"
        self.state: dict[str, Any] = {}
        self.closed = False


class FakeDeliverer:
    """Accepts one worker link, records copies, acknowledges them when ``auto_ack``."""

    def __init__(self, path: Path, auto_ack: bool = True) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.auto_ack = auto_ack
        self.copies: list[tuple[int, str, CopyRecord]] = []
        self.conns: list[socket.socket] = []
        self.server = StreamServer(self.sock, self._handle)
        self.server.start()

    def _handle(self, s: socket.socket, _addr: Any) -> None:
        self.conns.append(s)
        reader = P.FrameReader()
        while True:
            try:
                data = s.recv(65536)
            except OSError:
                return
            if not data:
                return
            for kind, payload in reader.feed(data):
                if kind in (P.COPY, P.RESEND):
                    seq, remote, raw = P.parse_copy(memoryview(payload))
                    self.copies.append((seq, remote, CopyRecord.decode(raw)))
                    if self.auto_ack:
                        s.sendall(P.ack_frame(seq, P.ACK_DELIVERED))

    def drop_links(self) -> None:
        for c in self.conns:
            c.close()
        self.conns.clear()

    def close(self) -> None:
        self.server.close()


def make_cfg(tmp: Path, **replicate: Any) -> config_mod.Config:
    rules = replicate.pop("topics", [{"name": "T1", "replicate": "always"}])
    return config_mod.from_dict({
        "proxy": {"state_dir": str(tmp)},
        "namesrv": {"upstreams": ["127.0.0.1:9876"]},
        "clouds": {"local": "cloud-a", "remote": [{"name": "cloud-b", "namesrv": ["127.0.0.1:1"]}]},
        "replicate": {"topic": rules, **replicate},
    })


def send_frame(opaque: int, topic: str = "T1", idx: int = 0, tag: str = "TagA", code: int = C.SEND_MESSAGE_V2,
               extra_props: dict[str, str] | None = None, oneway: bool = False) -> Frame:
    props = format_properties({"UNIQ_KEY": f"U{idx}", "TAGS": tag, "idx": str(idx), **(extra_props or {})})
    if code == C.SEND_MESSAGE:
        ext = {"producerGroup": "PG", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "4",
               "queueId": str(idx % 4), "sysFlag": "0", "bornTimestamp": "1700000000000", "flag": "0",
               "properties": props, "reconsumeTimes": "0", "unitMode": "false"}
    else:
        ext = {"a": "PG", "b": topic, "c": "TBW102", "d": "4", "e": str(idx % 4), "f": "0", "g": "1700000000000",
               "h": "0", "i": props, "j": "0", "k": "false", "m": "false", "n": "broker-a"}
    cmd = RemotingCommand(code=code, opaque=opaque, flag=C.FLAG_ONEWAY if oneway else 0, ext_fields=ext,
                          body=f"body-{idx}".encode())
    return Frame(encode(cmd), code, cmd.flag, opaque)


def response(opaque: int, code: int = C.SUCCESS) -> Frame:
    r = encode(make_response(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=opaque), code, ext_fields={"a": "b"}))
    return Frame(r, code, C.FLAG_RESPONSE, opaque)


def wait_for(pred: Any, timeout: float = 5.0) -> None:
    with gevent.Timeout(timeout, AssertionError(f"condition not met within {timeout} s")):
        while not pred():
            gevent.sleep(0.01)


@pytest.fixture
def tmp() -> Any:
    # short path: a Unix socket path must fit 107 bytes
    with tempfile.TemporaryDirectory(prefix="rq") as d:
        yield Path(d)


@pytest.mark.parametrize("durability", ["fast", "durable"])
def test_acknowledged_send_is_copied_identically_and_deleted_after_delivery(tmp: Path, durability: str) -> None:
    cfg = make_cfg(tmp, durability=durability)
    fake = FakeDeliverer(P.socket_path(tmp, 0))
    rep = Replicator(cfg, 0)
    flt = ReplicateFilter(cfg, rep, None)
    rep.start()
    try:
        sess = FakeSession()
        for i in range(10):
            assert flt.on_request(sess, send_frame(100 + i, idx=i)) is None  # forwarded unchanged
        gevent.sleep(0.1)
        assert fake.copies == [], "copies left before the local broker answered"
        for i in range(10):
            flt.on_response(sess, response(100 + i))
        wait_for(lambda: len(fake.copies) == 10)
        assert [c[2].properties for c in fake.copies] == [
            send_frame(0, idx=i).command().ext_fields["i"] for i in range(10)  # type: ignore[index]
        ]
        rec = fake.copies[3][2]
        assert (rec.topic, rec.body, rec.queue_id, rec.producer_group, rec.broker_name) == (
            "T1", b"body-3", 3, "PG", "broker-a")
        assert {c[1] for c in fake.copies} == {"cloud-b"}
        wait_for(lambda: rep.store.messages == 0 and not rep.inflight)
        if durability == "durable":
            assert rep.store.synced_messages == 10  # each was committed before it was forwarded
    finally:
        rep.close()
        fake.close()


def test_refused_send_is_not_copied_and_v1_header_is_read(tmp: Path) -> None:
    cfg = make_cfg(tmp, durability="durable")
    fake = FakeDeliverer(P.socket_path(tmp, 0))
    rep = Replicator(cfg, 0)
    flt = ReplicateFilter(cfg, rep, None)
    rep.start()
    try:
        sess = FakeSession()
        flt.on_request(sess, send_frame(1, idx=1, code=C.SEND_MESSAGE))
        flt.on_request(sess, send_frame(2, idx=2, code=C.SEND_MESSAGE))
        flt.on_response(sess, response(1, C.SYSTEM_BUSY))  # the local broker refused: no copy
        flt.on_response(sess, response(2))
        wait_for(lambda: len(fake.copies) == 1)
        gevent.sleep(0.1)
        assert [c[2].body for c in fake.copies] == [b"body-2"]
        wait_for(lambda: rep.store.messages == 0)  # the refused one was deleted too
    finally:
        rep.close()
        fake.close()


def test_rules_tags_origin_and_defaults(tmp: Path) -> None:
    cfg = make_cfg(tmp, topics=[{"name": "T1", "replicate": "always", "tags": ["TagA"]},
                                {"name": "T3", "replicate": "never"}])
    rep = Replicator(cfg, 0)
    flt = ReplicateFilter(cfg, rep, None)
    try:
        sess = FakeSession()
        flt.on_request(sess, send_frame(1, idx=1, tag="TagB"))  # tag filtered out
        flt.on_request(sess, send_frame(2, topic="T3"))  # never
        flt.on_request(sess, send_frame(3, topic="OTHER"))  # default: never
        flt.on_request(sess, send_frame(4, extra_props={"RMQFAST_ORIGIN": "cloud-b"}))  # a copy: no loop
        assert rep.copied == 0
        assert rep.not_copied == {"copy_of_copy": 1}
        flt.on_request(sess, send_frame(5, idx=5))
        assert rep.copied == 1
    finally:
        rep.close()


def test_closed_session_releases_its_copies(tmp: Path) -> None:
    cfg = make_cfg(tmp)
    fake = FakeDeliverer(P.socket_path(tmp, 0))
    rep = Replicator(cfg, 0)
    flt = ReplicateFilter(cfg, rep, None)
    rep.start()
    try:
        sess = FakeSession()
        flt.on_request(sess, send_frame(1, idx=1))
        gevent.sleep(0.1)
        assert fake.copies == []
        sess.closed = True  # the producer went away before the answer: deliver at least once
        assert flt.sweep() == 1
        wait_for(lambda: len(fake.copies) == 1)
    finally:
        rep.close()
        fake.close()


def test_fast_mode_spills_beyond_the_channel_and_keeps_order_across_a_lost_link(tmp: Path) -> None:
    cfg = make_cfg(tmp, channel_size=5, max_in_flight=3)
    fake = FakeDeliverer(P.socket_path(tmp, 0), auto_ack=False)
    rep = Replicator(cfg, 0)
    flt = ReplicateFilter(cfg, rep, None)
    rep.start()
    try:
        sess = FakeSession()
        for i in range(30):
            flt.on_request(sess, send_frame(i, idx=i))
            flt.on_response(sess, response(i))
        assert rep.store.messages == 25, "beyond 5 copies in memory, the rest is spilled"
        backlog = rep.backlog()[("cloud-b", "T1")]
        assert backlog[0] == 30 and backlog[2] is not None
        wait_for(lambda: len(fake.copies) == 3)  # window of 3
        fake.drop_links()  # the deliver process dies with 3 copies unacknowledged
        fake.auto_ack = True
        wait_for(lambda: rep.store.messages == 0 and rep.mem_count == 0, 10)
        seen = [int(c[2].body.split(b"-")[1]) for c in fake.copies]
        # first 3 sent twice (resent after the lost link), then everything in order
        assert seen[:3] == [0, 1, 2] and seen[3:] == list(range(30))
    finally:
        rep.close()
        fake.close()


def test_restart_resumes_spilled_copies(tmp: Path) -> None:
    cfg = make_cfg(tmp, durability="durable")
    rep = Replicator(cfg, 0)
    flt = ReplicateFilter(cfg, rep, None)
    sess = FakeSession()
    for i in range(7):
        flt.on_request(sess, send_frame(i, idx=i))  # no answer yet: the worker stops
    rep.close()  # a graceful stop still syncs the queued commits
    fake = FakeDeliverer(P.socket_path(tmp, 0))
    rep2 = Replicator(cfg, 0)
    rep2.start()
    try:
        wait_for(lambda: len(fake.copies) == 7)
        assert [c[2].body for c in fake.copies] == [f"body-{i}".encode() for i in range(7)]
        wait_for(lambda: rep2.store.messages == 0)
    finally:
        rep2.close()
        fake.close()


@pytest.mark.parametrize("policy", ["reject", "drop"])
def test_disk_cap_policy(tmp: Path, policy: str) -> None:
    cfg = make_cfg(tmp, durability="durable", disk_cap_bytes=1 << 20, on_disk_full=policy)
    rep = Replicator(cfg, 0)
    rep.store.disk_cap_bytes = 600  # a few copies
    flt = ReplicateFilter(cfg, rep, None)
    try:
        sess = FakeSession()
        verdicts = [flt.on_request(sess, send_frame(i, idx=i)) for i in range(10)]
        wait_for(lambda: rep.store.messages >= rep.copied, timeout=30)  # the queued group commit is done
        stored = rep.store.messages
        assert 0 < stored < 10
        if policy == "reject":
            refused = [v for v in verdicts if v is not None]
            assert len(refused) == 10 - stored
            answer = decode_frame(refused[0].data)
            assert answer.code == C.SYSTEM_BUSY and "replicate.disk_cap_bytes" in (answer.remark or "")
        else:
            assert all(v is None for v in verdicts)
            assert rep.not_copied == {"disk_full": 10 - stored}
    finally:
        rep.close()


def test_remote_request_keeps_the_message_and_marks_its_origin() -> None:
    props = format_properties({"UNIQ_KEY": "U1", "TAGS": "A"})
    rec = CopyRecord(topic="T", body=b"xyz", properties=props, queue_id=6, sys_flag=1, born_timestamp=5, flag=3)
    code, ext, body = build_request(rec, "broker-b", 2, "cloud-a")
    assert code == 310 and body == b"xyz"
    assert (ext["b"], ext["e"], ext["f"], ext["g"], ext["h"], ext["n"], ext["m"]) == (
        "T", "2", "1", "5", "3", "broker-b", "false")
    assert parse_properties(ext["i"]) == {"UNIQ_KEY": "U1", "TAGS": "A", "RMQFAST_ORIGIN": "cloud-a"}
    assert with_origin(ext["i"], "x") == ext["i"]  # never marked twice
    batch = encode_batch([BatchEntry(body=b"a", properties={"UNIQ_KEY": "1"}),
                          BatchEntry(body=b"b", properties={"UNIQ_KEY": "2"})])
    code, ext, body = build_request(CopyRecord(topic="T", body=batch, kind=1), "b", 0, "cloud-a")
    assert code == 320 and ext["m"] == "true"
    assert [e.properties for e in decode_batch(body)] == [
        {"UNIQ_KEY": "1", "RMQFAST_ORIGIN": "cloud-a"}, {"UNIQ_KEY": "2", "RMQFAST_ORIGIN": "cloud-a"}]


def test_config_errors_name_the_key() -> None:
    base = {"namesrv": {"upstreams": ["127.0.0.1:9876"]}}
    with pytest.raises(ConfigError, match=r"clouds.remote\[0\]: both 'name' and 'namesrv'"):
        config_mod.from_dict({**base, "clouds": {"remote": [{"name": "b"}]}})
    with pytest.raises(ConfigError, match=r'replicate.durability: "sync" is not allowed'):
        config_mod.from_dict({**base, "replicate": {"durability": "sync"}})
    with pytest.raises(ConfigError, match=r'replicate.topic\[0\].replicate: "maybe"'):
        config_mod.from_dict({**base, "replicate": {"topic": [{"name": "T", "replicate": "maybe"}]}})
    with pytest.raises(ConfigError, match=r'clouds.remote\[0\].name: "local" is the local cloud'):
        config_mod.from_dict({**base, "clouds": {"remote": [{"name": "local", "namesrv": "1.2.3.4:9876"}]}})


def test_durable_answers_wait_for_the_fsync_and_pipelined_sends_share_it(tmp: Path) -> None:
    """One connection pipelining 32 sends (the Java client multiplexes its threads): the sends are
    forwarded at once, the first answer waits for the synced commit, which covers all 32."""
    cfg = make_cfg(tmp, durability="durable")
    rep = Replicator(cfg, 0)
    flt = ReplicateFilter(cfg, rep, None)
    try:
        sess = FakeSession()
        for i in range(32):
            assert flt.on_request(sess, send_frame(i, idx=i)) is None  # forwarded without waiting
        assert rep.store.messages == 0  # nothing synced yet: the answers must wait
        assert flt.on_response(sess, response(0)) is None  # blocks this greenlet until synced
        assert rep.store.messages == 32, "the answer was released before its copy was on disk"
        for i in range(1, 32):
            flt.on_response(sess, response(i))
        assert rep.store.fsyncs == 1 and rep.store.synced_messages == 32
        assert not rep.commits and not rep.awaiting
    finally:
        rep.close()


def test_quick_topic_reads_json_headers_only() -> None:
    from rmqfast.proxy.quicktopic import quick_topic

    assert quick_topic(send_frame(1, topic="T9")) == "T9"
    assert quick_topic(send_frame(1, topic="Tx", code=C.SEND_MESSAGE)) == "Tx"
    binary = RemotingCommand(code=C.SEND_MESSAGE_V2, ext_fields={"b": "T9"}, serialize_type=C.SERIALIZE_ROCKETMQ)
    assert quick_topic(Frame(encode(binary), C.SEND_MESSAGE_V2, 0, 0)) is None  # decoded the slow way


def test_a_restarted_worker_starts_from_the_last_online_answers(tmp: Path) -> None:
    """A producer's retry after a worker crash lands on the restarted worker: it must copy at
    once, not skip the send until its first detection round."""
    from rmqfast.replicate import ReplicationService

    cfg = make_cfg(tmp, topics=[{"name": "T1", "replicate": "online"}])
    svc = ReplicationService(cfg, 0, metrics=False)
    assert svc.detector.online("cloud-b", "T1") is None
    svc.detector.cache[("cloud-b", "T1")] = True  # what a detection round does: cache, then report
    svc._online("cloud-b", "T1", True)
    svc.close()
    svc2 = ReplicationService(cfg, 0, metrics=False)
    try:
        assert svc2.detector.online("cloud-b", "T1") is True
        assert svc2.filter.targets("T1", None) == ["cloud-b"]
    finally:
        svc2.close()


@pytest.mark.parametrize("header", [
    # the topic written with spaces (fastjson and the scanner read it), a decoy in a nested object
    b'{"code":310,"flag":0,"opaque":1,"x":{"b":"decoy"},"extFields":{"a":"PG","b" : "T9","e":"0"}}',
    # a decoy in a top-level field the broker ignores
    b'{"code":310,"flag":0,"opaque":1,"b":"decoy","extFields":{"a":"PG","b":"T9","e":"0"}}',
    # the real key escaped, the decoy plain
    b'{"code":310,"flag":0,"opaque":1,"x":{"b":"decoy"},"extFields":{"a":"PG","\\u0062":"T9","e":"0"}}',
    b'{"code":310,"flag":0,"opaque":1,"x":{"b":"decoy"},"extFields":{"a":"PG","\\x62":"T9","e":"0"}}',
])
def test_quick_topic_is_unsure_when_a_decoy_could_hide_the_topic(header: bytes) -> None:
    from rmqfast.proxy.quicktopic import quick_topic

    data = (4 + len(header)).to_bytes(4, "big") + len(header).to_bytes(4, "big") + header
    assert quick_topic(Frame(data, C.SEND_MESSAGE_V2, 0, 1)) is None  # decoded the slow way


def test_a_deliver_process_gone_before_the_hello_is_connected_to_again(tmp: Path, monkeypatch: pytest.MonkeyPatch
                                                                       ) -> None:
    """The deliver process is killed between its accept and the worker's HELLO (the link resets on the
    HELLO): the worker tries again later instead of losing its feeder, and copies reach the next one."""
    cfg = make_cfg(tmp, durability="durable")
    fake = FakeDeliverer(P.socket_path(tmp, 0))
    rep = Replicator(cfg, 0)
    flt = ReplicateFilter(cfg, rep, None)
    real_sendall = socket.socket.sendall
    resets = [1]

    def sendall(self: Any, data: Any, *args: Any) -> Any:
        if resets and bytes(data[:64]).find(b'"pid"') >= 0:
            resets.pop()
            raise BrokenPipeError(32, "Broken pipe")
        return real_sendall(self, data, *args)

    monkeypatch.setattr(socket.socket, "sendall", sendall)
    assert rep._connect() is False and not resets  # the reset HELLO: no link, no exception
    rep.start()
    try:
        sess = FakeSession()
        flt.on_request(sess, send_frame(1, idx=1))
        flt.on_response(sess, response(1))
        wait_for(lambda: len(fake.copies) == 1)
    finally:
        rep.close()
        fake.close()

"""Proxy-held delayed messages: semantics, the due-ordered store, the filter and releaser in
process against a fake broker, and a real proxy process (kill -9, cancel, metrics)."""

from __future__ import annotations

import json
import os
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import gevent
import pytest
from gevent.server import StreamServer

from rmqfast.codec import codes as C
from rmqfast.codec.batch import BatchEntry, decode_batch, encode_batch
from rmqfast.codec.command import (
    SERIALIZE_JSON,
    SERIALIZE_ROCKETMQ,
    RemotingCommand,
    decode_frame,
    encode,
    make_response,
)
from rmqfast.config import ConfigError, from_dict
from rmqfast.delay.cancel import request_cancel
from rmqfast.delay.semantics import DelayInvalid, due_ms, strip_delay
from rmqfast.delay.service import HELD_QUEUE_OFFSET, MESSAGE_ILLEGAL, DelayService
from rmqfast.delay.settings import parse_delay
from rmqfast.delay.store import DelayStore, Held, StoreFull, due_key, split_due_key
from rmqfast.filters.api import Frame, Kind
from rmqfast.spill.record import CopyRecord
from rmqfast.spill.store import SpillStore

NS = {"namesrv": {"upstreams": ["127.0.0.1:9876"]}}


# Semantics ---------------------------------------------------------------------------------------

def test_due_time_of_each_property_and_the_brokers_order():
    now = 1_700_000_000_000
    assert due_ms({"TIMER_DELAY_SEC": "5"}, now, {}) == now + 5000
    assert due_ms({"TIMER_DELAY_MS": "1500"}, now, {}) == now + 1500
    assert due_ms({"TIMER_DELIVER_MS": str(now + 99)}, now, {}) == now + 99
    assert due_ms({"__STARTDELIVERTIME": str(now + 7)}, now, {}) == now + 7
    # seconds first, then milliseconds, then the absolute times (as HookUtils reads them)
    assert due_ms({"TIMER_DELIVER_MS": "1", "TIMER_DELAY_MS": "10", "TIMER_DELAY_SEC": "2"}, now, {}) == now + 2000
    assert due_ms({"TIMER_DELIVER_MS": "1", "TIMER_DELAY_MS": "10"}, now, {}) == now + 10
    # a level wins over the timer properties; only mapped levels are held
    assert due_ms({"DELAY": "3", "TIMER_DELAY_SEC": "9"}, now, {}) is None
    assert due_ms({"DELAY": "19", "TIMER_DELAY_SEC": "9"}, now, {19: 86_400_000}) == now + 86_400_000
    assert due_ms({"DELAY": "0", "TIMER_DELAY_SEC": "9"}, now, {}) == now + 9000
    # a message that went through a broker's timer already is not a request
    assert due_ms({"TIMER_OUT_MS": "1", "TIMER_DELIVER_MS": "5"}, now, {}) is None
    assert due_ms({"KEYS": "k"}, now, {}) is None
    with pytest.raises(DelayInvalid, match="TIMER_DELAY_SEC"):
        due_ms({"TIMER_DELAY_SEC": "soon"}, now, {})


@pytest.mark.parametrize("props", [{"TIMER_DELAY_SEC": " 5"}, {"TIMER_DELAY_SEC": "1_0"}, {"TIMER_DELAY_MS": "5 "},
                                   {"DELAY": " 19"}, {"DELAY": "2147483648"},
                                   {"TIMER_DELIVER_MS": "-99999999999999999999999"},
                                   {"TIMER_DELIVER_MS": "9223372036854775808"}, {"TIMER_DELAY_SEC": "+"}])
def test_values_java_cannot_parse_are_invalid_not_held(props):
    # Long.parseLong / Integer.parseInt take no blanks, no '_' and nothing out of range (Python's int
    # takes the first two and any size): the broker refuses these, so the proxy must not hold them
    with pytest.raises(DelayInvalid):
        due_ms(props, 1_700_000_000_000, {19: 10_000})


def test_values_java_parses_and_its_long_arithmetic():
    now = 1_700_000_000_000
    assert due_ms({"TIMER_DELAY_SEC": "+5"}, now, {}) == now + 5000
    assert due_ms({"TIMER_DELAY_MS": "-5"}, now, {}) == now - 5  # due already: delivered at once
    assert due_ms({"TIMER_DELIVER_MS": "\u0663"}, now, {}) == 3  # Character.digit reads any decimal digit
    # seconds * 1000 wraps in Java: the broker sees a time long past and stores at once
    assert due_ms({"TIMER_DELAY_SEC": "9223372036854776"}, now, {}) < now


def test_strip_keeps_everything_else_byte_for_byte():
    props = "KEYS\x01k1 k2\x02TIMER_DELAY_SEC\x015\x02UNIQ_KEY\x01AB\x02DELAY\x013\x02__STARTDELIVERTIME\x019\x02"
    assert strip_delay(props) == "KEYS\x01k1 k2\x02UNIQ_KEY\x01AB\x02"
    assert strip_delay("TIMER_DELIVER_MS\x011\x02") == ""
    assert strip_delay("a\x01b") == "a\x01b"  # no final separator: left as it was
    assert strip_delay("TIMER_DELAY_MS\x011\x02TIMER_DELAY_MS\x012\x02x\x01y\x02") == "x\x01y\x02"


def test_config_validation_names_every_bad_key():
    cfg = from_dict({**NS, "delay": {"topics": ["T1", "Delay*"], "max_delay": "400d", "levels": {"19": "1d"},
                                     "max_pending_bytes": 1 << 24}})
    assert cfg.delay.covers("T1") and cfg.delay.covers("Delay-x") and not cfg.delay.covers("T2")
    assert cfg.delay.level_ms() == {19: 86_400_000} and cfg.delay.max_delay_ms == 400 * 86_400_000
    with pytest.raises(ConfigError) as ei:
        from_dict({**NS, "delay": {"topics": "T1", "max_delay": "soon", "levels": {"x": "1d", "20": "9999d"},
                                   "max_pending_bytes": 5, "nope": 1}})
    text = str(ei.value)
    for key in ("delay.topics", "delay.max_delay", "delay.levels.x", "delay.levels.20", "delay.max_pending_bytes",
                "delay.nope"):
        assert key in text, text
    with pytest.raises(ConfigError, match=r"'\*' may only end a prefix"):
        parse_delay({"topics": ["a*b"]})


# The store ---------------------------------------------------------------------------------------

def held(msg_id: str, keys: str = "", topic: str = "T", addr: str = "127.0.0.1:1") -> Held:
    return Held(addr, msg_id, keys, CopyRecord(topic=topic, body=b"x" * 100, properties=f"UNIQ_KEY\x01{msg_id}\x02"))


def open_store(path: Path, cap: int = 1 << 30) -> tuple[SpillStore, DelayStore]:
    spill = SpillStore(path)
    return spill, DelayStore(spill.db, max_pending_bytes=cap, path=str(path))


def test_store_orders_by_due_time_caps_cancels_and_survives_a_reopen(tmp_path):
    spill, st = open_store(tmp_path / "db", cap=2000)
    base = 1_700_000_000_000
    dues = [base + d for d in (500, 100, 300, 100, 200, 400)]
    waits = []
    for i, d in enumerate(dues):
        _k, b = st.put(held(f"M{i}", keys=f"key{i} both"), d)
        waits.append(b)
    for b in waits:
        st.wait(b)
    assert st.fsyncs == 1 and st.messages == 6  # one group commit for all six
    counted = sum(len(k) + len(v) + sum(map(len, Held.decode(v).index_keys(k))) for k, v in st.scan())
    assert st.bytes == counted > sum(len(k) + len(v) for k, v in st.scan())  # the cancel index counts too
    got = st.read_due(b"d", base + 10_000, 100)
    order = [Held.decode(v).msg_id for _k, v in got]
    assert order == ["M1", "M3", "M4", "M2", "M5", "M0"]  # due order, ties in arrival order
    assert [split_due_key(k)[0] for k, _v in got] == sorted(dues)
    assert st.read_due(b"d", base + 250, 100)[-1][0] == got[2][0]  # only what is due
    assert st.next_due(got[2][0] + b"\x00") == base + 300
    # the cap: 6 messages of ~150 bytes are held; the next ones past 2000 bytes are refused
    with pytest.raises(StoreFull, match="max_pending_bytes"):
        for i in range(20):
            st.wait(st.put(held(f"N{i}"), base)[1])
    n_before = st.messages
    # cancel by msgId and by key finds the due keys through the index
    assert st.find(msg_id="M2") == [got[3][0]]
    assert len(st.find(key="both")) == 6 and st.find(key="key4") == [got[2][0]]
    v = st.get(got[3][0])
    st.delete(got[3][0], v)
    st.flush()
    assert st.find(msg_id="M2") == [] and st.messages == n_before - 1 and len(st.find(key="both")) == 5
    msgs, nbytes = st.messages, st.bytes
    st.close()
    spill.close()
    # reopen: counters come back from the meta key (no scan), sequence numbers keep growing
    spill, st = open_store(tmp_path / "db")
    assert (st.messages, st.bytes) == (msgs, nbytes)
    k, b = st.put(held("LATE"), base + 100)
    st.wait(b)
    ks = [kk for kk, _ in st.read_due(b"d", base + 100, 100)]
    assert ks[-1] == k and split_due_key(k)[1] > split_due_key(ks[0])[1]
    st.close()
    spill.close()


class StallingDb:
    """The spill database, whose next ``stalls`` writes RocksDB refuses as it refuses a write it
    would stall (``no_slowdown``); every refused write is recorded."""

    def __init__(self, db, stalls: int) -> None:
        self.db, self.stalls, self.refused = db, stalls, 0

    def write(self, wb, opts):
        if self.stalls > 0:
            self.stalls -= 1
            self.refused += 1
            raise Exception("Result incomplete: Write stall")
        return self.db.write(wb, opts)

    def __getattr__(self, name):
        return getattr(self.db, name)


def test_a_write_rocksdb_would_stall_is_written_once_the_stall_passes(tmp_path):
    spill = SpillStore(tmp_path / "db")
    db = StallingDb(spill.db, stalls=3)
    st = DelayStore(db, max_pending_bytes=1 << 20, path=str(tmp_path / "db"))
    base = 1_700_000_000_000
    waits = [st.put(held(f"S{i}", keys="k"), base + i)[1] for i in range(3)]
    for b in waits:
        st.wait(b)  # no WriteFailed: each refused write was made again
    assert db.refused == 3 and st.stalls == 3 and st.messages == 3 and st.fsyncs >= 1
    assert [Held.decode(v).msg_id for _k, v in st.read_due(b"d", base + 10, 10)] == ["S0", "S1", "S2"]
    st.close()
    spill.close()


def test_held_messages_decode_as_encoded_and_a_truncated_value_is_refused():
    rec = CopyRecord(topic="Delayed", body=b"\x00body\xff" * 9, properties="KEYS\x01a b\x02UNIQ_KEY\x01U1\x02",
                     queue_id=3, sys_flag=2, born_timestamp=1 << 41, flag=-4, reconsume_times=1,
                     max_reconsume_times=-1, broker_name="broker-ä", producer_group="PG", kind=1, created_ms=77)
    h = Held("10.0.0.1:10911", "U1", "a b", rec)
    v = h.encode()
    assert Held.decode(v) == h and Held.decode(memoryview(v)) == h
    for cut in (0, 1, 5, 20, 40, 60, len(v) - len(rec.body) - 1):
        with pytest.raises(Exception):  # noqa: B017 (the record's own decoder names what is wrong)
            Held.decode(v[:cut])


def test_due_keys_sort_as_due_times():
    ks = [due_key(d, s) for d, s in ((5, 9), (1 << 40, 0), (4, 10**12), (5, 10), (0, 0))]
    assert sorted(ks) == [due_key(0, 0), due_key(4, 10**12), due_key(5, 9), due_key(5, 10), due_key(1 << 40, 0)]


# The filter and the releaser in process ------------------------------------------------------------

UNIQ = "7F0000011A2B18B4AAC2123456780000"


def send_cmd(topic: str, opaque: int, props: dict[str, str], *, uniq: str | None = UNIQ, queue: int = 3,
             stype: int = SERIALIZE_JSON, code: int = C.SEND_MESSAGE_V2, body: bytes = b"hello",
             sys_flag: int = 0) -> RemotingCommand:
    allp = {**props, **({"UNIQ_KEY": uniq} if uniq else {})}
    p = "".join(f"{k}\x01{v}\x02" for k, v in allp.items())
    ext = {"a": "PG", "b": topic, "c": "TBW102", "d": "4", "e": str(queue), "f": str(sys_flag),
           "g": "1700000000000", "h": "0", "i": p, "j": "0", "k": "false", "l": "16",
           "m": "true" if code == C.SEND_BATCH_MESSAGE else "false", "n": "broker-a"}
    if code == C.SEND_MESSAGE:
        names = {"a": "producerGroup", "b": "topic", "c": "defaultTopic", "d": "defaultTopicQueueNums", "e": "queueId",
                 "f": "sysFlag", "g": "bornTimestamp", "h": "flag", "i": "properties", "j": "reconsumeTimes",
                 "k": "unitMode", "l": "maxReconsumeTimes", "m": "batch", "n": "bname"}
        ext = {names[k]: v for k, v in ext.items()}
    return RemotingCommand(code=code, opaque=opaque, version=473, ext_fields=ext, body=body, serialize_type=stype)


def frame_of(cmd: RemotingCommand) -> Frame:
    return Frame(encode(cmd), cmd.code, cmd.flag, cmd.opaque)


class FakeSession:
    role = "broker"
    client_addr = "127.0.0.1:5"

    def __init__(self, upstream: str) -> None:
        self.upstream_addr = upstream
        self.state: dict = {}


class GeventBroker:
    """A fake broker in this hub: records every send (arrival wall ms, properties), answers SUCCESS."""

    def __init__(self) -> None:
        self.got: list[tuple[int, RemotingCommand]] = []
        self.busy = False
        self.missing: set[str] = set()  # topics answered TOPIC_NOT_EXIST
        self.server = StreamServer(("127.0.0.1", 0), self._handle)
        self.server.start()
        self.addr = f"127.0.0.1:{self.server.server_port}"

    def _handle(self, sock: socket.socket, _addr: object) -> None:
        buf = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while len(buf) >= 4:
                (n,) = struct.unpack(">i", buf[:4])
                if len(buf) < 4 + n:
                    break
                cmd = decode_frame(buf[: 4 + n])
                buf = buf[4 + n :]
                code = C.SYSTEM_BUSY if self.busy else C.SUCCESS
                if (cmd.ext_fields or {}).get("b") in self.missing:
                    code = 17  # TOPIC_NOT_EXIST
                elif cmd.code == C.QUERY_MESSAGE:
                    code = 26
                elif not self.busy:
                    self.got.append((int(time.time() * 1000), cmd))
                try:
                    sock.sendall(encode(make_response(cmd, code, ext_fields={
                        "msgId": "X", "queueId": "0", "queueOffset": "1", "MSG_REGION": "R", "TRACE_ON": "true"})))
                except OSError:
                    return  # the releaser gave up on this connection (its request timed out), as with a real broker

    def props(self) -> list[dict[str, str]]:
        return [dict(p.split("\x01", 1) for p in (c.ext_fields or {}).get("i", "").split("\x02") if p)
                for _t, c in self.got]

    def close(self) -> None:
        self.server.stop()


def make_service(tmp_path: Path, **delay) -> tuple[DelayService, SpillStore]:
    cfg = parse_delay({"topics": ["Delayed", "D*"], **delay})
    spill = SpillStore(tmp_path / "spill")
    svc = DelayService(cfg, spill.db, 0, state_dir=str(tmp_path / "state"), path=str(spill.path), publish=False,
                       retry_initial=0.02, retry_max=0.05)
    svc.start()
    return svc, spill


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        gevent.sleep(0.01)


@pytest.mark.parametrize("stype", [SERIALIZE_JSON, SERIALIZE_ROCKETMQ], ids=["json", "rocketmq"])
def test_held_send_is_answered_like_a_broker_and_released_on_time_in_due_order(tmp_path, stype):
    broker = GeventBroker()
    svc, spill = make_service(tmp_path)
    sess = FakeSession(broker.addr)
    now = int(time.time() * 1000)
    # five messages, sent in an order that is not their due order
    # (relative delays count from each send's arrival, so A and B fall due after C, D and E however
    # slow the sends are; the absolute ones lie 5 s out, so all five are held before E is due even
    # when a loaded machine takes long over each synced write)
    plan = [("A", {"TIMER_DELAY_MS": "6500"}), ("B", {"TIMER_DELAY_SEC": "7"}),
            ("C", {"TIMER_DELIVER_MS": str(now + 5400)}), ("D", {"__STARTDELIVERTIME": str(now + 5700)}),
            ("E", {"TIMER_DELIVER_MS": str(now + 5000), "KEYS": "kE"})]
    answers = {}
    for i, (name, props) in enumerate(plan):
        cmd = send_cmd("Delayed", 10 + i, props, uniq=UNIQ[:-1] + name, stype=stype)
        v = svc.filter.on_request(sess, frame_of(cmd))
        assert v is not None and v.kind is Kind.REPLY
        answers[name] = decode_frame(v.data)
    for name, a in answers.items():
        assert a.code == C.SUCCESS and a.serialize_type == stype
        ext = a.ext_fields or {}
        assert ext["msgId"] == UNIQ[:-1] + name and ext["queueId"] == "3"
        assert int(ext["queueOffset"]) == HELD_QUEUE_OFFSET and ext["MSG_REGION"] == "DefaultRegion"
        assert "delayed" in (a.remark or "")
    assert broker.got == []  # nothing before its time
    wait_for(lambda: len(broker.got) == 5, 120, "five releases")
    props = broker.props()
    assert [p["UNIQ_KEY"][-1] for p in props] == ["E", "C", "D", "A", "B"]  # due order
    for p in props:  # the broker delivers at once: no delay property left; the rest kept
        assert not {"TIMER_DELAY_MS", "TIMER_DELAY_SEC", "TIMER_DELIVER_MS", "__STARTDELIVERTIME"} & set(p)
    assert props[0]["KEYS"] == "kE"
    expected = {"A": 6500, "B": 7000, "C": 5400, "D": 5700, "E": 5000}
    for (t, cmd), p in zip(broker.got, props, strict=True):
        due = now + expected[p["UNIQ_KEY"][-1]]
        assert t >= due - 5, (p["UNIQ_KEY"], t - due)  # never early (the send itself came a little after `now`)
        ext = cmd.ext_fields or {}
        assert ext["b"] == "Delayed" and ext["e"] == "3" and ext["a"] == "PG" and ext["n"] == "broker-a"
    # a bound for a stuck releaser only: lateness itself is measured by bench/delay_bench.py
    wait_for(lambda: svc.releaser.released == 5, 30, "the broker's answers read")  # stored before answered
    assert max(svc.releaser.lateness_ms) < 30000
    wait_for(lambda: svc.store.messages == 0, 10, "deletes written")
    svc.close()
    spill.close()
    broker.close()


def test_not_a_delay_topic_or_no_delay_passes_and_refusals_are_clear(tmp_path):
    broker = GeventBroker()
    svc, spill = make_service(tmp_path, max_delay="1h", max_pending_bytes=1 << 20)
    sess = FakeSession(broker.addr)
    f = svc.filter
    assert f.on_request(sess, frame_of(send_cmd("Other", 1, {"TIMER_DELAY_SEC": "5"}))) is None
    assert f.on_request(sess, frame_of(send_cmd("Delayed", 2, {"KEYS": "x"}))) is None
    assert f.on_request(sess, frame_of(send_cmd("Delayed", 3, {"DELAY": "3"}))) is None  # broker levels: broker
    signed = send_cmd("Delayed", 7, {"TIMER_DELAY_SEC": "5"})
    signed.ext_fields = {**signed.ext_fields, "AccessKey": "alice", "Signature": "c2lnbmVk"}
    assert f.on_request(sess, frame_of(signed)) is None  # signed: the broker's own delay, not held
    assert svc.signed_passed == 1 and svc.store.messages == 0
    a = decode_frame(f.on_request(sess, frame_of(send_cmd("Delayed", 4, {"TIMER_DELAY_SEC": "7200"}))).data)
    assert a.code == MESSAGE_ILLEGAL and "delay.max_delay" in a.remark
    a = decode_frame(f.on_request(sess, frame_of(send_cmd("Delayed", 5, {"TIMER_DELAY_SEC": "x"}))).data)
    assert a.code == MESSAGE_ILLEGAL and "TIMER_DELAY_SEC" in a.remark
    a = decode_frame(f.on_request(sess, frame_of(send_cmd("Delayed", 8, {"TIMER_DELAY_SEC": "5"},
                                                           body=b"x" * (4 * 1024 * 1024 + 1)))).data)
    assert a.code == MESSAGE_ILLEGAL and "maxMessageSize" in a.remark  # the broker would refuse it after SUCCESS
    long_props = {"TIMER_DELAY_SEC": "5", "p": "v" * 33000}
    a = decode_frame(f.on_request(sess, frame_of(send_cmd("Delayed", 9, long_props))).data)
    assert a.code == MESSAGE_ILLEGAL and "properties" in a.remark
    a = decode_frame(f.on_request(sess, frame_of(send_cmd("Delayed", 6, {"TIMER_DELAY_SEC": "5"}, sys_flag=4))).data)
    assert a.code == MESSAGE_ILLEGAL and "transaction" in a.remark
    # a full store: later delayed sends are refused, the ones held stay
    big = b"z" * 200_000
    codes = [decode_frame(f.on_request(sess, frame_of(send_cmd("Delayed", 10 + i, {"TIMER_DELAY_SEC": "600"},
                                                                uniq=f"{UNIQ[:-2]}{i:02d}", body=big))).data)
             for i in range(8)]
    ok = [c for c in codes if c.code == C.SUCCESS]
    full = [c for c in codes if c.code == C.SYSTEM_BUSY]
    assert len(ok) == 5 and len(full) == 3 and "max_pending_bytes" in full[0].remark
    assert svc.store.messages == 5
    # v1 header (SEND_MESSAGE) and a send without UNIQ_KEY: held with a msgId made up
    a = decode_frame(f.on_request(sess, frame_of(send_cmd("D1", 30, {"TIMER_DELAY_MS": "10"}, uniq=None,
                                                           code=C.SEND_MESSAGE))).data)
    assert a.code == C.SUCCESS and len(a.ext_fields["msgId"]) == 32
    wait_for(lambda: len(broker.got) == 1, 20, "the v1 send released")
    assert broker.props()[0]["UNIQ_KEY"] == a.ext_fields["msgId"]
    svc.close()
    spill.close()
    broker.close()


def test_batch_is_held_whole_until_its_latest_due_time(tmp_path):
    broker = GeventBroker()
    svc, spill = make_service(tmp_path)
    entries = [BatchEntry(body=b"b%d" % i, properties={"UNIQ_KEY": f"U{i}", "TIMER_DELAY_MS": str(200 + 100 * i)})
               for i in range(3)]
    cmd = send_cmd("Delayed", 1, {}, uniq=None, code=C.SEND_BATCH_MESSAGE, body=encode_batch(entries))
    t0 = int(time.time() * 1000)
    a = decode_frame(svc.filter.on_request(FakeSession(broker.addr), frame_of(cmd)).data)
    assert a.code == C.SUCCESS and a.ext_fields["msgId"] == "U0,U1,U2"
    wait_for(lambda: len(broker.got) == 1, 20, "the batch released")
    t, got = broker.got[0]
    assert got.code == C.SEND_BATCH_MESSAGE and t >= t0 + 400
    out = decode_batch(got.body)
    assert [e.properties for e in out] == [{"UNIQ_KEY": f"U{i}"} for i in range(3)]
    svc.close()
    spill.close()
    broker.close()


def test_cancel_by_msg_id_and_key_and_restart_resumes(tmp_path):
    broker = GeventBroker()
    svc, spill = make_service(tmp_path)
    sess = FakeSession(broker.addr)
    for i in range(6):
        cmd = send_cmd("Delayed", i, {"TIMER_DELAY_MS": str(1500 + 10 * i), "KEYS": f"order-{i} all"},
                       uniq=f"{UNIQ[:-2]}{i:02d}")
        assert decode_frame(svc.filter.on_request(sess, frame_of(cmd)).data).code == C.SUCCESS
    # cancel through the request files every worker answers (what the admin endpoint and CLI write)
    res = {}

    def cancel(**kw):
        res.update(request_cancel(tmp_path / "state", workers=1, timeout=10, **kw))

    th = threading.Thread(target=cancel, kwargs={"msg_id": f"{UNIQ[:-2]}01"})
    th.start()
    wait_for(lambda: not th.is_alive(), 15, "the cancel answer")
    assert res["complete"] and res["cancelled"] == [f"{UNIQ[:-2]}01"]
    r2 = svc.cancel(key="order-4")
    assert r2["cancelled"] == [f"{UNIQ[:-2]}04"]
    assert svc.cancel(key="order-4")["cancelled"] == []
    assert svc.store.messages == 4
    # stop (a crash keeps the same data: writes were synced before the answers) and start again
    svc.close()
    spill.close()
    svc, spill = make_service(tmp_path)
    assert svc.store.messages == 4
    wait_for(lambda: len(broker.got) == 4, 20, "the other four released after the restart")
    assert [p["UNIQ_KEY"][-2:] for p in broker.props()] == ["00", "02", "03", "05"]
    svc.close()
    spill.close()
    broker.close()


# A real proxy process ------------------------------------------------------------------------------

class QueryBroker(socketserver.ThreadingTCPServer):
    """A threaded fake broker: records each send (arrival wall ms, UNIQ_KEY), answers SUCCESS after
    ``delay`` s, and answers QUERY_MESSAGE by UNIQ_KEY from what it stored (as a broker's index does)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, delay: float = 0.0) -> None:
        self.got: list[tuple[int, str]] = []
        self.queries = 0
        self.delay = delay
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _QueryHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def keys(self) -> list[str]:
        with self.lock:
            return [k for _t, k in self.got]


class _QueryHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: QueryBroker = self.server  # type: ignore[assignment]
        f = self.request.makefile("rb")
        while True:
            head = f.read(4)
            if len(head) < 4:
                return
            (n,) = struct.unpack(">i", head)
            cmd = decode_frame(head + f.read(n))
            ext = cmd.ext_fields or {}
            body = b""
            code = C.SUCCESS
            if cmd.code == C.SEND_MESSAGE_V2:
                props = dict(p.split("\x01", 1) for p in ext["i"].split("\x02") if p)
                if srv.delay:
                    time.sleep(srv.delay)
                with srv.lock:
                    srv.got.append((int(time.time() * 1000), props["UNIQ_KEY"]))
            elif cmd.code == C.QUERY_MESSAGE:
                with srv.lock:
                    srv.queries += 1
                    found = ext.get("key") in {k for _t, k in srv.got}
                code = C.SUCCESS if found else 26
                body = b"...UNIQ_KEY\x01" + ext.get("key", "").encode() + b"\x02..." if found else b""
            self.request.sendall(encode(make_response(cmd, code, body=body, ext_fields={
                "msgId": "OFFSETID", "queueId": "3", "queueOffset": "7", "MSG_REGION": "R", "TRACE_ON": "true"})))


def pipelined(port: int, cmds: list[RemotingCommand]) -> list[RemotingCommand]:
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(b"".join(encode(c) for c in cmds))
        f = s.makefile("rb")
        out = []
        for _ in cmds:
            head = f.read(4)
            out.append(decode_frame(head + f.read(struct.unpack(">i", head)[0])))
        return out


def metric(p, name: str) -> float:
    return sum(v for (n, _lab), v in p.metrics().items() if n == name)


@pytest.mark.parametrize("env", [{}, {"RMQFAST_NO_EXTENSIONS": "1"}], ids=["compiled", "pure-python"])
def test_proxy_holds_releases_cancels_and_a_killed_worker_loses_nothing(tmp_path, env):
    from rmqfast.testing.proxy import ProxyProcess

    broker = QueryBroker()

    def extra(p: ProxyProcess) -> str:
        return f"""
[[brokers.static]]
listen = "127.0.0.1:{p.static_ports[0]}"
upstream = "127.0.0.1:{broker.server_address[1]}"

[delay]
topics = ["Delayed"]
"""
    with ProxyProcess([f"127.0.0.1:{broker.server_address[1]}"], workers=2, extra_config=extra, env=env,
                      static_endpoints=1) as p:
        port = p.static_ports[0]
        n_conn, per_conn = 6, 50
        t0 = int(time.time() * 1000)
        due = {}
        answers = []
        ths = []

        def one(c: int) -> None:
            cmds = []
            for i in range(per_conn):
                k = f"{UNIQ[:-6]}{c:02d}{i:04d}"
                at = t0 + 15000 + 10 * i  # 15 s out (the cancels before must finish first on a loaded machine)
                due[k] = at
                cmds.append(send_cmd("Delayed", i + 1, {"TIMER_DELIVER_MS": str(at), "KEYS": f"k-{k}"}, uniq=k))
            answers.extend(pipelined(port, cmds))

        for c in range(n_conn):
            ths.append(threading.Thread(target=one, args=(c,)))
            ths[-1].start()
        for th in ths:
            th.join(120)
        assert len(answers) == n_conn * per_conn
        assert all(a.code == C.SUCCESS and a.ext_fields["queueOffset"] == "-1" for a in answers), \
            {(a.code, a.remark) for a in answers}
        # cancel two before they are due: by msgId over the admin endpoint (the CLI), and by key
        victim = f"{UNIQ[:-6]}030007"
        cli = [sys.executable, "-m", "rmqfast", "delay", "cancel", "--admin", p.admin_url]
        out = subprocess.run([*cli, "--msg-id", victim], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout)
        assert res["cancelled"] == [victim] and res["complete"], res
        victim2 = f"{UNIQ[:-6]}010049"
        req = urllib.request.Request(f"{p.admin_url}/delay/cancel?key=k-{victim2}", data=b"", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["cancelled"] == [victim2]
        # the metrics are published every second: wait for the cancels to show (a very loaded machine may
        # reach the due times before this: those are released, not pending)
        wait_for(lambda: metric(p, "rmqfast_delay_cancelled_total") == 2 and
                 metric(p, "rmqfast_delay_pending_messages") + metric(p, "rmqfast_delay_released_total") ==
                 n_conn * per_conn - 2, 60, "the cancels in the metrics")
        # kill -9 every worker while all of it is pending; the restarted workers release it
        pids = p.worker_pids()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        expected = set(due) - {victim, victim2}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(set(broker.keys())) < len(expected):
            time.sleep(0.1)
        with broker.lock:
            got = list(broker.got)
        keys = [k for _t, k in got]
        assert set(keys) == expected
        assert len(keys) == len(expected), "duplicates: " + str(len(keys) - len(set(keys)))
        early = [(k, due[k] - t) for t, k in got if t < due[k]]
        assert not early, early
        assert not set(p.worker_pids()) & set(pids)
        # due order per connection's queue (every send used queue 3 of one broker: one lane per worker)
        for c in range(n_conn):
            mine = [k for k in keys if k[-6:-4] == f"{c:02d}"]
            assert mine == sorted(mine, key=lambda k: due[k])
        def settled() -> bool:  # pending, released and lateness are published every second
            return (metric(p, "rmqfast_delay_pending_messages"), metric(p, "rmqfast_delay_released_total"),
                    metric(p, "rmqfast_delay_lateness_seconds_count")) == (0, len(expected), len(expected))
        wait_for(settled, 60, "no message pending and every release in the metrics")
    broker.shutdown()


def test_a_worker_killed_mid_release_sends_nothing_twice(tmp_path):
    """2000 messages due at once on a slow broker; kill -9 during the release: the restarted worker asks
    the broker (QUERY_MESSAGE by UNIQ_KEY) about what the dead one had in flight."""
    from rmqfast.testing.proxy import ProxyProcess

    broker = QueryBroker(delay=0.002)

    def extra(p: ProxyProcess) -> str:
        return f"""
[[brokers.static]]
listen = "127.0.0.1:{p.static_ports[0]}"
upstream = "127.0.0.1:{broker.server_address[1]}"

[delay]
topics = ["Delayed"]
"""
    with ProxyProcess([f"127.0.0.1:{broker.server_address[1]}"], workers=1, extra_config=extra,
                      static_endpoints=1) as p:
        at = int(time.time() * 1000) + 3000
        cmds = [send_cmd("Delayed", i + 1, {"TIMER_DELIVER_MS": str(at)}, uniq=f"{UNIQ[:-5]}{i:05d}", queue=i % 4)
                for i in range(2000)]
        answers = pipelined(p.static_ports[0], cmds)
        assert all(a.code == C.SUCCESS for a in answers)
        while len(broker.keys()) < 300:  # mid-release
            time.sleep(0.01)
        os.kill(p.worker_pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(set(broker.keys())) < 2000:
            time.sleep(0.1)
        keys = broker.keys()
        assert len(set(keys)) == 2000
        assert len(keys) == 2000, f"{len(keys) - len(set(keys))} duplicates"
        assert broker.queries > 0  # the restarted worker asked before sending again
        assert all(t >= at for t, _k in broker.got)
    broker.shutdown()


def test_queue_window_releases_pipelined_and_everything_once(tmp_path):
    broker = GeventBroker()
    svc, spill = make_service(tmp_path, queue_window=16)
    sess = FakeSession(broker.addr)
    at = int(time.time() * 1000) + 300
    for i in range(200):
        cmd = send_cmd("Delayed", i, {"TIMER_DELIVER_MS": str(at + i)}, uniq=f"{UNIQ[:-3]}{i:03d}", queue=i % 3)
        assert decode_frame(svc.filter.on_request(sess, frame_of(cmd)).data).code == C.SUCCESS
    broker.busy = True  # the first windows are refused: each message is then sent again on its own
    gevent.sleep(max(0, (at - time.time() * 1000) / 1000) + 0.2)
    broker.busy = False
    wait_for(lambda: len(broker.got) >= 200, 30, "200 releases")
    gevent.sleep(0.2)
    keys = [p["UNIQ_KEY"] for p in broker.props()]
    assert sorted(keys) == [f"{UNIQ[:-3]}{i:03d}" for i in range(200)]  # each once
    assert all(t >= at for t, _c in broker.got)
    svc.close()
    spill.close()
    broker.close()


def test_release_frame_carries_the_producers_fields_and_answers_are_read_in_both_forms():
    from rmqfast.clouds.send import build_request
    from rmqfast.delay.channel import parse_answer, release_frame

    rec = CopyRecord(topic="Delayed", body=b"\x00body", properties="KEYS\x01k \"q\"\x02UNIQ_KEY\x01U\u00e9\x02",
                     queue_id=3, sys_flag=1, born_timestamp=1_700_000_000_123, flag=7, broker_name="broker-a",
                     producer_group="PG")
    got = decode_frame(release_frame(rec, 77))
    code, ext, body = build_request(rec, rec.broker_name, rec.queue_id, None)
    assert (got.code, got.opaque, got.serialize_type, got.ext_fields, got.body) == (
        code, 77, SERIALIZE_ROCKETMQ, ext, body)
    tricky = {"code": "0", "opaque": "5", "x": 'a","code":0,"opaque":9,"flag":1,"'}
    for stype in (SERIALIZE_JSON, SERIALIZE_ROCKETMQ):
        req = RemotingCommand(code=310, opaque=41, serialize_type=stype)
        ok = encode(make_response(req, C.SUCCESS, ext_fields=tricky))
        busy = encode(make_response(req, C.SYSTEM_BUSY, "busy now", ext_fields=tricky))
        assert parse_answer(ok)[:3] == (41, 1, 0)
        assert parse_answer(busy) == (41, 1, C.SYSTEM_BUSY, "busy now")


def test_a_topic_the_broker_does_not_have_ends_as_a_dead_letter(tmp_path):
    broker = GeventBroker()
    broker.missing = {"Dgone"}
    svc, spill = make_service(tmp_path)
    sess = FakeSession(broker.addr)
    at = int(time.time() * 1000) + 100
    for i, topic in enumerate(("Dgone", "Delayed")):
        cmd = send_cmd(topic, i, {"TIMER_DELIVER_MS": str(at), "KEYS": f"k{i}"}, uniq=f"{UNIQ[:-1]}{i}")
        assert decode_frame(svc.filter.on_request(sess, frame_of(cmd)).data).code == C.SUCCESS
    wait_for(lambda: svc.releaser.dead_letters == 1 and svc.releaser.released == 1, 60, "a dead letter")
    svc.store.flush()
    assert [Held.decode(v).msg_id for _k, v in svc.store.dead_letters()] == [f"{UNIQ[:-1]}0"]
    assert svc.store.messages == 0 and svc.store.scan() == [] and svc.store.find(key="k0") == []
    assert [p["UNIQ_KEY"] for p in broker.props()] == [f"{UNIQ[:-1]}1"]
    svc.close()
    spill.close()
    broker.close()


class SilentBroker(GeventBroker):
    """A broker that accepts and reads, but answers nothing while ``hole`` is set (then as GeventBroker)."""

    def __init__(self) -> None:
        self.hole = True
        super().__init__()

    def _handle(self, sock: socket.socket, _addr: object) -> None:
        while self.hole:
            try:
                if not sock.recv(65536):
                    return
            except OSError:
                return
        super()._handle(sock, _addr)


def _held_service(tmp_path: Path) -> tuple[DelayService, SpillStore]:
    # a small read-ahead (release_in_flight 4: 8 messages per broker in its lanes, 16 in all), so a
    # handful of messages for a dead broker fill its share
    cfg = parse_delay({"topics": ["Delayed"], "release_in_flight": 4})
    spill = SpillStore(tmp_path / "spill")
    svc = DelayService(cfg, spill.db, 0, state_dir=str(tmp_path / "state"), path=str(spill.path), publish=False,
                       connect_timeout=0.5, request_timeout=0.5, retry_initial=0.02, retry_max=0.1)
    svc.start()
    return svc, spill


@pytest.mark.parametrize("dead", ["refused", "silent"])
def test_a_dead_broker_does_not_hold_up_the_others_and_gets_its_messages_once_back(tmp_path, dead):
    live = GeventBroker()
    silent = SilentBroker()
    refusing = socket.socket()  # bound, never listening: connections to it are refused
    refusing.bind(("127.0.0.1", 0))
    gone = silent.addr if dead == "silent" else f"127.0.0.1:{refusing.getsockname()[1]}"
    svc, spill = _held_service(tmp_path)
    at = int(time.time() * 1000) + 300
    n_gone, n_live = 60, 20
    for i in range(n_gone):  # all due before the live broker's: they are read first
        cmd = send_cmd("Delayed", i, {"TIMER_DELIVER_MS": str(at + i), "KEYS": f"g{i}"}, uniq=f"{UNIQ[:-4]}g{i:03d}")
        assert decode_frame(svc.filter.on_request(FakeSession(gone), frame_of(cmd)).data).code == C.SUCCESS
    for i in range(n_live):
        cmd = send_cmd("Delayed", 100 + i, {"TIMER_DELIVER_MS": str(at + 500 + i)}, uniq=f"{UNIQ[:-4]}l{i:03d}")
        assert decode_frame(svc.filter.on_request(FakeSession(live.addr), frame_of(cmd)).data).code == C.SUCCESS
    # the live broker gets its messages while the other one takes none (before: they waited behind it)
    wait_for(lambda: len(live.got) == n_live, 60, "the live broker's releases")
    assert [p["UNIQ_KEY"] for p in live.props()] == [f"{UNIQ[:-4]}l{i:03d}" for i in range(n_live)]
    r = svc.releaser
    assert r.parked_moves > 0 and r.held_for[gone] <= r.per_broker

    def only_the_dead_brokers_left() -> bool:
        # the broker has a message before the releaser reads its answer and deletes it: the
        # last live release may still be in the store for a moment on a loaded machine
        svc.store.flush()
        return svc.store.messages == n_gone

    wait_for(only_the_dead_brokers_left, 10, f"the store to hold the dead broker's {n_gone} messages only")
    # a message waiting in the dead broker's range is cancelled by its key
    assert svc.cancel(key="g50")["cancelled"] == [f"{UNIQ[:-4]}g050"]
    svc.store.flush()
    assert svc.store.messages == n_gone - 1
    # a restart while the broker is still away: the wait range is found again, counters exact
    svc.close()
    spill.close()
    svc, spill = _held_service(tmp_path)
    assert svc.store.messages == n_gone - 1
    assert any(svc.releaser.parked.values())
    # the broker comes back: every message once, in due order (one queue, queue_window 1)
    if dead == "silent":
        silent.hole = False
        back = silent
    else:
        svc.close()
        spill.close()
        refusing.close()
        back = GeventBroker()  # a new address: the held messages name the old one, so the test moves them
        _readdress(tmp_path, gone, back.addr)
        svc, spill = _held_service(tmp_path)
    want = [f"{UNIQ[:-4]}g{i:03d}" for i in range(n_gone) if i != 50]
    wait_for(lambda: len({p["UNIQ_KEY"] for p in back.props()}) == len(want), 90, "the returned broker's releases")
    wait_for(lambda: svc.store.messages == 0, 30, "the releases deleted")
    got = [p["UNIQ_KEY"] for p in back.props()]
    if dead == "refused":
        assert got == want  # nothing reached a broker before: each exactly once, in due order
    else:
        # sends the silent broker read and dropped were sent again after their timeout: at least once,
        # and the first arrival of each in due order
        first = list(dict.fromkeys(got))
        assert first == want
    assert not any(svc.releaser.parked.values())
    assert svc.store.read_parked(b"w", b"w", 10) == []
    assert len(live.got) == n_live
    svc.close()
    spill.close()
    for b in (live, silent, back):
        b.close()
    refusing.close()


def _readdress(tmp_path: Path, old: str, new: str) -> None:
    """Rewrite the broker address of every held message (wait ranges too) in a closed store."""
    from rmqfast.delay.store import DUE_PREFIX, PARK_PREFIX, parked_key

    spill = SpillStore(tmp_path / "spill")
    db = spill.db
    moves = []
    for prefix in (DUE_PREFIX, PARK_PREFIX):
        it = db.iter()
        it.seek(prefix)
        while it.valid() and it.key().startswith(prefix):
            moves.append((it.key(), it.value()))
            it.next()
    for k, v in moves:
        h = Held.decode(v)
        assert h.addr == old
        h.addr = new
        del db[k]
        nk = k if k[:1] == DUE_PREFIX else parked_key(new, k)
        db[nk] = h.encode()
    spill.close()


def test_stats_cli_shows_counts_waiting_messages_by_broker_and_dead_letters(tmp_path):
    from rmqfast.delay.store import parked_key

    spill, st = open_store(tmp_path / "state" / "spill" / "worker-0")
    base = 1_700_000_000_000
    keys = []
    for i in range(5):
        k, b = st.put(held(f"M{i}", addr="10.0.0.9:10911" if i < 3 else "127.0.0.1:1"), base + i)
        st.wait(b)
        keys.append(k)
    for k in keys[:2]:  # two wait for broker 10.0.0.9, as the releaser moves them
        st.park(k, parked_key("10.0.0.9:10911", k), st.get(k))
    st.dead_letter(keys[4], st.get(keys[4]), held("M4"))
    st.flush()
    assert st.messages == 4
    st.close()
    spill.close()
    out = subprocess.run([sys.executable, "-m", "rmqfast", "delay", "stats", "--state-dir", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["worker"] == "worker-0" and row["messages"] == 4
    assert row["waiting_for_broker"] == {"10.0.0.9:10911": 2}
    assert row["dead_letters"] == 1
    assert row["next_due_ms"] == base + 2


def test_brokers_going_away_and_back_at_random_lose_nothing_and_keep_queue_order(tmp_path):
    """Random schedule (fixed seed): three brokers (one always up, one answering SYSTEM_BUSY at
    times, one reading and answering nothing at times), a restart of the service and cancels in
    the middle.  In the end every message not cancelled reached its broker, none cancelled did,
    each queue's first arrivals are in due order, and the store is empty (no wait range left)."""
    import random

    rnd = random.Random(20261124)
    up, busy, silent = GeventBroker(), GeventBroker(), SilentBroker()
    silent.hole = False
    brokers = {b.addr: b for b in (up, busy, silent)}
    svc, spill = _held_service(tmp_path)
    now = int(time.time() * 1000)
    base = now + 1500
    plan = []  # (msg id, broker addr, queue, due)
    b = None
    for i in range(300):
        addr = rnd.choice(list(brokers))
        q, due = rnd.randrange(2), base + rnd.randrange(4000)
        mid = f"{UNIQ[:-4]}{i:04d}"
        rec = CopyRecord(topic="Delayed", body=b"x" * 64, properties=f"UNIQ_KEY\x01{mid}\x02KEYS\x01c{i}\x02",
                         queue_id=q, broker_name="b", producer_group="PG")
        _k, b = svc.store.put(Held(addr, mid, f"c{i}", rec), due)
        plan.append((mid, addr, q, due))
    svc.store.wait(b)
    all_put = int(time.time() * 1000)
    cancelled: set[str] = set()
    t_end = base + 4000
    restarted = False
    while int(time.time() * 1000) < t_end:
        busy.busy = rnd.random() < 0.6
        silent.hole = rnd.random() < 0.4
        for _ in range(3):  # cancel a few not due yet (a due one may be on its way: then not cancelled)
            mid, _a, _q, due = rnd.choice(plan)
            if due > int(time.time() * 1000) + 500 and mid not in cancelled:
                cancelled.update(svc.cancel(msg_id=mid)["cancelled"])
        if not restarted and int(time.time() * 1000) > base + 1500:
            restarted = True
            svc.close()
            spill.close()
            svc, spill = _held_service(tmp_path)
        gevent.sleep(0.25)
    busy.busy = False
    silent.hole = False
    assert restarted and cancelled
    wait_for(lambda: svc.store.messages == 0, 120, "every message released")
    svc.store.flush()
    assert svc.store.read_parked(b"w", b"w", 10) == [] and not any(svc.releaser.parked.values())
    for addr, br in brokers.items():
        got = [p["UNIQ_KEY"] for p in br.props()]
        want = {mid for mid, a, _q, _d in plan if a == addr and mid not in cancelled}
        assert set(got) == want, (addr, len(set(got)), len(want), sorted(set(got) ^ want)[:5])
        due_of = {mid: (q, d) for mid, a, q, d in plan if a == addr}
        for q in (0, 1):  # first arrivals per queue in due order (those due after every put was written)
            firsts = [m for m in dict.fromkeys(got) if due_of[m][0] == q and due_of[m][1] > all_put + 50]
            assert firsts == sorted(firsts, key=lambda m: (due_of[m][1], m)), (addr, q)
    print(f"cancelled {len(cancelled)}, moved to wait ranges {svc.releaser.parked_moves} (after the restart)")
    svc.close()
    spill.close()
    for br in brokers.values():
        br.close()

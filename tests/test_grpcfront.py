"""The gRPC front without brokers: descriptors, receipt handles, conversions, queue choice for a
message group, [grpc] settings, and pop with notify against scripted brokers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("grpc")

from rmqfast.codec import codes as C  # noqa: E402
from rmqfast.codec.command import RemotingCommand  # noqa: E402
from rmqfast.codec.store import StoreRecord, encode_records  # noqa: E402
from rmqfast.errors import ConfigError  # noqa: E402
from rmqfast.grpcfront import protos  # noqa: E402
from rmqfast.grpcfront.convert import (  # noqa: E402
    BadRequest,
    ReceiptHandle,
    attach_handles,
    send_properties,
    to_message,
)
from rmqfast.grpcfront.service import MessagingService, Route, _consistent_hash, _java_hash  # noqa: E402
from rmqfast.grpcfront.settings import GrpcSection, parse_grpc  # noqa: E402


@pytest.fixture(scope="module")
def pb() -> Any:
    return protos.load()


def test_descriptors_from_the_published_client(pb: Any) -> None:
    names = [m.name for m in pb.service.methods]
    assert pb.service.full_name == "apache.rocketmq.v2.MessagingService"
    for served in MessagingService.SERVED:
        assert served in names
    assert pb.Code.OK == 20000 and pb.Code.MESSAGE_NOT_FOUND == 40401
    # round trip through the wire form
    req = pb.ReceiveMessageRequest(batch_size=3)
    req.long_polling_timeout.seconds = 20
    assert pb.ReceiveMessageRequest.FromString(req.SerializeToString()).long_polling_timeout.seconds == 20


def test_receipt_handle_decode_renew_and_real_topic() -> None:
    h = ReceiptHandle.decode("5 1700000000000 30000 3 2 broker-b 1 7 12345")
    assert (h.start_offset, h.revive_qid, h.broker, h.queue_id, h.offset, h.commit_log_offset) == (5, 3, "broker-b",
                                                                                                   1, 7, 12345)
    assert h.real_topic("T", "G") == "%RETRY%G+T"
    assert ReceiptHandle.decode("5 1 2 3 1 b 1 7").real_topic("T", "G") == "%RETRY%G_T"
    assert ReceiptHandle.decode("5 1 2 3 0 b 1 7").real_topic("T", "G") == "T"
    assert h.renewed(1700000001000, 1000, 4) == "5 1700000001000 1000 4 2 broker-b 1 7 12345"
    for bad in ("", "1 2 3", "a b c d 0 b 1 7", "1 2 3 4 9 b 1 7", "1 2 3 4 0  1 7"):
        with pytest.raises(BadRequest) as ei:
            ReceiptHandle.decode(bad)
        assert ei.value.code == "INVALID_RECEIPT_HANDLE"


def test_pop_handles_from_offset_info(pb: Any) -> None:
    """As the 5.x client's processPopResponse: check point from startOffsetInfo, message offset from
    msgOffsetInfo by rank in the queue; the handle the client gets adds the commit-log offset."""
    recs = [StoreRecord(topic="T", queue_id=1, queue_offset=6, commit_log_offset=600, body=b"x",
                        properties={"UNIQ_KEY": "ID6", "TAGS": "a", "u": "v"}),
            StoreRecord(topic="T", queue_id=1, queue_offset=5, commit_log_offset=500, body=b"y"),
            StoreRecord(topic="%RETRY%G+T", queue_id=0, queue_offset=2, commit_log_offset=200, body=b"z")]
    ext = {"popTime": "1000", "invisibleTime": "30000", "reviveQid": "3",
           "startOffsetInfo": "0 1 5;2 0 2", "msgOffsetInfo": "0 1 5,6;2 0 2"}
    attach_handles(recs, ext, "broker-a")
    assert recs[0].properties["POP_CK"] == "5 1000 30000 3 0 broker-a 1 6"
    assert recs[1].properties["POP_CK"] == "5 1000 30000 3 0 broker-a 1 5"
    assert recs[2].properties["POP_CK"] == "2 1000 30000 3 2 broker-a 0 2"
    m = to_message(pb, recs[0], "T", "broker-a")
    assert m.system_properties.receipt_handle == "5 1000 30000 3 0 broker-a 1 6 600"
    assert m.system_properties.message_id == "ID6" and m.system_properties.tag == "a"
    assert dict(m.user_properties) == {"u": "v"}
    assert m.system_properties.delivery_attempt == 1 and m.topic.name == "T"
    assert m.system_properties.body_digest.checksum == "9DD4E461268C8034F5C8564E155C67A6"  # md5("x"), upper case


def test_send_properties(pb: Any) -> None:
    msg = pb.Message(body=b"b", user_properties={"k": "v"})
    sp = msg.system_properties
    sp.tag, sp.message_id, sp.message_group = "t", "MID", "grp"
    sp.keys.extend(["k1", "k2"])
    sp.delivery_timestamp.seconds = 1_700_000_000
    props, flag = send_properties(pb, msg, "PG", "10.0.0.1:5")
    assert props["TAGS"] == "t" and props["KEYS"] == "k1 k2" and props["UNIQ_KEY"] == "MID"
    assert props["__SHARDINGKEY"] == "grp" and props["TIMER_DELIVER_MS"] == "1700000000000"
    assert props["__BORNHOST"] == "10.0.0.1:5" and props["k"] == "v" and flag == 0
    msg.user_properties["UNIQ_KEY"] = "x"
    with pytest.raises(BadRequest):
        send_properties(pb, msg, "PG", "")


def test_message_group_queue_choice_matches_java() -> None:
    """String.hashCode and Guava's Hashing.consistentHash, checked against Java (guava 32.0.1)."""
    java = {"g0": (3241, 0, 0, 733), "g1": (3242, 0, 6, 290), "order-42": (1234255197, 3, 3, 753),
            "\u4e2d\u6587": (646394, 3, 3, 401), "a-much-longer-message-group-name": (-1062282257, 2, 6, 955)}
    for key, (h, b4, b7, b1000) in java.items():
        assert _java_hash(key) == h
        assert (_consistent_hash(h, 4), _consistent_hash(h, 7), _consistent_hash(h, 1000)) == (b4, b7, b1000)


def test_grpc_settings() -> None:
    s = parse_grpc({"enabled": True, "listen": "127.0.0.1:8081", "max_fanout": 3, "min_poll": 0.5})
    assert (s.enabled, s.listen, s.max_fanout, s.min_poll) == (True, "127.0.0.1:8081", 3, 0.5)
    for bad in ({"listen": "nope"}, {"max_fanout": 0}, {"min_poll": "1"}, {"enabled": 1}, {"other": 1}):
        with pytest.raises(ConfigError):
            parse_grpc(bad)


class ScriptedPool:
    """Brokers by address: pops answer from ``stock`` (empty: PULL_NOT_FOUND); a NOTIFICATION answers
    hasMsg at once when stock is there, else when ``arrive`` puts some, else after its pollTime."""

    def __init__(self, stock: dict[str, list[bytes]]) -> None:
        self.stock = stock
        self.calls: list[tuple[str, int]] = []
        self.exts: list[dict[str, str]] = []
        self.stale: dict[str, int] = {}  # notifications answered hasMsg although a pop finds nothing
        self.arrived = asyncio.Event()

    def arrive(self, addr: str, body: bytes) -> None:
        self.stock.setdefault(addr, []).append(body)
        self.arrived.set()

    async def request(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"", *,
                      timeout: float = 3.0) -> RemotingCommand:
        self.calls.append((addr, code))
        self.exts.append(ext)
        if code == C.POP_MESSAGE:
            bodies = self.stock.get(addr) or []
            if not bodies:
                return RemotingCommand(code=C.PULL_NOT_FOUND, flag=1)
            self.stock[addr] = []
            recs = [StoreRecord(topic=ext["topic"], queue_id=0, queue_offset=i, commit_log_offset=i, body=b)
                    for i, b in enumerate(bodies)]
            return RemotingCommand(code=0, flag=1, body=encode_records(recs), ext_fields={
                "popTime": "1", "invisibleTime": "30000", "reviveQid": "0"})
        assert code == C.NOTIFICATION
        if self.stale.get(addr, 0) > 0:
            self.stale[addr] -= 1
            return RemotingCommand(code=0, flag=1, ext_fields={"hasMsg": "true"})
        deadline = time.monotonic() + int(ext["pollTime"]) / 1000
        while not self.stock.get(addr):
            left = deadline - time.monotonic()
            if left <= 0:
                return RemotingCommand(code=0, flag=1, ext_fields={"hasMsg": "false"})
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                pass
        return RemotingCommand(code=0, flag=1, ext_fields={"hasMsg": "true"})


def _service(pb: Any, pool: ScriptedPool, **kw: Any) -> tuple[MessagingService, Route]:
    svc = MessagingService(pb, [], GrpcSection(enabled=True, **kw))
    svc.pool = svc.lanes = pool  # type: ignore[assignment]
    names = ["a", "b", "c", "d"]
    route = Route({n: f"{n}:1" for n in names}, [{"brokerName": n, "perm": 6, "readQueueNums": 2,
                                                  "writeQueueNums": 2} for n in names])
    return svc, route


def _request(pb: Any, first: str) -> Any:
    req = pb.ReceiveMessageRequest(batch_size=4)
    req.group.name, req.message_queue.topic.name, req.message_queue.broker.name = "G", "T", first
    return req


def test_pop_with_notify_finds_the_broker_with_messages(pb: Any) -> None:
    async def go() -> None:
        pool = ScriptedPool({"c:1": [b"on-c"]})
        svc, route = _service(pb, pool)
        t0 = time.monotonic()
        msgs = await svc._pop_with_notify(route, _request(pb, "a"), 30000, time.monotonic() + 5)
        assert [m.body for m in msgs] == [b"on-c"] and time.monotonic() - t0 < 2
        assert pool.calls[0] == ("a:1", C.POP_MESSAGE)  # the named broker first
        assert sorted(a for a, c in pool.calls if c == C.NOTIFICATION) == ["a:1", "b:1", "c:1", "d:1"]
        assert pool.calls[-1] == ("c:1", C.POP_MESSAGE)

        # parked: a message arriving on d during the long poll is returned when it arrives
        pool2 = ScriptedPool({})
        svc2, route2 = _service(pb, pool2)
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, pool2.arrive, "d:1", b"late-on-d")
        t0 = time.monotonic()
        msgs = await svc2._pop_with_notify(route2, _request(pb, "b"), 30000, time.monotonic() + 5)
        took = time.monotonic() - t0
        assert [m.body for m in msgs] == [b"late-on-d"] and 0.25 < took < 2, took

    asyncio.run(go())


def test_pop_with_notify_bounded_fanout_and_empty_end(pb: Any) -> None:
    async def go() -> None:
        pool = ScriptedPool({})
        svc, route = _service(pb, pool, max_fanout=2, min_poll=0.05)
        t0 = time.monotonic()
        msgs = await svc._pop_with_notify(route, _request(pb, "c"), 30000, time.monotonic() + 0.6)
        took = time.monotonic() - t0
        assert msgs == [] and 0.5 < took < 2, took
        notified = [a for a, c in pool.calls if c == C.NOTIFICATION]
        assert set(notified) == {"c:1", "d:1"}  # the named broker and the next one, no more
        assert [c for _, c in pool.calls].count(C.POP_MESSAGE) == 1

    asyncio.run(go())


def test_single_pop_mode_long_polls_one_broker(pb: Any) -> None:
    """``notify = false``: one pop on the named broker, long-polling for the whole time (Apache's
    proxy's behaviour, kept for comparison); a message on another broker is not looked for."""
    async def go() -> None:
        pool = ScriptedPool({"c:1": [b"on-c"]})
        svc, route = _service(pb, pool, notify=False)
        msgs = await svc._pop_with_notify(route, _request(pb, "a"), 30000, time.monotonic() + 5)
        assert msgs == [] and pool.calls == [("a:1", C.POP_MESSAGE)]
        assert 4000 <= int(pool.exts[0]["pollTime"]) <= 5000

    asyncio.run(go())


def test_keeper_starts_restarts_and_stops_the_front(tmp_path: Any) -> None:
    """The worker's FrontKeeper: the front process serves gRPC on the configured port; killed, it is
    started again and serves again; stop() ends it."""
    import os
    import signal
    import socket

    import gevent

    from rmqfast import config as config_mod
    from rmqfast.grpcfront.keeper import FrontKeeper
    from rmqfast.testing.ports import reserve

    lease = reserve([0])
    try:
        cfg = config_mod.from_dict({"namesrv": {"listen": "127.0.0.1:1", "upstreams": ["127.0.0.1:2"]},
                                    "grpc": {"enabled": True, "listen": f"127.0.0.1:{lease.base}"}})
        (tmp_path / "config.json").write_text(cfg.to_json())

        def serving() -> bool:
            with socket.socket() as s:
                s.settimeout(0.2)
                return s.connect_ex(("127.0.0.1", lease.base)) == 0

        def wait(cond: Any, what: str) -> None:
            deadline = time.monotonic() + 60
            while not cond():
                assert time.monotonic() < deadline, what
                gevent.sleep(0.05)

        keeper = FrontKeeper(tmp_path, interval=0.1)
        keeper.start()
        try:
            wait(serving, "the front listens")
            first = keeper.proc
            assert first is not None
            os.kill(first.pid, signal.SIGKILL)
            wait(lambda: keeper.restarts == 1 and keeper.proc is not first, "a new front")
            wait(serving, "the new front listens")
        finally:
            keeper.stop()
        assert keeper.proc is not None and keeper.proc.poll() is not None
        wait(lambda: not serving(), "the port is closed")
    finally:
        lease.release()


def test_grpc_sends_take_the_shared_send_limits(pb: Any, tmp_path: Any) -> None:
    """[limits]: a gRPC send takes tokens from the buckets the workers share; over the burst it is
    answered TOO_MANY_REQUESTS without reaching the broker; other topics are not limited."""
    from rmqfast.grpcfront.server import send_limiter
    from rmqfast.limits import create_shared
    from rmqfast.limits.rules import parse_limits

    create_shared(tmp_path)
    lim = send_limiter(tmp_path, parse_limits({"rule": [{"topic": "T", "rate": 0.01, "burst": 2}]}))
    assert lim is not None
    assert send_limiter(tmp_path, parse_limits({})) is None

    class SendPool:
        sends = 0

        async def request(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"", *,
                          timeout: float = 3.0) -> RemotingCommand:
            assert code == C.SEND_MESSAGE_V2
            SendPool.sends += 1
            return RemotingCommand(code=0, flag=1, ext_fields={"queueOffset": "1", "msgId": "X"})

    class Ctx:
        def peer(self) -> str:
            return "ipv4:127.0.0.1:5000"

    svc = MessagingService(pb, [], GrpcSection(enabled=True), lim)
    svc.pool = SendPool()  # type: ignore[assignment]
    route = Route.parse(b'{"brokerDatas":[{"brokerName":"a","brokerAddrs":{"0":"a:1"}}],'
                        b'"queueDatas":[{"brokerName":"a","perm":6,"readQueueNums":2,"writeQueueNums":2}]}', 60)
    svc._routes = {"T": route, "U": route}

    def send(topic: str) -> int:
        req = pb.SendMessageRequest()
        m = req.messages.add(body=b"x")
        m.topic.name, m.system_properties.message_id = topic, "ID"
        return asyncio.run(svc.SendMessage(req, Ctx())).status.code

    assert [send("T") for _ in range(3)] == [pb.Code.OK, pb.Code.OK, pb.Code.TOO_MANY_REQUESTS]
    assert send("U") == pb.Code.OK
    assert SendPool.sends == 3


def test_pop_with_notify_asks_again_after_a_stale_has_msg(pb: Any) -> None:
    """A broker that says hasMsg while its pop finds nothing (its consume offset lags the acks, or
    another consumer was faster) is asked again after a short back-off: a message arriving there
    later is returned when it arrives, not when the long poll ends; the asking does not spin."""
    async def go() -> None:
        pool = ScriptedPool({})
        pool.stale = {"a:1": 3}
        svc, route = _service(pb, pool, min_poll=0.2)
        asyncio.get_running_loop().call_later(0.8, pool.arrive, "a:1", b"late-on-a")
        t0 = time.monotonic()
        msgs = await svc._pop_with_notify(route, _request(pb, "b"), 30000, time.monotonic() + 5)
        took = time.monotonic() - t0
        assert [m.body for m in msgs] == [b"late-on-a"] and 0.75 < took < 2.5, took
        to_a = [c for a, c in pool.calls if a == "a:1"]
        assert to_a.count(C.NOTIFICATION) == 4 and to_a.count(C.POP_MESSAGE) == 4  # 3 stale, 1 real

    asyncio.run(go())


def test_keeper_goes_on_when_the_front_cannot_be_started(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart that fails (no file descriptors, no memory) is logged and tried again later: the
    keeper's watch does not end, and the worker that runs it is untouched."""
    import os

    import gevent

    from rmqfast.grpcfront import keeper as keeper_mod

    class Proc:
        def __init__(self, code: int | None) -> None:
            self.returncode = code
            self.pid = 0

        def poll(self) -> int | None:
            return self.returncode

    outcomes: list[Any] = [Proc(1), OSError(24, "Too many open files"), Proc(None)]

    def spawn(runtime: Any) -> tuple[Any, int]:
        got = outcomes.pop(0)
        if isinstance(got, Exception):
            raise got
        return got, os.open(os.devnull, os.O_RDONLY)

    monkeypatch.setattr(keeper_mod, "spawn", spawn)
    k = keeper_mod.FrontKeeper(tmp_path, interval=0.01)
    k.start()
    try:
        deadline = time.monotonic() + 30
        while outcomes or k.proc is None or k.proc.poll() is not None:
            assert time.monotonic() < deadline, "the keeper stopped trying"
            assert k._greenlet is not None and not k._greenlet.dead, "the keeper's watch ended"
            gevent.sleep(0.01)
        assert k.restarts == 1 and k.proc.poll() is None
    finally:
        k._stopped = True
        k._close_lifeline()


def test_upstream_frames_of_one_loop_turn_go_out_in_one_write() -> None:
    """Requests queued in one turn of the loop are written together, in order, as whole frames;
    their answers still reach each caller."""
    from rmqfast.codec.command import decode_frame, encode
    from rmqfast.grpcfront.upstream import Connection

    async def go() -> None:
        got: list[bytes] = []
        done = asyncio.Event()

        async def broker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            frames = []
            while len(frames) < 3:
                data = await reader.read(65536)
                got.append(data)
                buf = b"".join(got)
                frames = []
                while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
                    n = 4 + int.from_bytes(buf[:4], "big")
                    frames.append(decode_frame(buf[:n]))
                    buf = buf[n:]
            for f in frames:
                if f.code != 99:  # the one-way frame gets no answer
                    writer.write(encode(RemotingCommand(code=0, opaque=f.opaque, flag=1, remark=str(f.code))))
            await writer.drain()
            await done.wait()
            writer.close()

        server = await asyncio.start_server(broker, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = await Connection.open(f"127.0.0.1:{port}", 3.0)
        writes: list[int] = []
        real_write = conn._writer.write
        conn._writer.write = lambda data: (writes.append(len(data)), real_write(data))[1]  # type: ignore[method-assign]
        a = asyncio.ensure_future(conn.request(10, {"k": "a"}, timeout=5))
        b = asyncio.ensure_future(conn.request(11, {"k": "b"}, b"body", timeout=5))
        await asyncio.sleep(0)  # both requests queue their frames (the first one schedules the write)
        conn.oneway(99, {"k": "c"})  # same turn: after theirs, in the same write
        ra, rb = await asyncio.gather(a, b)
        assert (ra.remark, rb.remark) == ("10", "11")
        assert len(writes) == 1  # one write (one system call) for the three frames
        codes = []
        buf = got[0]
        while buf:
            n = 4 + int.from_bytes(buf[:4], "big")
            codes.append(decode_frame(buf[:n]).code)
            buf = buf[n:]
        assert codes == [10, 11, 99]
        done.set()
        await conn.close()
        server.close()
        await server.wait_closed()

    asyncio.run(go())


def test_grpc_tls_settings(tmp_path: Any) -> None:
    """``[grpc] tls = true`` takes ``[tls.listen]``'s certificate; what grpc cannot do is a config error."""
    from rmqfast import config as config_mod
    from rmqfast.testing.tlscerts import make_certs

    c = make_certs(tmp_path)
    base = {"namesrv": {"listen": "127.0.0.1:1", "upstreams": ["127.0.0.1:2"]}}

    def cfg(grpc: dict[str, Any], listen: dict[str, Any] | None = None) -> Any:
        raw = dict(base, grpc={"enabled": True, **grpc})
        if listen is not None:
            raw["tls"] = {"listen": listen}
        return config_mod.from_dict(raw)

    ok = cfg({"tls": True}, {"cert": str(c.server_cert), "key": str(c.server_key)})
    assert ok.grpc.tls and ok.tls.listen.mode == "disabled"  # the Remoting listeners stay plain
    assert config_mod.from_json(ok.to_json()).grpc.tls  # as the front process reads it
    assert not cfg({}).grpc.tls
    for grpc_tls, listen, msg in (
        ({"tls": True}, None, "needs tls.listen.cert"),
        ({"tls": True}, {"cert": str(c.server_cert), "key": str(c.server_key), "key_password": "x"}, "unencrypted"),
        ({"tls": True}, {"cert": str(c.server_cert), "key": str(c.server_key), "verify_client": "optional"},
         "optional"),
        ({"tls": True}, {"cert": str(c.server_cert), "key": str(c.server_key), "verify_client": "require"},
         "needs tls.listen.ca"),
        ({"tls": True}, {"cert": str(c.server_cert), "key": str(c.client_key)}, "tls.listen"),  # key of another cert
        ({"tls": "yes"}, None, "grpc.tls"),
    ):
        with pytest.raises(ConfigError, match=msg):
            cfg(grpc_tls, listen)
    required = cfg({"tls": True}, {"cert": str(c.server_cert), "key": str(c.server_key), "ca": str(c.ca),
                                   "verify_client": "require"})
    from rmqfast.grpcfront.settings import server_credentials

    assert server_credentials(required.tls) is not None

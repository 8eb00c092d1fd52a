"""The gRPC front's transactions and FIFO consumption without brokers: transaction ids, producer
registration, check-back relay, EndTransaction headers, orderly pops (scripted brokers)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

pytest.importorskip("grpc")

from rmqfast.codec import codes as C  # noqa: E402
from rmqfast.codec.command import RemotingCommand  # noqa: E402
from rmqfast.codec.properties import parse_properties  # noqa: E402
from rmqfast.codec.store import StoreRecord, encode_records  # noqa: E402
from rmqfast.grpcfront import protos  # noqa: E402
from rmqfast.grpcfront.convert import BadRequest, attach_handles, to_message  # noqa: E402
from rmqfast.grpcfront.service import MessagingService, Route  # noqa: E402
from rmqfast.grpcfront.settings import GrpcSection  # noqa: E402
from rmqfast.grpcfront.transaction import Producers, Stream, TxId, commit_log_offset, heartbeat_body  # noqa: E402


@pytest.fixture(scope="module")
def pb() -> Any:
    return protos.load()


def test_transaction_id_round_trip_and_refusals() -> None:
    for broker, txid in (("broker-a", "0102FC00000001"), ("b %20 c", "id with spaces"), ("x", "")):
        tx = TxId(123456789, 42, broker, txid)
        assert TxId.decode(tx.encode()) == tx
    assert TxId(7, 3, "broker-a", "ID").encode() == "7 3 broker-a ID"
    for bad in ("", "7 3 broker-a", "x 3 b ID", "7 -3 b ID", "7 3  ID"):
        with pytest.raises(BadRequest) as ei:
            TxId.decode(bad)
        assert ei.value.code == "INVALID_TRANSACTION_ID"


def test_commit_log_offset_from_offset_message_id() -> None:
    # MessageDecoder.createMessageId: ip (4 bytes), port (4), offset (8), hex upper case
    assert commit_log_offset("7F00000100002A9F000000000000BEEF") == 0xBEEF
    assert commit_log_offset("00" * 16 + "00002A9F" + "0000000100000002") == (1 << 32) + 2  # IPv6 store host
    with pytest.raises(ValueError):
        commit_log_offset("0102")


def test_producers_by_topic() -> None:
    p = Producers()
    s1, s2 = Stream("c1"), Stream("c2")
    assert p.publish(s1, frozenset({"T", "U"})) == ({"T", "U"}, set())
    assert p.publish(s2, frozenset({"T"})) == (set(), set())  # T already registered here
    assert {p.pick("T"), p.pick("T")} == {s1, s2} and p.pick("U") is s1 and p.pick("V") is None
    assert p.publish(s1, frozenset({"T"})) == (set(), {"U"})  # new settings: U no longer published
    assert p.topics() == ["T"]
    assert p.remove(s1) == set()
    assert p.remove(s2) == {"T"}
    assert p.topics() == [] and p.pick("T") is None
    body = json.loads(heartbeat_body("cid", ["T", "U"]))
    assert body == {"clientID": "cid", "consumerDataSet": [], "producerDataSet": [{"groupName": "T"},
                                                                                   {"groupName": "U"}]}


def test_orderly_pop_delivery_count(pb: Any) -> None:
    """An orderly pop's orderCountInfo gives the delivery count (per message, else per queue)."""
    recs = [StoreRecord(topic="T", queue_id=1, queue_offset=5, commit_log_offset=500, body=b"a"),
            StoreRecord(topic="T", queue_id=1, queue_offset=6, commit_log_offset=600, body=b"b"),
            StoreRecord(topic="T", queue_id=2, queue_offset=9, commit_log_offset=900, body=b"c")]
    ext = {"popTime": "1000", "invisibleTime": "30000", "reviveQid": "999", "startOffsetInfo": "0 1 5;0 2 9",
           "msgOffsetInfo": "0 1 5,6;0 2 9", "orderCountInfo": "0 qo1%5 2;0 qo1%6 0;0 2 3"}
    attach_handles(recs, ext, "broker-a")
    assert [to_message(pb, r, "T", "broker-a").system_properties.delivery_attempt for r in recs] == [3, 1, 4]
    assert recs[0].properties["POP_CK"] == "5 1000 30000 999 0 broker-a 1 5"


class Brokers:
    """Scripted brokers: answers by request code, every call recorded."""

    def __init__(self, orderly: bool = False) -> None:
        self.calls: list[tuple[str, int, dict[str, str], bytes]] = []
        self.oneways: list[tuple[str, int, dict[str, str]]] = []
        self.orderly = orderly

    async def request(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"", *,
                      timeout: float = 3.0) -> RemotingCommand:
        self.calls.append((addr, code, ext, body))
        if code == C.SEND_MESSAGE_V2:
            return RemotingCommand(code=0, flag=1, ext_fields={
                "msgId": "7F00000100002A9F00000000000004D2", "queueId": ext["e"], "queueOffset": "17",
                "transactionId": "UNIQ1"})
        if code == 352:  # GET_SUBSCRIPTIONGROUP_CONFIG
            return RemotingCommand(code=0, flag=1, body=json.dumps({
                "groupName": ext["group"], "consumeMessageOrderly": self.orderly}).encode())
        if code == C.POP_MESSAGE:
            return RemotingCommand(code=C.PULL_NOT_FOUND, flag=1)
        if code == C.NOTIFICATION:
            return RemotingCommand(code=0, flag=1, ext_fields={"hasMsg": "false"})
        return RemotingCommand(code=0, flag=1)

    async def oneway(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"") -> None:
        self.oneways.append((addr, code, ext))


def _service(pb: Any, brokers: Brokers) -> MessagingService:
    svc = MessagingService(pb, [], GrpcSection(enabled=True))
    svc.pool = svc.lanes = brokers  # type: ignore[assignment]
    svc._routes["T"] = Route({"a": "a:1", "b": "b:1"}, [
        {"brokerName": n, "perm": 6, "readQueueNums": 2, "writeQueueNums": 2} for n in ("a", "b")],
        time.monotonic() + 3600, [("b", 0)])
    return svc


class Ctx:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> float:
        return 2.0


def test_transactional_send_and_end_transaction(pb: Any) -> None:
    async def go() -> None:
        brokers = Brokers()
        svc = _service(pb, brokers)
        msg = pb.Message(body=b"half")
        msg.topic.name = "T"
        msg.system_properties.message_id = "UNIQ1"
        msg.system_properties.message_type = pb.MessageType.TRANSACTION
        resp = await svc.SendMessage(pb.SendMessageRequest(messages=[msg]), Ctx())
        assert resp.status.code == pb.Code.OK, resp
        addr, code, ext, body = brokers.calls[-1]
        props = parse_properties(ext["i"])
        assert (addr, code, body) == ("b:1", C.SEND_MESSAGE_V2, b"half")
        assert (ext["a"], props["PGROUP"], props["TRAN_MSG"]) == ("T", "T", "true"), (ext, props)
        assert int(ext["f"]) & 4  # TRANSACTION_PREPARED_TYPE
        tx = TxId.decode(resp.entries[0].transaction_id)
        assert tx == TxId(0x4D2, 17, "b", "UNIQ1")

        for resolution, source, commit, check in (
                (pb.TransactionResolution.COMMIT, pb.TransactionSource.SOURCE_CLIENT, "8", "false"),
                (pb.TransactionResolution.ROLLBACK, pb.TransactionSource.SOURCE_SERVER_CHECK, "12", "true"),
                (pb.TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED, pb.TransactionSource.SOURCE_CLIENT,
                 "0", "false")):
            req = pb.EndTransactionRequest(message_id="UNIQ1", transaction_id=tx.encode(), resolution=resolution,
                                           source=source)
            req.topic.name = "T"
            end = await svc.EndTransaction(req, Ctx())
            assert end.status.code == pb.Code.OK, end
            assert brokers.oneways[-1] == ("b:1", C.END_TRANSACTION, {
                "topic": "T", "producerGroup": "T", "tranStateTableOffset": "17", "commitLogOffset": "1234",
                "commitOrRollback": commit, "fromTransactionCheck": check, "msgId": "UNIQ1",
                "transactionId": "UNIQ1"})
        n = len(brokers.oneways)
        for bad in ("garbage", TxId(1, 2, "elsewhere", "X").encode()):  # not ours / a broker not in the route
            req = pb.EndTransactionRequest(message_id="UNIQ1", transaction_id=bad)
            req.topic.name = "T"
            end = await svc.EndTransaction(req, Ctx())
            assert end.status.code == pb.Code.INVALID_TRANSACTION_ID, end
        assert len(brokers.oneways) == n

    asyncio.run(go())


def test_check_back_relayed_to_a_producer_of_the_topic(pb: Any) -> None:
    async def go() -> None:
        brokers = Brokers()
        svc = _service(pb, brokers)
        half = StoreRecord(topic="T", queue_id=1, queue_offset=3, commit_log_offset=999, body=b"open",
                           properties={"PGROUP": "T", "TRAN_MSG": "true", "UNIQ_KEY": "UNIQ9", "REAL_TOPIC": "T"})
        check = RemotingCommand(code=C.CHECK_TRANSACTION_STATE, flag=2, body=encode_records([half]), ext_fields={
            "topic": "RMQ_SYS_TRANS_HALF_TOPIC", "tranStateTableOffset": "21", "commitLogOffset": "4321",
            "msgId": "UNIQ9", "transactionId": "UNIQ9", "offsetMsgId": "7F00000100002A9F00000000000010E1"})
        await svc._check_back("a:1", check)  # no producer of T here: dropped (logged)

        stream = Stream("client-1")
        svc.producers.publish(stream, frozenset({"T"}))
        await svc._check_back("a:1", check)
        cmd = stream.out.get_nowait()
        rec = cmd.recover_orphaned_transaction_command
        assert rec.message.topic.name == "T" and rec.message.body == b"open"
        assert rec.message.system_properties.message_id == "UNIQ9"
        assert rec.message.system_properties.message_type == pb.MessageType.TRANSACTION
        assert TxId.decode(rec.transaction_id) == TxId(4321, 21, "a", "UNIQ9")
        await svc._check_back("z:1", check)  # not a broker of T's route
        assert stream.out.empty()

        svc._heartbeat_now.set()
        hb = asyncio.ensure_future(svc._heartbeats())
        while len([c for c in brokers.calls if c[1] == C.HEART_BEAT]) < 2:
            await asyncio.sleep(0.01)
        hb.cancel()
        beats = {c[0]: json.loads(c[3]) for c in brokers.calls if c[1] == C.HEART_BEAT}
        assert set(beats) == {"a:1", "b:1"}
        assert beats["a:1"]["producerDataSet"] == [{"groupName": "T"}]

        svc._unregister(svc.producers.remove(stream))  # its last producer gone: the brokers are told
        while len([c for c in brokers.calls if c[1] == C.UNREGISTER_CLIENT]) < 2:
            await asyncio.sleep(0.01)
        assert {(c[0], c[2]["producerGroup"]) for c in brokers.calls if c[1] == C.UNREGISTER_CLIENT} == {
            ("a:1", "T"), ("b:1", "T")}

    asyncio.run(go())


@pytest.mark.parametrize("orderly", [False, True])
def test_orderly_group_pops_in_order(pb: Any, orderly: bool) -> None:
    """A group whose config says consumeMessageOrderly gets order=true pops and notifications (and
    fifo in its settings answer); a plain group order=false."""
    async def go() -> None:
        brokers = Brokers(orderly)
        svc = _service(pb, brokers)
        req = pb.ReceiveMessageRequest(batch_size=1, attempt_id="att-1")
        req.group.name, req.message_queue.topic.name, req.message_queue.broker.name = "G", "T", "a"
        req.long_polling_timeout.seconds = 1
        answers = await svc._receive(req, Ctx())
        assert answers[0].status.code == pb.Code.MESSAGE_NOT_FOUND
        pops = [c[2] for c in brokers.calls if c[1] in (C.POP_MESSAGE, C.NOTIFICATION)]
        assert pops and all(e["order"] == ("true" if orderly else "false") for e in pops)
        assert all(e["attemptId"] == "att-1" for e in pops)
        s = pb.Settings(client_type=pb.ClientType.SIMPLE_CONSUMER)
        s.subscription.group.name = "G"
        s.subscription.subscriptions.add().topic.name = "T"
        assert (await svc._settings_answer(s)).subscription.fifo is orderly
        assert sum(1 for c in brokers.calls if c[1] == 352) == 1  # the group's config is cached

    asyncio.run(go())


class ParkingBroker:
    """A TCP broker modelling 5.3.3's NOTIFICATION parking (``PopLongPollingService`` with notifyLast):
    a notification finds messages at once or is parked; an arrival wakes the one parked notification
    that expires last, skipping those whose connection is closed.  Pops take the stock."""

    def __init__(self) -> None:
        self.stock: list[bytes] = []
        self.parked: list[tuple[int, asyncio.StreamWriter, int]] = []  # (expiry, writer, opaque)
        self.changed = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def _live(self) -> list[tuple[int, asyncio.StreamWriter, int]]:
        return [p for p in self.parked if not p[1].is_closing()]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from rmqfast.codec.command import decode_frame, encode

        try:
            while True:
                head = await reader.readexactly(4)
                cmd = decode_frame(head + await reader.readexactly(int.from_bytes(head, "big")))
                ext = cmd.ext_fields or {}
                if cmd.code == C.NOTIFICATION and not self.stock:
                    self.parked.append((int(ext["bornTime"]) + int(ext["pollTime"]), writer, cmd.opaque))
                    self.changed.set()
                    continue
                if cmd.code == C.NOTIFICATION:
                    answer = RemotingCommand(code=0, flag=1, opaque=cmd.opaque, ext_fields={"hasMsg": "true"})
                elif self.stock:
                    recs = [StoreRecord(topic=ext["topic"], queue_id=0, queue_offset=i, commit_log_offset=i, body=b)
                            for i, b in enumerate(self.stock)]
                    self.stock = []
                    answer = RemotingCommand(code=0, flag=1, opaque=cmd.opaque, body=encode_records(recs),
                                             ext_fields={"popTime": "1", "invisibleTime": "30000", "reviveQid": "0"})
                else:
                    answer = RemotingCommand(code=C.PULL_NOT_FOUND, flag=1, opaque=cmd.opaque)
                writer.write(encode(answer))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            self.changed.set()

    def arrive(self, body: bytes) -> None:
        from rmqfast.codec.command import encode

        self.stock.append(body)
        live = self._live()
        if live:
            woken = max(live, key=lambda p: p[0])
            self.parked.remove(woken)
            woken[1].write(encode(RemotingCommand(code=0, flag=1, opaque=woken[2], ext_fields={"hasMsg": "true"})))

    async def until(self, fn: Any) -> None:
        while not fn():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 5)


def test_ended_receive_leaves_no_notification_to_take_a_wake_up(pb: Any) -> None:
    """Receive R1 (4 s) and then R2 (8 s) of one group are parked on brokers A and B.  A message on A
    wakes R2 (its notification expires last), which returns it; its notification on B is then
    closed with its connection.  A message on B must wake R1 at once: were R2's notification still
    parked there, the broker would wake it instead (it expires last), its answer would go nowhere,
    and R1 would end empty at its deadline with the message waiting on B."""
    async def go() -> None:
        a, b = ParkingBroker(), ParkingBroker()
        addr_a, addr_b = await a.start(), await b.start()
        svc = MessagingService(pb, [], GrpcSection(enabled=True))
        route = Route({"A": addr_a, "B": addr_b}, [{"brokerName": n, "perm": 6, "readQueueNums": 1,
                                                    "writeQueueNums": 1} for n in ("A", "B")])
        req = pb.ReceiveMessageRequest(batch_size=4)
        req.group.name, req.message_queue.topic.name, req.message_queue.broker.name = "G", "T", "A"
        try:
            r1 = asyncio.ensure_future(svc._pop_with_notify(route, req, 30000, time.monotonic() + 4))
            await a.until(lambda: len(a._live()) == 1)
            await b.until(lambda: len(b._live()) == 1)
            r2 = asyncio.ensure_future(svc._pop_with_notify(route, req, 30000, time.monotonic() + 8))
            await a.until(lambda: len(a._live()) == 2)
            await b.until(lambda: len(b._live()) == 2)
            a.arrive(b"on-a")
            assert [m.body for m in await asyncio.wait_for(r2, 5)] == [b"on-a"]
            await b.until(lambda: len(b._live()) == 1)  # R2's notification on B: its connection closed
            t0 = time.monotonic()
            b.arrive(b"on-b")
            assert [m.body for m in await asyncio.wait_for(r1, 5)] == [b"on-b"]
            assert time.monotonic() - t0 < 2
            assert svc.lanes.dropped >= 1
        finally:
            await svc.close()
            for broker in (a, b):
                assert broker.server is not None
                broker.server.close()

    asyncio.run(go())


def test_notification_connections_are_bounded() -> None:
    """Past ``max_busy`` notifications in flight to one broker, further ones share one connection."""
    from rmqfast.grpcfront.upstream import Lanes, Pool

    async def go() -> None:
        broker = ParkingBroker()
        addr = await broker.start()
        shared = Pool()
        lanes = Lanes(max_busy=2, shared=shared)
        ext = {"bornTime": "0", "pollTime": str(1 << 40)}
        calls = [asyncio.ensure_future(lanes.request(addr, C.NOTIFICATION, ext, timeout=5)) for _ in range(4)]
        try:
            await broker.until(lambda: len(broker._live()) == 4)
            assert lanes.opened == 2  # two of their own, two over the shared connection
            assert len({id(w) for _, w, _ in broker.parked}) == 3
        finally:
            for c in calls:
                c.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await lanes.close()
            await shared.close()
            assert broker.server is not None
            broker.server.close()

    asyncio.run(go())

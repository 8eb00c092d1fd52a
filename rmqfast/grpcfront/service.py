"""``apache.rocketmq.v2.MessagingService`` in front of Remoting brokers, with pop with notify.

Stateless like the brokers' pop: a receive carries everything it needs, a receipt handle names its
broker.  What a process keeps is a route cache (per topic, a few seconds) and one Remoting
connection per name server and broker (:mod:`rmqfast.grpcfront.upstream`).

Receive (pop with notify): one POP_MESSAGE without long polling to the broker the client named in
``message_queue`` (the client cycles through its assignments), else to the next broker in a
round robin; if it comes back empty and long-poll time remains, a NOTIFICATION (long-polling for
the remaining time) goes to every broker of the topic, at most ``max_fanout``, and the first that
answers ``hasMsg`` is popped (``bornTime`` refreshed).  If that pop finds nothing (another consumer
was faster) and time remains, the notifications start over; when every notification has timed out
the receive ends empty.  Each notification travels on a connection of its own
(:class:`~rmqfast.grpcfront.upstream.Lanes`): those still parked when their receive ends are closed,
so the broker skips them when it picks the one notification a message wakes.

Transactions (:mod:`rmqfast.grpcfront.transaction`): half messages, EndTransaction to the broker
named in the transaction id the front gave, check-back relayed over a producer's Telemetry stream.
FIFO: a group with ``consumeMessageOrderly`` gets orderly pops and notifications.

ACL (:mod:`rmqfast.grpcfront.auth`): with ``[acl]`` every call is authenticated from its metadata
and the topics it names are checked against the allowlist (sends and EndTransaction: send to;
receives, acks, invisible-time changes, dead-lettering and QueryAssignment: consume from;
QueryRoute: any use); a refusal is the call's status (``UNAUTHORIZED`` / ``FORBIDDEN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from rmqfast.codec import codes as C
from rmqfast.codec.route import PERM_READ, PERM_WRITE, parse_route
from rmqfast.codec.store import BodyError, decode_records
from rmqfast.grpcfront.auth import CONSUME, ROUTE, SEND, GrpcAcl, Refused, denied_counter
from rmqfast.grpcfront.convert import (
    BadRequest,
    ReceiptHandle,
    attach_handles,
    send_header,
    send_properties,
    to_message,
)
from rmqfast.grpcfront.settings import GrpcSection
from rmqfast.grpcfront.transaction import (
    TRANSACTION_COMMIT_TYPE,
    TRANSACTION_NOT_TYPE,
    TRANSACTION_ROLLBACK_TYPE,
    Producers,
    Stream,
    TxId,
    commit_log_offset,
    heartbeat_body,
)
from rmqfast.grpcfront.upstream import Connection, Lanes, Pool, UpstreamError, UpstreamTls

log = logging.getLogger("rmqfast.grpc")

POLLING_FULL, POLLING_TIMEOUT = 209, 210  # ResponseCode
GET_SUBSCRIPTIONGROUP_CONFIG, SUBSCRIPTION_GROUP_NOT_EXIST = 352, 26
PRODUCER_GROUP = "rmqfast-grpc"
ALL_TYPES = ("NORMAL", "FIFO", "DELAY", "TRANSACTION")
#: s between the HEART_BEATs that keep this process registered as producer of its clients' topics
#: (brokers drop a producer channel after 120 s without one)
TX_HEARTBEAT = 20.0


@dataclass
class Route:
    brokers: dict[str, str]  # broker name -> master address
    queues: list[dict[str, Any]]  # queueDatas
    expires: float = 0.0
    writable: list[tuple[str, int]] = field(default_factory=list)  # (broker, queue id)

    @classmethod
    def parse(cls, body: bytes, ttl: float) -> Route:
        obj, _ = parse_route(body)
        brokers = {}
        for bd in obj.get("brokerDatas") or []:
            addrs = {int(k): v for k, v in (bd.get("brokerAddrs") or {}).items()}
            if 0 in addrs:
                brokers[bd["brokerName"]] = addrs[0]
        queues = [q for q in obj.get("queueDatas") or [] if q.get("brokerName") in brokers]
        queues.sort(key=lambda q: q["brokerName"])
        writable = [(q["brokerName"], i) for q in queues if int(q.get("perm", 0)) & PERM_WRITE
                    for i in range(int(q.get("writeQueueNums", 0)))]
        return cls(brokers, queues, time.monotonic() + ttl, writable)

    def readable(self) -> list[str]:
        return [q["brokerName"] for q in self.queues
                if int(q.get("perm", 0)) & PERM_READ and int(q.get("readQueueNums", 0)) > 0]


class Fail(Exception):
    """Answer the request with ``code`` (a ``Code`` name) and ``message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


_BROKER_CODES = {C.TOPIC_NOT_EXIST: "TOPIC_NOT_FOUND", C.NO_PERMISSION: "FORBIDDEN", C.SYSTEM_BUSY: "TOO_MANY_REQUESTS",
                 POLLING_FULL: "TOO_MANY_REQUESTS", 26: "CONSUMER_GROUP_NOT_FOUND"}  # 26: SUBSCRIPTION_GROUP_NOT_EXIST


class Stats:
    """Counters of this process (receives, first-pop hits, notifications, empty answers), logged when
    the front stops."""

    def __init__(self) -> None:
        self.receives = self.first_pop_hits = self.notify_rounds = self.notify_hits = self.empty = 0
        self.empty_after_hit = 0  # hasMsg answered, the pop that followed found nothing
        self.notify_connections = 0  # opened for notifications
        self.notify_dropped = 0  # closed with their notification still parked (its receive had ended)
        self.connections_refused = 0  # client connections closed: grpc.max_connections(_per_client) reached
        self.connections_closed: dict[str, int] = {}  # by the gate's bounds, by reason (rmqfast.grpcfront.gate)


class MessagingService:
    """The handlers; ``handler()`` gives the grpc generic handler."""

    def __init__(self, pb: Any, namesrvs: list[str], settings: GrpcSection, limiter: Any = None,
                 acl: Any = None, tls: Any = None) -> None:
        self.pb = pb
        #: ``[acl]`` (an AclSection with topics): calls authenticated and their topics checked, else None
        self.acl = GrpcAcl(acl, denied_counter()) if acl is not None and acl.enabled else None
        #: ``[limits]``: the send limiter over the workers' shared buckets (rmqfast.limits), or None
        self.limiter = limiter
        self.namesrvs = namesrvs
        self.cfg = settings
        #: ``[tls.upstream]`` (of a TlsSection): name servers and brokers reached over TLS as the relay does
        up = UpstreamTls(tls.upstream, namesrvs) if tls is not None and tls.upstream.enable else None
        self.pool = Pool(settings.connect_timeout, self._broker_request, up)
        #: notifications: one connection each, closed when its receive ends first (see :class:`Lanes`)
        self.lanes = Lanes(settings.connect_timeout, shared=self.pool, tls=up)
        self._routes: dict[str, Route] = {}
        self._groups: dict[str, tuple[bool, float]] = {}  # group -> (consumeMessageOrderly, expires)
        self._rr = itertools.count()
        self.stats = Stats()
        #: Telemetry streams of producers, by topic (transaction check-back goes to one of them)
        self.producers = Producers()
        self.client_id = f"rmqfast-grpc@{socket.gethostname()}@{os.getpid()}"
        self._heartbeat_now = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- plumbing ----------------------------------------------------------------------------

    def status(self, code: str, message: str = "") -> Any:
        return self.pb.Status(code=getattr(self.pb.Code, code), message=message or code)

    async def route(self, topic: str) -> Route:
        r = self._routes.get(topic)
        if r is not None and r.expires > time.monotonic():
            return r
        err: Exception | None = None
        for ns in self.namesrvs:
            try:
                resp = await self.pool.request(ns, C.GET_ROUTEINFO_BY_TOPIC, {"topic": topic},
                                               timeout=self.cfg.request_timeout)
            except UpstreamError as exc:
                err = exc
                continue
            if resp.code == C.TOPIC_NOT_EXIST:
                raise Fail("TOPIC_NOT_FOUND", f"topic {topic} not found")
            if resp.code != C.SUCCESS:
                err = UpstreamError(f"{ns}: route of {topic}: code {resp.code} {resp.remark}")
                continue
            r = Route.parse(resp.body, self.cfg.route_ttl)
            self._routes[topic] = r
            return r
        if r is not None:
            return r  # stale beats none while the name servers are away
        raise Fail("INTERNAL_SERVER_ERROR", f"no name server answered: {err}")

    async def group_fifo(self, group: str, topic: str) -> bool:
        """Whether ``group`` consumes orderly (its ``consumeMessageOrderly``, from a broker of ``topic``;
        cached ``route_ttl``).  A group no broker knows yet is not (brokers create it plain)."""
        hit = self._groups.get(group)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        try:
            brokers = list((await self.route(topic)).brokers.values())
        except Fail:
            brokers = []
        for addr in brokers:
            try:
                resp = await self.pool.request(addr, GET_SUBSCRIPTIONGROUP_CONFIG, {"group": group},
                                               timeout=self.cfg.request_timeout)
            except UpstreamError:
                continue
            if resp.code == SUBSCRIPTION_GROUP_NOT_EXIST:
                fifo = False
            elif resp.code == C.SUCCESS:
                try:
                    cfg = json.loads(resp.body)
                except ValueError:
                    continue
                fifo = isinstance(cfg, dict) and cfg.get("consumeMessageOrderly") is True
            else:
                continue
            self._groups[group] = (fifo, time.monotonic() + self.cfg.route_ttl)
            return fifo
        return hit[0] if hit is not None else False

    async def broker_call(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"",
                          timeout: float | None = None) -> Any:
        try:
            return await self.pool.request(addr, code, ext, body, timeout=timeout or self.cfg.request_timeout)
        except UpstreamError as exc:
            raise Fail("PROXY_TIMEOUT" if "did not answer" in str(exc) else "INTERNAL_SERVER_ERROR", str(exc)) from exc

    def _refusal(self, ctx: Any, method: str, topics: tuple[tuple[str, str], ...] = ()) -> Any:
        """``[acl]``: None when the call may go on, else the Status refusing it (UNAUTHORIZED: not
        authenticated; FORBIDDEN: a topic the AccessKey may not use)."""
        if self.acl is None:
            return None
        try:
            self.acl.check(ctx.invocation_metadata(), method, topics)
        except Refused as r:
            return self.status(r.code, str(r))
        return None

    @staticmethod
    def _peer(ctx: Any) -> str:
        p = ctx.peer() or ""
        return p.split(":", 1)[1] if p.startswith(("ipv4:", "ipv6:")) else p

    # --- route, session --------------------------------------------------------------------

    async def QueryRoute(self, req: Any, ctx: Any) -> Any:
        pb = self.pb
        refused = self._refusal(ctx, "QueryRoute", ((req.topic.name, ROUTE),))
        if refused is not None:
            return pb.QueryRouteResponse(status=refused)
        try:
            r = await self.route(req.topic.name)
        except Fail as f:
            return pb.QueryRouteResponse(status=self.status(f.code, str(f)))
        types = [getattr(pb.MessageType, t) for t in ALL_TYPES]
        mqs = []
        for q in r.queues:
            broker = pb.Broker(name=q["brokerName"], id=0, endpoints=req.endpoints)
            perm = int(q.get("perm", 0))
            rn, wn = int(q.get("readQueueNums", 0)), int(q.get("writeQueueNums", 0))
            if perm & PERM_READ and perm & PERM_WRITE:
                rw = min(rn, wn)
                parts = [(rn - rw, "READ"), (wn - rw, "WRITE"), (rw, "READ_WRITE")]
            elif perm & PERM_WRITE:
                parts = [(wn, "WRITE")]
            elif perm & PERM_READ:
                parts = [(rn, "READ")]
            else:
                parts = [(max(1, rn, wn), "NONE")]
            qid = 0
            for n, name in parts:
                for _ in range(n):
                    mqs.append(pb.MessageQueue(topic=req.topic, id=qid, permission=getattr(pb.Permission, name),
                                               broker=broker, accept_message_types=types))
                    qid += 1
        return pb.QueryRouteResponse(status=self.status("OK"), message_queues=mqs)

    async def Heartbeat(self, req: Any, ctx: Any) -> Any:
        return self.pb.HeartbeatResponse(status=self._refusal(ctx, "Heartbeat") or self.status("OK"))

    async def NotifyClientTermination(self, req: Any, ctx: Any) -> Any:
        return self.pb.NotifyClientTerminationResponse(status=self._refusal(ctx, "NotifyClientTermination")
                                                       or self.status("OK"))

    async def _settings_answer(self, s: Any) -> Any:
        pb = self.pb
        out = pb.Settings()
        out.CopyFrom(s)
        backoff = out.backoff_policy
        backoff.max_attempts = backoff.max_attempts or (16 if s.client_type in (
            pb.ClientType.PUSH_CONSUMER, pb.ClientType.SIMPLE_CONSUMER) else 3)
        if not backoff.HasField("exponential_backoff") and not backoff.HasField("customized_backoff"):
            backoff.exponential_backoff.initial.CopyFrom(pb.Duration(nanos=10_000_000))
            backoff.exponential_backoff.max.CopyFrom(pb.Duration(seconds=1))
            backoff.exponential_backoff.multiplier = 2.0
        out.metric.Clear()
        out.metric.on = False  # no metric collector behind this proxy (the Java proxy's default, OFF)
        if s.HasField("publishing"):
            out.publishing.max_body_size = self.cfg.max_body_size
            out.publishing.validate_message_type = False
        if s.HasField("subscription"):
            # FIFO is the group's (consumeMessageOrderly), as the Java proxy answers it
            subs = s.subscription.subscriptions
            out.subscription.fifo = bool(subs) and await self.group_fifo(s.subscription.group.name,
                                                                         subs[0].topic.name)
            out.subscription.receive_batch_size = out.subscription.receive_batch_size or 32
            if not out.subscription.HasField("long_polling_timeout"):
                out.subscription.long_polling_timeout.CopyFrom(pb.Duration(seconds=30))
        return out

    async def Telemetry(self, requests: AsyncIterator[Any], ctx: Any) -> AsyncIterator[Any]:
        """Each ``settings`` command is answered with the settings the client runs with; a producer's
        settings register its topics for transaction check-back, whose questions this stream then
        carries (``recover_orphaned_transaction_command``).  Other commands (thread stacks, verify
        results) are read and dropped."""
        md = dict(ctx.invocation_metadata() or ())
        ak: str | None = None
        if self.acl is not None:  # the stream is authenticated once, when it opens
            try:
                ak = self.acl.check(ctx.invocation_metadata(), "Telemetry")
            except Refused as r:
                yield self.pb.TelemetryCommand(status=self.status(r.code, str(r)))
                return
        stream = Stream(str(md.get("x-mq-client-id", "")))
        reader = asyncio.ensure_future(self._telemetry_read(requests, stream, ak))
        try:
            while not (reader.done() and stream.out.empty()):
                get = asyncio.ensure_future(stream.out.get())
                await asyncio.wait((get, reader), return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield get.result()
                else:
                    get.cancel()
        finally:
            reader.cancel()
            self._unregister(self.producers.remove(stream))

    def _allowed(self, ak: str | None, topics: frozenset[str], verb: str) -> tuple[frozenset[str], Any]:
        """``[acl]``: the topics of a client's settings that AccessKey ``ak`` may ``verb``, and the Status
        naming the first refused one (None: all allowed)."""
        if self.acl is None:
            return topics, None
        allowed, refusal = set(), None
        for topic in sorted(topics):
            try:
                self.acl.authorize(ak, topic, verb)
                allowed.add(topic)
            except Refused as r:
                self.acl.refused(r, "Telemetry")
                refusal = refusal or self.status(r.code, str(r))
        return frozenset(allowed), refusal

    async def _telemetry_read(self, requests: AsyncIterator[Any], stream: Stream, ak: str | None = None) -> None:
        try:
            async for cmd in requests:
                if not cmd.HasField("settings"):
                    continue
                answer = await self._settings_answer(cmd.settings)
                refusal = None
                if cmd.settings.HasField("subscription"):
                    _, refusal = self._allowed(ak, frozenset(s.topic.name for s in
                                                             cmd.settings.subscription.subscriptions), CONSUME)
                if cmd.settings.HasField("publishing"):
                    # only topics the AccessKey may send to are registered: check-backs carry half messages
                    topics, refused = self._allowed(ak, frozenset(t.name for t in cmd.settings.publishing.topics),
                                                    SEND)
                    refusal = refusal or refused
                    new, gone = self.producers.publish(stream, topics)
                    if new:
                        self._start_heartbeats()
                    self._unregister(gone)
                await stream.out.put(self.pb.TelemetryCommand(status=refusal or self.status("OK"), settings=answer))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the client went away, or a bad command
            log.debug("telemetry stream of %s ended: %s", stream.client_id, exc)
        finally:
            self._unregister(self.producers.remove(stream))

    # --- send ------------------------------------------------------------------------------

    async def SendMessage(self, req: Any, ctx: Any) -> Any:
        pb = self.pb
        if not req.messages:
            return pb.SendMessageResponse(status=self.status("BAD_REQUEST", "no message"))
        ak: str | None = None
        if self.acl is not None:
            try:
                ak = self.acl.check(ctx.invocation_metadata(), "SendMessage")
            except Refused as r:
                return pb.SendMessageResponse(status=self.status(r.code, str(r)))
        entries = []
        for msg in req.messages:
            try:
                if self.acl is not None:
                    try:
                        self.acl.authorize(ak, msg.topic.name, SEND)
                    except Refused as r:
                        self.acl.refused(r, "SendMessage")
                        raise Fail(r.code, str(r)) from None
                entries.append(await self._send_one(msg, ctx, len(req.messages) == 1))
            except (Fail, BadRequest) as f:
                entries.append(pb.SendResultEntry(status=self.status(f.code, str(f))))
        codes = {e.status.code for e in entries}
        status = entries[0].status if len(codes) == 1 else self.status("MULTIPLE_RESULTS")
        return pb.SendMessageResponse(status=status, entries=entries)

    async def _send_one(self, msg: Any, ctx: Any, single: bool) -> Any:
        pb = self.pb
        topic = msg.topic.name
        if len(msg.body) > self.cfg.max_body_size:
            raise BadRequest("MESSAGE_BODY_TOO_LARGE", f"body over {self.cfg.max_body_size} bytes")
        transactional = msg.system_properties.message_type == pb.MessageType.TRANSACTION
        # a half message's producer group is its topic (as the Java proxy writes it): the broker asks a
        # channel of that group for the transaction's state, i.e. a front with a producer of the topic
        pgroup = topic if transactional else PRODUCER_GROUP
        props, sys_flag = send_properties(pb, msg, pgroup, self._peer(ctx))
        tag = msg.system_properties.tag
        if self.limiter is not None and self.limiter.admit(topic.encode(), tag.encode() if tag else None, 1,
                                                           len(msg.body)) != -1:
            raise Fail("TOO_MANY_REQUESTS", f"send limit of topic {topic} reached")
        r = await self.route(topic)
        if not r.writable:
            raise Fail("FORBIDDEN", f"topic {topic} has no writable queue")
        group = msg.system_properties.message_group
        if group and single:  # one message group, one queue (the proxy hashes it like Java's String.hashCode)
            broker, qid = r.writable[_consistent_hash(_java_hash(group), len(r.writable))]
        else:
            broker, qid = r.writable[next(self._rr) % len(r.writable)]
        born = int(time.time() * 1000)
        try:  # send_properties refused what the property string cannot carry: this is the backstop
            ext = send_header(topic, broker, qid, props, sys_flag, born, pgroup,
                              msg.system_properties.delivery_attempt)
        except ValueError as exc:
            raise BadRequest("BAD_REQUEST", f"the message cannot be written as RocketMQ properties: {exc}") from exc
        resp = await self.broker_call(r.brokers[broker], C.SEND_MESSAGE_V2, ext, bytes(msg.body))
        if resp.code != C.SUCCESS:
            raise Fail(_BROKER_CODES.get(resp.code, "INTERNAL_SERVER_ERROR"),
                       f"broker {broker}: {resp.code} {resp.remark}")
        rx = resp.ext_fields or {}
        tx_id = rx.get("transactionId", "")
        if transactional:
            try:
                tx_id = TxId(commit_log_offset(rx.get("msgId", "")), int(rx.get("queueOffset", "")), broker,
                             tx_id or msg.system_properties.message_id).encode()
            except ValueError as exc:
                raise Fail("INTERNAL_SERVER_ERROR", f"broker {broker}: half message stored, but its answer "
                           f"has no offsets ({exc})") from exc
        return pb.SendResultEntry(status=self.status("OK"), message_id=msg.system_properties.message_id,
                                  transaction_id=tx_id, offset=int(rx.get("queueOffset", 0)))

    async def EndTransaction(self, req: Any, ctx: Any) -> Any:
        """END_TRANSACTION (one-way, as every client sends it) to the half message's broker, named in the
        transaction id the front gave (:class:`TxId`) and looked up in the topic's route."""
        pb = self.pb
        topic = req.topic.name
        resolution = {pb.TransactionResolution.COMMIT: TRANSACTION_COMMIT_TYPE,
                      pb.TransactionResolution.ROLLBACK: TRANSACTION_ROLLBACK_TYPE}.get(req.resolution,
                                                                                        TRANSACTION_NOT_TYPE)
        refused = self._refusal(ctx, "EndTransaction", ((topic, SEND),))
        if refused is not None:
            return pb.EndTransactionResponse(status=refused)
        try:
            tx = TxId.decode(req.transaction_id)
            r = await self.route(topic)
            addr = r.brokers.get(tx.broker)
            if addr is None:
                raise BadRequest("INVALID_TRANSACTION_ID", f"broker {tx.broker} is not in the route of {topic}")
            ext = {"topic": topic, "producerGroup": topic, "tranStateTableOffset": str(tx.queue_offset),
                   "commitLogOffset": str(tx.commit_log_offset), "commitOrRollback": str(resolution),
                   "fromTransactionCheck": "true" if req.source == pb.TransactionSource.SOURCE_SERVER_CHECK
                   else "false", "msgId": req.message_id, "transactionId": tx.transaction_id}
            try:
                await self.pool.oneway(addr, C.END_TRANSACTION, ext)
            except UpstreamError as exc:
                raise Fail("INTERNAL_SERVER_ERROR", str(exc)) from exc
        except (Fail, BadRequest) as f:
            return pb.EndTransactionResponse(status=self.status(f.code, str(f)))
        return pb.EndTransactionResponse(status=self.status("OK"))

    # --- transaction check-back ------------------------------------------------------------

    async def close(self) -> None:
        """Stop the producer registration and pending check-backs, close the upstream connections."""
        for t in [self._heartbeat_task, *self._tasks]:
            if t is not None:
                t.cancel()
        self.stats.notify_connections, self.stats.notify_dropped = self.lanes.opened, self.lanes.dropped
        await self.lanes.close()
        await self.pool.close()

    def _start_heartbeats(self) -> None:
        self._heartbeat_now.set()
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = asyncio.ensure_future(self._heartbeats())

    async def _heartbeats(self) -> None:
        """HEART_BEAT to every broker of the topics this process's producers publish, registering the
        topics as producer groups, at once when a topic is new and then every ``TX_HEARTBEAT`` s."""
        while True:
            self._heartbeat_now.clear()
            groups: dict[str, list[str]] = {}
            for topic in self.producers.topics():
                try:
                    r = await self.route(topic)
                except Fail as f:
                    log.info("producer registration of topic %s: %s", topic, f)
                    continue
                for addr in r.brokers.values():
                    groups.setdefault(addr, []).append(topic)
            for addr, names in groups.items():
                try:
                    resp = await self.pool.request(addr, C.HEART_BEAT, {}, heartbeat_body(self.client_id, names),
                                                   timeout=self.cfg.request_timeout)
                    if resp.code != C.SUCCESS:
                        log.warning("producer registration at %s: code %d %s", addr, resp.code, resp.remark)
                except UpstreamError as exc:
                    log.info("producer registration at %s: %s", addr, exc)
            if not groups and not self.producers.topics():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heartbeat_now.wait(), TX_HEARTBEAT)

    def _unregister(self, topics: set[str]) -> None:
        """UNREGISTER_CLIENT for topics this process no longer has a producer of, so that their brokers
        ask another front (or, with none left, keep the half messages for a later check)."""
        if topics:
            self._spawn(self._unregister_at_brokers(sorted(topics)))

    async def _unregister_at_brokers(self, topics: list[str]) -> None:
        for topic in topics:
            if self.producers.pick(topic) is not None:
                continue  # a producer of it came back meanwhile
            r = self._routes.get(topic)
            for addr in r.brokers.values() if r is not None else ():
                with contextlib.suppress(UpstreamError):
                    await self.pool.request(addr, C.UNREGISTER_CLIENT, {"clientID": self.client_id,
                                                                        "producerGroup": topic},
                                            timeout=self.cfg.request_timeout)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _broker_request(self, conn: Connection, cmd: Any) -> None:
        """A request a broker sent on one of this process's connections: CHECK_TRANSACTION_STATE is
        relayed to a producer of the topic; others need no answer from a producer."""
        if cmd.code == C.CHECK_TRANSACTION_STATE:
            self._spawn(self._check_back(conn.addr, cmd))

    async def _check_back(self, addr: str, cmd: Any) -> None:
        hdr = cmd.ext_fields or {}
        try:
            rec = decode_records(cmd.body)[0]
            clo, qo = int(hdr["commitLogOffset"]), int(hdr["tranStateTableOffset"])
        except (BodyError, IndexError, KeyError, ValueError) as exc:
            log.warning("transaction check from %s not understood: %s", addr, exc)
            return
        # the body is the half message with its real topic and queue (the header's topic is the half topic)
        topic = rec.topic
        group = rec.properties.get("PGROUP", "")
        stream = self.producers.pick(group)
        if stream is None:
            log.info("transaction check from %s for producer group %s: no producer of it here", addr, group)
            return
        try:
            r = await self.route(topic)
        except Fail as f:
            log.info("transaction check from %s: %s", addr, f)
            return
        broker = next((name for name, a in r.brokers.items() if a == addr), None)
        if broker is None:
            log.info("transaction check from %s: not a master of topic %s", addr, topic)
            return
        tx = TxId(clo, qo, broker, hdr.get("transactionId") or rec.properties.get("UNIQ_KEY", ""))
        pb = self.pb
        command = pb.TelemetryCommand(recover_orphaned_transaction_command=pb.RecoverOrphanedTransactionCommand(
            message=to_message(pb, rec, topic, broker), transaction_id=tx.encode()))
        try:
            stream.out.put_nowait(command)
        except asyncio.QueueFull:
            log.warning("transaction check for %s dropped: the Telemetry stream of %s is not read", topic,
                        stream.client_id)

    # --- consume ---------------------------------------------------------------------------

    async def QueryAssignment(self, req: Any, ctx: Any) -> Any:
        pb = self.pb
        refused = self._refusal(ctx, "QueryAssignment", ((req.topic.name, CONSUME),))
        if refused is not None:
            return pb.QueryAssignmentResponse(status=refused)
        try:
            r = await self.route(req.topic.name)
        except Fail as f:
            return pb.QueryAssignmentResponse(status=self.status(f.code, str(f)))
        out = []
        for name in r.readable():
            q = next(q for q in r.queues if q["brokerName"] == name)
            perm = "READ_WRITE" if int(q.get("perm", 0)) & PERM_WRITE else "READ"
            mq = pb.MessageQueue(topic=req.topic, id=-1, permission=getattr(pb.Permission, perm),
                                 broker=pb.Broker(name=name, id=0, endpoints=req.endpoints))
            out.append(pb.Assignment(message_queue=mq))
        if not out:
            return pb.QueryAssignmentResponse(status=self.status("FORBIDDEN", "no readable queue"))
        return pb.QueryAssignmentResponse(status=self.status("OK"), assignments=out)

    def _pop_ext(self, req: Any, topic: str, invisible_ms: int, poll_ms: int, fifo: bool) -> dict[str, str]:
        fe = req.filter_expression
        exp_type = "SQL92" if fe.type == self.pb.FilterType.SQL else "TAG"
        return {
            "consumerGroup": req.group.name, "topic": topic, "queueId": "-1",
            "maxMsgNums": str(max(1, min(req.batch_size or 32, 32))), "invisibleTime": str(invisible_ms),
            "pollTime": str(poll_ms), "bornTime": str(int(time.time() * 1000)), "initMode": "1",  # MAX, as Java's proxy
            "expType": exp_type, "exp": fe.expression or "*", "order": "true" if fifo else "false",
            **({"attemptId": req.attempt_id} if req.attempt_id else {}),
        }

    async def _pop(self, r: Route, broker: str, req: Any, invisible_ms: int, poll_ms: int,
                   timeout: float, fifo: bool = False) -> list[Any]:
        topic = req.message_queue.topic.name
        ext = self._pop_ext(req, topic, invisible_ms, poll_ms, fifo)
        resp = await self.broker_call(r.brokers[broker], C.POP_MESSAGE, ext,
                                      timeout=timeout)
        if resp.code in (C.PULL_NOT_FOUND, POLLING_TIMEOUT):
            return []
        if resp.code != C.SUCCESS:
            raise Fail(_BROKER_CODES.get(resp.code, "INTERNAL_SERVER_ERROR"), f"pop on {broker}: {resp.code} "
                       f"{resp.remark}")
        records = decode_records(resp.body)
        attach_handles(records, resp.ext_fields or {}, broker)
        return [to_message(self.pb, rec, topic, broker) for rec in records]

    async def _notify(self, r: Route, broker: str, req: Any, poll_ms: int, fifo: bool = False) -> str | None:
        ext = {"consumerGroup": req.group.name, "topic": req.message_queue.topic.name, "queueId": "-1",
               "pollTime": str(poll_ms), "bornTime": str(int(time.time() * 1000)),
               "order": "true" if fifo else "false", **({"attemptId": req.attempt_id} if req.attempt_id else {})}
        try:
            resp = await self.lanes.request(r.brokers[broker], C.NOTIFICATION, ext,
                                           timeout=poll_ms / 1000 + self.cfg.request_timeout)
        except UpstreamError as exc:
            log.info("notification to %s failed: %s", broker, exc)
            return None
        has = (resp.ext_fields or {}).get("hasMsg") == "true"
        return broker if resp.code == C.SUCCESS and has else None

    async def _pop_with_notify(self, r: Route, req: Any, invisible_ms: int, deadline: float,
                               fifo: bool = False) -> list[Any]:
        brokers = r.readable()
        if not brokers:
            raise Fail("FORBIDDEN", "no readable queue")
        named = req.message_queue.broker.name
        first = named if named in brokers else brokers[next(self._rr) % len(brokers)]
        if not self.cfg.notify:  # one pop, long-polling on that broker for the whole time
            poll = max(0.0, deadline - time.monotonic())
            return await self._pop(r, first, req, invisible_ms, int(poll * 1000), poll + self.cfg.request_timeout,
                                   fifo)
        msgs = await self._pop(r, first, req, invisible_ms, 0, self.cfg.request_timeout, fifo)
        if msgs:
            self.stats.first_pop_hits += 1
            return msgs
        start = brokers.index(first)
        targets = (brokers[start:] + brokers[:start])[: self.cfg.max_fanout]
        delays = dict.fromkeys(targets, self.cfg.min_poll / 4)

        async def notify(broker: str, delay: float) -> str | None:
            if delay:
                await asyncio.sleep(delay)
            remaining = deadline - time.monotonic()
            if remaining <= self.cfg.min_poll:
                return None
            self.stats.notify_rounds += 1
            return await self._notify(r, broker, req, int(remaining * 1000), fifo)

        tasks = {asyncio.ensure_future(notify(b, 0.0)): b for b in targets}
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    return []  # the long poll is over
                for t in done:
                    broker = tasks.pop(t)
                    if t.result() is not None:
                        self.stats.notify_hits += 1
                        msgs = await self._pop(r, broker, req, invisible_ms, 0, self.cfg.request_timeout, fifo)
                        if msgs:
                            return msgs
                        self.stats.empty_after_hit += 1
                    # nothing from this broker although time remains: hasMsg but the pop found nothing
                    # (another consumer was faster, or the broker's consume offset lags the acks), or
                    # the notification failed.  Ask this broker again after a back-off that doubles up
                    # to 1 s, so that a message arriving there is not missed and nothing spins.
                    if deadline - time.monotonic() > self.cfg.min_poll:
                        tasks[asyncio.ensure_future(notify(broker, delays[broker]))] = broker
                        delays[broker] = min(1.0, delays[broker] * 2)
        finally:
            for t in tasks:
                t.cancel()
        return []

    async def ReceiveMessage(self, req: Any, ctx: Any) -> AsyncIterator[Any]:
        """Server streaming as the Java proxy writes it: a status, the messages (if any), and last the
        proxy's clock as ``delivery_timestamp`` (the clients measure delivery latency from it)."""
        for answer in await self._receive(req, ctx):
            yield answer
        now = time.time_ns()
        yield self.pb.ReceiveMessageResponse(delivery_timestamp=self.pb.Timestamp(seconds=now // 1_000_000_000,
                                                                                  nanos=now % 1_000_000_000))

    async def _receive(self, req: Any, ctx: Any) -> list[Any]:
        pb = self.pb
        self.stats.receives += 1
        refused = self._refusal(ctx, "ReceiveMessage", ((req.message_queue.topic.name, CONSUME),))
        if refused is not None:
            return [pb.ReceiveMessageResponse(status=refused)]
        long_poll = req.long_polling_timeout.seconds + req.long_polling_timeout.nanos / 1e9
        left = ctx.time_remaining()
        if left is not None:
            long_poll = min(long_poll, max(0.0, left - self.cfg.long_poll_reserve))
        invisible = req.invisible_duration
        invisible_ms = invisible.seconds * 1000 + invisible.nanos // 1_000_000 if req.HasField(
            "invisible_duration") else int(self.cfg.default_invisible * 1000)
        deadline = time.monotonic() + long_poll
        try:
            topic = req.message_queue.topic.name
            r = await self.route(topic)
            fifo = await self.group_fifo(req.group.name, topic)
            msgs = await self._pop_with_notify(r, req, invisible_ms, deadline, fifo)
        except (Fail, BadRequest) as f:
            return [pb.ReceiveMessageResponse(status=self.status(f.code, str(f)))]
        except Exception as exc:
            log.exception("receive failed")
            return [pb.ReceiveMessageResponse(status=self.status("INTERNAL_SERVER_ERROR", str(exc)))]
        if not msgs:
            self.stats.empty += 1
            return [pb.ReceiveMessageResponse(status=self.status("MESSAGE_NOT_FOUND", "no new message"))]
        return [pb.ReceiveMessageResponse(status=self.status("OK"))] + [pb.ReceiveMessageResponse(message=m)
                                                                          for m in msgs]

    async def _handle_call(self, topic: str, group: str, handle: ReceiptHandle, code: int,
                           extra: dict[str, str]) -> Any:
        r = await self.route(topic)
        addr = r.brokers.get(handle.broker)
        if addr is None:
            raise Fail("INVALID_RECEIPT_HANDLE", f"broker {handle.broker} is not in the route of {topic}")
        ext = {"consumerGroup": group, "topic": handle.real_topic(topic, group), "queueId": str(handle.queue_id),
               "extraInfo": handle.text, "offset": str(handle.offset), **extra}
        resp = await self.broker_call(addr, code, ext)
        if resp.code != C.SUCCESS:
            raise Fail("INVALID_RECEIPT_HANDLE" if resp.code == 20 else "INTERNAL_SERVER_ERROR",
                       f"{handle.broker}: {resp.code} {resp.remark}")
        return resp

    async def AckMessage(self, req: Any, ctx: Any) -> Any:
        pb = self.pb
        refused = self._refusal(ctx, "AckMessage", ((req.topic.name, CONSUME),))
        if refused is not None:
            return pb.AckMessageResponse(status=refused)
        entries = []
        for e in req.entries:
            try:
                await self._handle_call(req.topic.name, req.group.name, ReceiptHandle.decode(e.receipt_handle),
                                        C.ACK_MESSAGE, {})
                st = self.status("OK")
            except (Fail, BadRequest) as f:
                st = self.status(f.code, str(f))
            entries.append(pb.AckMessageResultEntry(message_id=e.message_id, receipt_handle=e.receipt_handle,
                                                    status=st))
        codes = {x.status.code for x in entries}
        status = entries[0].status if len(codes) == 1 else self.status("MULTIPLE_RESULTS")
        return pb.AckMessageResponse(status=status, entries=entries)

    async def ChangeInvisibleDuration(self, req: Any, ctx: Any) -> Any:
        pb = self.pb
        ms = req.invisible_duration.seconds * 1000 + req.invisible_duration.nanos // 1_000_000
        refused = self._refusal(ctx, "ChangeInvisibleDuration", ((req.topic.name, CONSUME),))
        if refused is not None:
            return pb.ChangeInvisibleDurationResponse(status=refused)
        try:
            handle = ReceiptHandle.decode(req.receipt_handle)
            resp = await self._handle_call(req.topic.name, req.group.name, handle, C.CHANGE_MESSAGE_INVISIBLETIME,
                                           {"invisibleTime": str(ms)})
        except (Fail, BadRequest) as f:
            return pb.ChangeInvisibleDurationResponse(status=self.status(f.code, str(f)))
        rx = resp.ext_fields or {}
        new = handle.renewed(int(rx.get("popTime", 0)), int(rx.get("invisibleTime", ms)), int(rx.get("reviveQid", 0)))
        return pb.ChangeInvisibleDurationResponse(status=self.status("OK"), receipt_handle=new)

    async def ForwardMessageToDeadLetterQueue(self, req: Any, ctx: Any) -> Any:
        """CONSUMER_SEND_MSG_BACK with delay level -1 (straight to ``%DLQ%group``) to the broker of the
        receipt handle, then the message is acked there, as the Java proxy does."""
        pb = self.pb
        topic, group = req.topic.name, req.group.name
        refused = self._refusal(ctx, "ForwardMessageToDeadLetterQueue", ((topic, CONSUME),))
        if refused is not None:
            return pb.ForwardMessageToDeadLetterQueueResponse(status=refused)
        try:
            handle = ReceiptHandle.decode(req.receipt_handle)
            if handle.commit_log_offset < 0:
                raise BadRequest("INVALID_RECEIPT_HANDLE", "the receipt handle has no commit-log offset")
            r = await self.route(topic)
            addr = r.brokers.get(handle.broker)
            if addr is None:
                raise Fail("INVALID_RECEIPT_HANDLE", f"broker {handle.broker} is not in the route of {topic}")
            ext = {"offset": str(handle.commit_log_offset), "group": group, "delayLevel": "-1",
                   "originMsgId": req.message_id, "originTopic": handle.real_topic(topic, group),
                   "unitMode": "false", "maxReconsumeTimes": "0"}
            resp = await self.broker_call(addr, C.CONSUMER_SEND_MSG_BACK, ext)
            if resp.code != C.SUCCESS:
                raise Fail(_BROKER_CODES.get(resp.code, "INTERNAL_SERVER_ERROR"),
                           f"{handle.broker}: {resp.code} {resp.remark}")
            await self._handle_call(topic, group, handle, C.ACK_MESSAGE, {})
        except (Fail, BadRequest) as f:
            return pb.ForwardMessageToDeadLetterQueueResponse(status=self.status(f.code, str(f)))
        return pb.ForwardMessageToDeadLetterQueueResponse(status=self.status("OK"))

    # --- wiring ----------------------------------------------------------------------------

    SERVED = ("QueryRoute", "Heartbeat", "Telemetry", "SendMessage", "QueryAssignment", "ReceiveMessage",
              "AckMessage", "ChangeInvisibleDuration", "NotifyClientTermination", "ForwardMessageToDeadLetterQueue",
              "EndTransaction")

    def handler(self) -> grpc.GenericRpcHandler:
        """The served methods; the others answer gRPC ``UNIMPLEMENTED``."""
        handlers = {}
        for m in self.pb.service.methods:
            if m.name not in self.SERVED:
                continue
            fn = getattr(self, m.name)
            req_cls = getattr(self.pb, m.input_type.name)
            resp_cls = getattr(self.pb, m.output_type.name)
            kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                    (False, True): grpc.unary_stream_rpc_method_handler,
                    (True, True): grpc.stream_stream_rpc_method_handler}[(m.client_streaming, m.server_streaming)]
            handlers[m.name] = kind(fn, request_deserializer=req_cls.FromString,
                                    response_serializer=resp_cls.SerializeToString)
        return grpc.method_handlers_generic_handler(self.pb.service.full_name, handlers)


def _java_hash(s: str) -> int:
    """Java's ``String.hashCode`` (UTF-16 code units)."""
    h = 0
    data = s.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + ((data[i] << 8) | data[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def _consistent_hash(key: int, buckets: int) -> int:
    """Guava's ``Hashing.consistentHash(long, int)`` (the Java proxy's queue choice for a message group)."""
    state = key & 0xFFFFFFFFFFFFFFFF
    candidate = 0
    while True:
        state = (2862933555777941757 * state + 1) & 0xFFFFFFFFFFFFFFFF
        nxt = int((candidate + 1) / (((state >> 33) + 1) / 2147483648.0))
        if 0 <= nxt < buckets:
            candidate = nxt
        else:
            return candidate


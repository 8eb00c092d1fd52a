"""Peak shaving: ``[[limits.rule]] mode = "shape"``.

A shape rule limits like ``limit`` (same GCRA bucket, shared by every worker), but a send it
refuses is not answered SYSTEM_BUSY: the send-limit filter (:mod:`rmqfast.filters.limits`)
hands it here (:func:`shape_send`) and

1. it is committed, synced, to the worker's spill (the RocksDB of cross-cloud delivery,
   ``<state_dir>/spill/worker-<N>``, group commit: concurrent producers share an fsync), in a
   lane of its own: remote ``@shape:<broker host:port>`` (the local broker the producer's
   connection goes to), topic = the send's topic;
2. once synced, the producer gets SUCCESS with the ext fields of a broker's send response
   (:func:`shaped_answer`: ``msgId`` = the message's ``UNIQ_KEY``, its ``queueId``,
   ``queueOffset`` -1, ``MSG_REGION``, ``TRACE_ON``) and the remark "accepted by rmqfast proxy
   (shaped); delivered later";
3. a releaser greenlet per lane sends the lane's messages, in order, one at a time, to that
   broker (``SEND_MESSAGE_V2`` / ``SEND_BATCH_MESSAGE``, the producer's header fields and queue),
   each after taking its tokens from the same shared buckets (the whole rule chain: tag rule,
   topic rule, global limit), so direct sends and releases together keep the configured rate;
   it deletes a message from the spill once the broker answered SUCCESS (at least once: a crash
   between the two sends it again).

Order: once a topic has a shaped backlog in a worker, every shape rule that covers the topic is
*held* in that worker (:meth:`WorkerLimits.set_held`): the scanner refuses every send those rules
cover without charging a token, so later sends queue behind the backlog instead of overtaking
it, until the releaser has delivered the last one.  A producer's connection lives in one worker,
so a producer's sends keep their order (per queue, as the broker keeps it).

Full spill (``replicate.disk_cap_bytes``), an unusable spill, a prepared transaction half (its
END_TRANSACTION needs a real broker offset) or an undecodable send: SYSTEM_BUSY, as ``limit``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import gevent
from gevent.event import Event

from rmqfast.clouds.remoting import ConnectionPool
from rmqfast.clouds.send import send_until_stored
from rmqfast.codec import codes as C
from rmqfast.codec.batch import decode_batch
from rmqfast.codec.command import RemotingCommand, encode, make_response
from rmqfast.codec.properties import TAGS, UNIQ_KEY, parse_properties
from rmqfast.codec.sendheader import TRANSACTION_PREPARED, field_int, is_batch, send_fields
from rmqfast.config import Config
from rmqfast.filters.api import SEND_RESPONSE_EXT, Frame, Verdict, busy_answer, divert, reply
from rmqfast.log import ctx
from rmqfast.spill.commit import CommitFailed, GroupCommitter
from rmqfast.spill.record import CopyRecord
from rmqfast.spill.store import SHAPE_REMOTE_PREFIX, SpillStore, lane_prefix, worker_dir

log = logging.getLogger("rmqfast.limits")

#: ``queueOffset`` of a shaped answer: the broker has not stored the message yet, so there is none.
SHAPED_QUEUE_OFFSET = -1
SHAPED_REMARK = "rmqfast: accepted by rmqfast proxy (shaped); delivered later"
#: Messages read from the spill per lane per pass.
READ_AHEAD = 64
#: A drained lane's releaser ends after this many idle seconds (a new backlog starts another).
LANE_IDLE = 30.0


def lane_remote(broker_addr: str) -> str:
    return SHAPE_REMOTE_PREFIX + broker_addr


def shaped_answer(request: RemotingCommand, msg_id: str, queue_id: int, remark: str = SHAPED_REMARK) -> bytes:
    """SUCCESS for a shaped send, with every field a Java client reads from a send response.

    ``SendMessageResponseHeader`` needs ``msgId``, ``queueId`` and ``queueOffset`` (the client
    builds its ``SendResult`` from them; 5.x logs and then fails on a missing one), and the
    client reads ``MSG_REGION`` and ``TRACE_ON`` from the ext fields.  ``msgId`` is the
    message's ``UNIQ_KEY`` (comma-separated for a batch): the client's ``SendResult.getMsgId()``
    is the UNIQ_KEY anyway, and ``getOffsetMsgId()`` becomes the UNIQ_KEY too (no broker offset
    exists yet).
    """
    ext = {"msgId": msg_id, "queueId": str(max(queue_id, 0)), "queueOffset": str(SHAPED_QUEUE_OFFSET),
           **SEND_RESPONSE_EXT}
    return encode(make_response(request, C.SUCCESS, remark, ext_fields=ext))


class ShapeMetrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.shaped = Counter(
            "rmqfast_limit_shaped_total",
            "Messages over a shape rule's limit committed to the spill and answered SUCCESS by the proxy, "
            "to be released later (batches count every message)", ["topic", "tag"],
        )
        self.released = Counter(
            "rmqfast_limit_released_total", "Shaped messages the local broker stored, by topic", ["topic"]
        )
        self.dropped = Counter(
            "rmqfast_limit_shape_dropped_total",
            "Shaped messages given up (the broker refused them for good, or undecodable), by topic and reason",
            ["topic", "reason"],
        )
        self.backlog_messages = Gauge(
            "rmqfast_limit_shaped_backlog_messages", "Shaped messages waiting for release, by topic",
            ["topic"], multiprocess_mode="livesum",
        )
        self.backlog_bytes = Gauge(
            "rmqfast_limit_shaped_backlog_bytes", "Bytes of shaped messages waiting for release, by topic",
            ["topic"], multiprocess_mode="livesum",
        )
        self.backlog_oldest = Gauge(
            "rmqfast_limit_shaped_backlog_oldest_seconds", "Age of the oldest shaped message waiting, by topic",
            ["topic"], multiprocess_mode="livemax",
        )


_metrics: ShapeMetrics | None = None


def shape_metrics() -> ShapeMetrics:
    """The process's shaping metrics (registered once)."""
    global _metrics
    if _metrics is None:
        _metrics = ShapeMetrics()
    return _metrics


@dataclass
class ShapeLane:
    addr: str  # the local broker ("host:port") the producer's connection went to
    topic: str
    # shaped, commit not finished (the lane is not empty); the releaser stops before them: a
    # written batch is readable a moment before the committer has accounted for it
    pending: set[int] = field(default_factory=set)
    cursor: int = -1  # highest sequence read from the spill
    buf: deque[tuple[int, bytes]] = field(default_factory=deque)
    wake: Event = field(default_factory=Event)
    greenlet: Any = None

    @property
    def remote(self) -> str:
        return lane_remote(self.addr)


def shaping_wanted(cfg: Config, index: int, store: SpillStore | None = None) -> bool:
    """Whether a worker needs a shaper: a shape rule, or a spill that holds (or may hold) a shaped
    backlog (``store``: the replicator's open spill; else the worker's spill directory exists)."""
    if any(r.mode == "shape" for r in cfg.limits.rules):
        return True
    if store is not None:
        return any(remote.startswith(SHAPE_REMOTE_PREFIX) for remote, _t in store.lanes)
    return worker_dir(cfg.proxy.state_dir, index).exists()


class Shaper:
    """One worker's peak shaving: shaped sends into the spill, releasers out of it."""

    def __init__(
        self,
        cfg: Config,
        index: int,
        limits: Any,
        *,
        store: SpillStore | None = None,
        committer: GroupCommitter | None = None,
        metrics: Any = None,
        publish: bool = True,
        request_timeout: float = 5.0,
    ) -> None:
        rp = cfg.replicate
        self.index = index
        self.limits = limits  # rmqfast.limits.worker.WorkerLimits
        self.metrics = metrics  # the worker's rmqfast.metrics.Metrics (limit_rejected), or None
        self.m = shape_metrics() if publish else None
        self.own_store = store is None
        self.store = store if store is not None else SpillStore(
            worker_dir(cfg.proxy.state_dir, index), write_buffer_bytes=rp.write_buffer_bytes,
            block_cache_bytes=rp.block_cache_bytes, disk_cap_bytes=rp.disk_cap_bytes,
        )
        # shaped sends are always synced, whatever replicate.durability says
        self.own_committer = committer is None
        self.committer = committer if committer is not None else GroupCommitter(self.store)
        self.pool = ConnectionPool(cfg.proxy.connect_timeout)
        self.request_timeout = request_timeout
        self.retry_initial = rp.retry_initial
        self.retry_max = rp.retry_max
        self.lanes: dict[tuple[str, str], ShapeLane] = {}
        self.started = False
        self.closed = False
        self.shaped = 0
        self.released = 0
        self.dropped = 0
        self.refused = 0
        self._published: set[str] = set()
        for remote, topic in list(self.store.lanes):  # a backlog left by the previous run
            if remote.startswith(SHAPE_REMOTE_PREFIX):
                self._lane(remote[len(SHAPE_REMOTE_PREFIX):], topic)
        if self.lanes:
            log.info("resuming shaped backlog", extra=ctx(worker=index, lanes=len(self.lanes),
                                                          messages=self.backlog_messages()))
        self.update_holds()

    @property
    def needed(self) -> bool:
        return bool(self.lanes) or any(r.mode == "shape" for r in self.limits.section.rules)

    # Lanes and holds ----------------------------------------------------------------------------

    def _lane(self, addr: str, topic: str) -> ShapeLane:
        ln = self.lanes.get((addr, topic))
        if ln is None:
            ln = self.lanes[(addr, topic)] = ShapeLane(addr, topic)
            if self.started:
                ln.greenlet = gevent.spawn(self._release_loop, ln)
        return ln

    def _busy_lane(self, ln: ShapeLane) -> bool:
        return bool(ln.pending) or bool(ln.buf) or (ln.remote, ln.topic) in self.store.lanes

    def backlog_topics(self) -> set[str]:
        return {ln.topic for ln in self.lanes.values() if self._busy_lane(ln)}

    def backlog_messages(self) -> int:
        return sum(st.messages for (r, _t), st in self.store.lanes.items() if r.startswith(SHAPE_REMOTE_PREFIX)) + sum(
            len(ln.pending) for ln in self.lanes.values())

    def update_holds(self) -> None:
        """Hold every shape rule that covers a topic with a backlog here; release the others."""
        topics = self.backlog_topics()
        keys = {r.key for r in self.limits.section.rules
                if r.mode == "shape" and any(r.covers_topic(t) for t in topics)}
        if self.limits.set_held(keys):
            log.info("shaping holds changed", extra=ctx(worker=self.index, backlog_topics=sorted(topics),
                                                        held=sorted(f"{t}/{g or ''}" for t, g in keys)))

    def reconfigure(self) -> None:
        """Rules changed (reload, admin endpoint): holds follow the new shape rules."""
        self.update_holds()

    # Shaping (the relay's side) -----------------------------------------------------------------

    def _refuse(self, cmd: RemotingCommand | None, frame: Frame, rule: Any, why: str) -> Verdict:
        self.refused += 1
        what = rule.describe() if rule is not None else "a send limit"
        log.warning("shaped send refused", extra=ctx(worker=self.index, rule=what, reason=why))
        if self.metrics is not None and rule is not None:
            self.metrics.limit_rejected.labels(rule.topic or "(global)", rule.tag or "").inc()
        if frame.is_oneway or cmd is None:
            return divert(why)
        return reply(busy_answer(cmd, f"rmqfast: {what} and the send cannot be shaped ({why}); retry later"))

    def _unshapeable(self, ext: dict[str, str], upstream_addr: str) -> str:
        """Why a send with these header fields cannot be shaped now ("": it can)."""
        if not ext.get("b"):
            return "the send names no topic"
        if field_int(ext.get("f")) & TRANSACTION_PREPARED:
            return "a prepared transaction half needs a broker offset"
        if self.closed:
            return "the worker is stopping"
        if not upstream_addr:
            return "no broker connection"
        return ""

    def shape(self, frame: Frame, index: int, upstream_addr: str) -> Verdict:
        """Commit a send refused by shape rule ``index`` to the spill; the relay's verdict.

        The calling greenlet (the connection's client-to-broker pump) waits for the synced
        group commit, then the verdict is a SUCCESS ``reply`` (``divert`` for a oneway send), or
        a SYSTEM_BUSY ``reply`` when the send cannot be shaped.  (The answer is written by the
        pump that read the request, like every proxy-made answer: another greenlet could write it
        into the middle of a response the broker-to-client pump is still forwarding.)
        """
        rule = self.limits.rule(index)
        try:
            cmd = frame.command()
        except ValueError as exc:
            return self._refuse(None, frame, rule, f"undecodable send: {exc}")
        ext = cmd.ext_fields or {}
        if "AccessKey" in ext:  # ACL (rmqfast.proxy.acl): the release is the proxy's own request
            return self._refuse(cmd, frame, rule, "a signed send (AccessKey) cannot be released later: the proxy "
                                "holds no secret key to sign the release")
        ext = send_fields(frame.code, ext)
        why = self._unshapeable(ext, upstream_addr)
        if why:
            return self._refuse(cmd, frame, rule, why)
        topic = ext["b"]
        props = ext.get("i") or ""
        batch = is_batch(frame.code, cmd.ext_fields)
        msgs = 1
        if batch:
            try:
                entries = decode_batch(cmd.body)
            except ValueError as exc:
                return self._refuse(cmd, frame, rule, f"undecodable batch body: {exc}")
            msgs = max(1, len(entries))
            ids = [e.properties.get(UNIQ_KEY) for e in entries]
            msg_id = ",".join(i for i in ids if i) or uuid.uuid4().hex.upper()
        else:
            msg_id = (parse_properties(props).get(UNIQ_KEY) if props else None) or ""
            if not msg_id:  # clients other than Java may not set one: give it one, so msgId means something
                msg_id = uuid.uuid4().hex.upper()
                props = props + ("" if not props or props.endswith("\x02") else "\x02") + f"{UNIQ_KEY}\x01{msg_id}\x02"
        rec = CopyRecord.from_send(ext, body=cmd.body, properties=props, batch=batch,
                                   created_ms=int(time.time() * 1000))
        queue_id = rec.queue_id
        value = rec.encode()
        remote = lane_remote(upstream_addr)
        if self.store.would_exceed(len(lane_prefix(remote, topic)) + 8 + len(value)):
            return self._refuse(cmd, frame, rule, f"the spill of worker {self.index} is full: {self.store.bytes} of "
                                                  f"{self.store.disk_cap_bytes} bytes, replicate.disk_cap_bytes")
        ln = self._lane(upstream_addr, topic)
        was_busy = self._busy_lane(ln)
        seq = self.store.next_seq()
        try:
            pending = self.committer.enqueue([(remote, topic, seq, value)])
        except CommitFailed as exc:
            return self._refuse(cmd, frame, rule, str(exc))
        ln.pending.add(seq)
        if not was_busy:
            self.update_holds()  # before anything else of this topic can pass: later sends queue behind
        try:
            self.committer.wait(pending)
            failed = ""
        except CommitFailed as exc:
            failed = str(exc)
        finally:
            ln.pending.discard(seq)
            ln.wake.set()
        if failed:
            log.error("shaped send not stored; the producer is told SYSTEM_BUSY",
                      extra=ctx(worker=self.index, topic=topic, error=failed))
            self.update_holds()
            return self._refuse(cmd, frame, rule, f"the synced spill write failed: {failed}")
        self.shaped += msgs
        if self.m is not None and rule is not None:
            self.m.shaped.labels(rule.topic or "(global)", rule.tag or "").inc(msgs)
        if frame.is_oneway:
            return divert("shaped")
        return reply(shaped_answer(cmd, msg_id, queue_id))

    # Releasing ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.started = True
        for ln in self.lanes.values():
            if ln.greenlet is None:
                ln.greenlet = gevent.spawn(self._release_loop, ln)

    def _release_loop(self, ln: ShapeLane) -> None:
        idle_since: float | None = None
        while not self.closed:
            try:
                if not ln.buf:
                    for s, v in self.store.read_lane(ln.remote, ln.topic, ln.cursor, READ_AHEAD):
                        ln.buf.append((s, v))
                        ln.cursor = s
                if not ln.buf:
                    if not self._busy_lane(ln):
                        self.update_holds()
                        now = time.monotonic()
                        idle_since = idle_since or now
                        if now - idle_since > LANE_IDLE and self.lanes.get((ln.addr, ln.topic)) is ln:
                            del self.lanes[(ln.addr, ln.topic)]  # a new backlog starts a new releaser
                            return
                    ln.wake.clear()
                    ln.wake.wait(timeout=1.0)
                    continue
                idle_since = None
                seq, value = ln.buf[0]
                if ln.pending and seq >= min(ln.pending):
                    ln.wake.clear()
                    ln.wake.wait(timeout=0.05)  # its commit is finishing
                    continue
                outcome = self._release_one(ln, value)
                if outcome is None:  # stopping: it stays in the spill for the next run
                    return
                ln.buf.popleft()
                self.store.delete([(ln.remote, ln.topic, seq, len(value))])
                if not self._busy_lane(ln):
                    self.update_holds()
            except Exception:  # the releaser must not die: log, wait, go on
                log.exception("shaped backlog release failed; retrying", extra=ctx(worker=self.index, topic=ln.topic))
                ln.buf.clear()
                ln.cursor = -1
                gevent.sleep(1.0)

    def _release_one(self, ln: ShapeLane, value: bytes) -> bool | None:
        """Take the tokens and send one message; True stored, False given up, None stopping."""
        try:
            rec = CopyRecord.decode(value)
        except ValueError as exc:
            log.error("undecodable shaped message; giving it up", extra=ctx(topic=ln.topic, error=str(exc)))
            self._drop(ln.topic, "undecodable")
            return False
        tag = parse_properties(rec.properties).get(TAGS) if rec.properties else None
        msgs = 1
        if rec.is_batch:
            try:
                msgs = max(1, len(decode_batch(rec.body)))
            except ValueError:
                msgs = 1
        if not self._take_tokens(rec.topic, tag, msgs, len(value)):
            return None
        stored = self._send(ln, rec)
        if stored:
            self.released += msgs
            if self.m is not None:
                self.m.released.labels(rec.topic).inc(msgs)
        return stored

    def _take_tokens(self, topic: str, tag: str | None, msgs: int, nbytes: int) -> bool:
        """Wait until the rule chain admits the message (False: stopping)."""
        t = topic.encode()
        g = tag.encode() if tag is not None else None
        while not self.closed:
            lim = self.limits.release_limiter()
            r = lim.admit(t, g, msgs, nbytes)
            if r < 0:
                return True
            rule = self.limits.rule(r)
            if rule is None or rule.mode == "reject":
                gevent.sleep(0.5)  # switched to reject (a circuit breaker): the backlog waits
            elif rule.rate:
                gevent.sleep(min(0.05, max(0.0005, 1.0 / rule.rate / 20)))
            else:
                gevent.sleep(0.005)
        return False

    def _send(self, ln: ShapeLane, rec: CopyRecord) -> bool | None:
        """Send to the local broker until it stores it (True) or refuses it for good (False)."""
        return send_until_stored(self.pool, ln.addr, rec, what="shaped", logger=log, stopping=lambda: self.closed,
                                 retry_initial=self.retry_initial, retry_max=self.retry_max,
                                 timeout=self.request_timeout, drop=lambda why: self._drop(rec.topic, why),
                                 worker=self.index)

    def _drop(self, topic: str, reason: str) -> None:
        self.dropped += 1
        if self.m is not None:
            self.m.dropped.labels(topic, reason).inc()

    # Metrics and lifecycle ----------------------------------------------------------------------

    def backlog(self) -> dict[str, tuple[int, int, float | None]]:
        """(messages, bytes, oldest age in seconds) per topic."""
        now_ms = time.time() * 1000
        acc: dict[str, list[Any]] = {}
        for (remote, topic), st in self.store.lanes.items():
            if not remote.startswith(SHAPE_REMOTE_PREFIX):
                continue
            a = acc.setdefault(topic, [0, 0, None])
            a[0] += st.messages
            a[1] += st.bytes
            oldest = self.store.oldest_ms(remote, topic)
            if oldest is not None and (a[2] is None or oldest < a[2]):
                a[2] = oldest
        for ln in self.lanes.values():
            if ln.pending:
                acc.setdefault(ln.topic, [0, 0, None])[0] += len(ln.pending)
        return {t: (a[0], a[1], max(0.0, (now_ms - a[2]) / 1000) if a[2] is not None else None)
                for t, a in acc.items()}

    def publish(self) -> None:
        if self.m is None:
            return
        b = self.backlog()
        for t in self._published - set(b):
            self.m.backlog_messages.labels(t).set(0)
            self.m.backlog_bytes.labels(t).set(0)
            self.m.backlog_oldest.labels(t).set(0)
        for t, (n, nb, age) in b.items():
            self.m.backlog_messages.labels(t).set(n)
            self.m.backlog_bytes.labels(t).set(nb)
            self.m.backlog_oldest.labels(t).set(age or 0)
        self._published |= set(b)

    def close(self) -> None:
        """Stop releasing; what is not released stays in the spill for the next run."""
        if self.closed:
            return
        self.closed = True
        for ln in self.lanes.values():
            ln.wake.set()
            if ln.greenlet is not None:
                ln.greenlet.kill(block=False)
        if self.own_committer:
            self.committer.close()
        self.pool.close()
        if self.own_store:
            self.store.close()


def shape_send(limits: Any, frame: Frame, index: int, upstream_addr: str) -> Verdict:
    """The relay's entry: shape a send refused by shape rule ``index`` (SYSTEM_BUSY without a shaper)."""
    shaper = getattr(limits, "shaper", None)
    if shaper is not None:
        return shaper.shape(frame, index, upstream_addr)
    try:
        cmd = frame.command()
    except ValueError:
        return divert("undecodable send over a shape rule")
    if frame.is_oneway:
        return divert("shaping unavailable")
    return reply(busy_answer(
        cmd, f"rmqfast: {limits.rule_description(index)} and shaping is unavailable in this worker "
             "(its spill could not be opened; see the proxy log); retry later"))

"""Proxy-held delayed messages, worker side: the filter that holds them, the releaser, cancel.

* :class:`DelayFilter` sees the sends (10, 310, 320) of the topics ``[delay] topics`` names.  A
  send whose properties ask for a delivery time (:mod:`rmqfast.delay.semantics`) is stored,
  synced (group commit: concurrent producers share an fsync), in the worker's RocksDB spill,
  keyed by due time, with the delivery-time properties removed; then the producer gets SUCCESS
  made by the proxy: ``msgId`` = the message's ``UNIQ_KEY`` (what the consumer sees as msgId),
  ``queueId`` = the queue the producer chose (the release goes to that queue of that broker),
  ``queueOffset`` = -1 (the broker has not stored it yet: there is no offset before the release).
* :class:`Releaser` seeks the due-time keys from its cursor and sends what is due, in due-time
  order, to the broker the producer's connection went to (one lane per broker, topic and queue:
  a lane sends one message at a time, so the order of due times holds in every queue; lanes run
  side by side).  A message is deleted once the broker answered SUCCESS (at least once: a crash
  between the two sends it again; see :meth:`Releaser._recheck`, which asks the broker first).
* Cancel: :func:`rmqfast.delay.cancel.request_cancel` drops a request file that every worker
  applies to its own store (msgId or key).
"""

from __future__ import annotations

import logging
import struct
import time
import uuid
from collections import deque
from typing import Any

import gevent
from gevent.event import Event

from rmqfast.clouds.remoting import ConnectionPool, RemoteError
from rmqfast.clouds.send import STORED_CODES, send_until_stored
from rmqfast.codec import codes as C
from rmqfast.codec.batch import decode_batch, encode_batch
from rmqfast.codec.command import RemotingCommand, encode, make_response
from rmqfast.codec.properties import KEYS, UNIQ_KEY, parse_properties
from rmqfast.codec.sendheader import TRANSACTION_PREPARED, field_int, is_batch, send_fields
from rmqfast.delay.channel import ReleaseChannel, Sent
from rmqfast.delay.semantics import DelayInvalid, due_ms, has_delay_property, strip_delay
from rmqfast.delay.settings import DelaySection
from rmqfast.delay.store import (
    DUE_PREFIX,
    DelayStore,
    Held,
    StoreFull,
    WriteFailed,
    due_key,
    parked_key,
    parked_prefix,
    split_due_key,
)
from rmqfast.log import ctx
from rmqfast.proxy.policy import Filter, Frame, Session, Verdict, divert, reply
from rmqfast.proxy.quicktopic import quick_topic
from rmqfast.spill.record import CopyRecord

log = logging.getLogger("rmqfast.delay")

MESSAGE_ILLEGAL = 13
HELD_QUEUE_OFFSET = -1
#: A release the broker answers TOPIC_NOT_EXIST this many times in a row (back-off between
#: attempts: [replicate] retry_initial .. retry_max) is kept as a dead letter instead.
MISSING_TOPIC_ATTEMPTS = 20
DEAD_LETTER = "dead_letter"
#: What a broker refuses for good (MESSAGE_ILLEGAL) whatever the retry: a body over its default
#: ``maxMessageSize`` (4 MiB) or properties longer than a short (the commit-log record's field).
#: Held messages are acknowledged before the broker sees them, so these are refused up front.
BROKER_MAX_BODY = 4 * 1024 * 1024
BROKER_MAX_PROPERTIES = 32767
HELD_REMARK = "rmqfast: accepted by rmqfast proxy (delayed); delivered at its due time"
_RESPONSE_EXT = {"MSG_REGION": "DefaultRegion", "TRACE_ON": "false"}
#: How often (seconds) a busy worker gives free heap pages back to the system (see DelayService._trim)
TRIM_EVERY = 2.0
#: Held messages are read this long before they fall due (decoded and queued in their lane), so
#: that at the due time only the write to the broker is left.
READ_AHEAD_MS = 20
#: A message queued for release: due key, stored value, the decoded message, due time (epoch ms).
Item = tuple[bytes, bytes, Held, int]
LATENESS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


def now_ms() -> int:
    return int(time.time() * 1000)


class DelayMetrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.accepted = Counter("rmqfast_delay_accepted_total",
                                "Delayed sends stored by the proxy and answered SUCCESS, by topic", ["topic"])
        self.rejected = Counter("rmqfast_delay_rejected_total",
                                "Delayed sends refused, by reason (full, too_far, invalid, write_failed...)",
                                ["reason"])
        self.released = Counter("rmqfast_delay_released_total",
                                "Held messages the broker stored at their due time, by topic", ["topic"])
        self.cancelled = Counter("rmqfast_delay_cancelled_total", "Held messages cancelled before release")
        self.dead_letters = Counter("rmqfast_delay_dead_letters_total",
                                    "Held messages kept in the dead-letter range: the broker kept answering that "
                                    "their topic does not exist", ["topic"])
        self.dropped = Counter("rmqfast_delay_dropped_total",
                               "Held messages given up (the broker refused them for good, undecodable)", ["reason"])
        self.duplicates_avoided = Counter(
            "rmqfast_delay_recheck_found_total",
            "After a restart, messages that were possibly sent before the crash and that the broker already had "
            "(not sent again)")
        self.pending = Gauge("rmqfast_delay_pending_messages", "Held messages waiting for their due time",
                             multiprocess_mode="livesum")
        self.pending_bytes = Gauge("rmqfast_delay_pending_bytes", "Bytes (keys + values) of held messages",
                                   multiprocess_mode="livesum")
        self.lateness = Histogram("rmqfast_delay_lateness_seconds",
                                  "From a held message's due time to the broker's SUCCESS for its release",
                                  buckets=LATENESS_BUCKETS)


_metrics: DelayMetrics | None = None


def delay_metrics() -> DelayMetrics:
    """The process's delay metrics, registered once: a worker may open its delay service again
    on a reload (a second registration of the same series raises)."""
    global _metrics
    if _metrics is None:
        _metrics = DelayMetrics()
    return _metrics


def held_answer(request: RemotingCommand, msg_id: str, queue_id: int) -> bytes:
    ext = {"msgId": msg_id, "queueId": str(max(queue_id, 0)), "queueOffset": str(HELD_QUEUE_OFFSET), **_RESPONSE_EXT}
    return encode(make_response(request, C.SUCCESS, HELD_REMARK, ext_fields=ext))


def _too_large_for_a_broker(body: bytes, props_text: str) -> tuple[int, str, str] | None:
    """(answer code, reason, why) for a send no broker with default limits would store."""
    if len(body) > BROKER_MAX_BODY:
        return (MESSAGE_ILLEGAL, "too_large", f"the body is {len(body)} bytes, over the broker's default "
                f"maxMessageSize ({BROKER_MAX_BODY}); a held message must be one the broker can store")
    if len(props_text.encode()) > BROKER_MAX_PROPERTIES:
        return (MESSAGE_ILLEGAL, "too_large", f"the properties are {len(props_text.encode())} bytes, over the "
                f"{BROKER_MAX_PROPERTIES} a broker stores")
    return None


def refusal(request: RemotingCommand, code: int, remark: str) -> bytes:
    return encode(make_response(request, code, remark, ext_fields=dict(_RESPONSE_EXT)))


def _answer_later(session: Session) -> tuple[Any, Any] | None:
    """(the session's ``answer``, its writer to the client): what writes a local answer to the
    client at its next frame boundary; None for a session without the relay's ordered writer (the
    filter then answers in its verdict)."""
    answer = getattr(session, "answer", None)
    out = getattr(session, "to_client", None)
    if out is None or not callable(answer):
        return None
    return answer, out


class DelayFilter(Filter):
    name = "delay"

    def __init__(self, service: DelayService) -> None:
        self.service = service

    def request_slots(self) -> set[int]:
        # the scanner hands over the sends of the delay topics that ask for a delivery time
        # (scanner_topics); every other send stays on the fast path
        return set()

    def scanner_topics(self) -> list[bytes] | None:
        return self.service.topic_patterns

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        if frame.code not in C.SEND_CODES:
            return None
        cfg = self.service.cfg
        topic = quick_topic(frame)
        if topic is not None and not cfg.covers(topic):
            return None  # not a delay topic: no header decode
        try:
            cmd = frame.command()
        except ValueError:
            return None  # the broker answers malformed frames itself
        return self.service.hold(session, frame, cmd)


class DelayService:
    """One worker's delayed messages: store, filter, releaser, cancel requests, metrics."""

    def __init__(self, cfg: DelaySection, db: Any, index: int, *, state_dir: str = "", path: str = "",
                 publish: bool = True, connect_timeout: float = 3.0, request_timeout: float = 5.0,
                 retry_initial: float = 0.1, retry_max: float = 5.0) -> None:
        self.cfg = cfg
        self.levels = cfg.level_ms()
        #: [delay] topics as the scanners match them (changed in place: live sessions follow)
        self.topic_patterns: list[bytes] = [t.encode() for t in cfg.topics]
        self.index = index
        self.state_dir = state_dir
        self.m = delay_metrics() if publish else None
        self.store = DelayStore(db, max_pending_bytes=cfg.max_pending_bytes, path=path)
        self.filter = DelayFilter(self)
        self.releaser = Releaser(self, connect_timeout=connect_timeout, request_timeout=request_timeout,
                                 retry_initial=retry_initial, retry_max=retry_max)
        self.store.on_put = self.releaser.on_put
        self.closed = False
        self.accepted = 0
        self.refused: dict[str, int] = {}
        self.signed_passed = 0  # signed delayed sends left to the broker's own delay
        self.cancelled = 0
        self._cancel_loop: Any = None
        self._trim_loop: Any = None
        self._seen_cancels: set[str] = set()

    def reconfigure(self, cfg: DelaySection) -> None:
        """Topics, levels, bounds change at once; held messages stay."""
        self.cfg = cfg
        self.levels = cfg.level_ms()
        self.topic_patterns[:] = [t.encode() for t in cfg.topics]
        self.store.max_pending_bytes = cfg.max_pending_bytes

    # Holding ----------------------------------------------------------------------------------

    def _refuse(self, frame: Frame, cmd: RemotingCommand, code: int, reason: str, why: str) -> Verdict:
        self._count_refusal(reason, why)
        if frame.is_oneway:
            return divert(why)
        return reply(refusal(cmd, code, f"rmqfast: {why}"))

    def _count_refusal(self, reason: str, why: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        if self.m is not None:
            self.m.rejected.labels(reason).inc()
        log.warning("delayed send refused", extra=ctx(worker=self.index, reason=why))

    def _due(self, props_text: str, batch_body: bytes, now: int) -> tuple[int | None, dict[str, str], Any]:
        """(due time in ms or None, the send's properties, a batch's entries or None); a batch
        is due when its latest message is.  Raises DelayInvalid."""
        props = parse_properties(props_text) if props_text else {}
        due = due_ms(props, now, self.levels)
        if not batch_body:
            return due, props, None
        try:
            entries = decode_batch(batch_body)
        except ValueError:
            return due, props, None  # the broker answers an undecodable batch itself
        dues = [d for d in (due_ms(e.properties, now, self.levels) for e in entries) if d is not None]
        if dues:
            due = max([*dues, due] if due is not None else dues)
        return due, props, entries

    def _unholdable(self, sys_flag: int, due: int, now: int, session: Session) -> tuple[int, str, str] | None:
        """(answer code, reason, why) when a delayed send cannot be held; None: it can."""
        if sys_flag & TRANSACTION_PREPARED:
            return MESSAGE_ILLEGAL, "transaction", "a prepared transaction half cannot be delayed by the proxy"
        if due - now > self.cfg.max_delay_ms:
            return (MESSAGE_ILLEGAL, "too_far", f"delivery time {due} is {(due - now) / 1000:.0f} s away, more than "
                    f"delay.max_delay ({self.cfg.max_delay_ms / 1000:.0f} s)")
        if self.closed or not session.upstream_addr:
            return C.SYSTEM_BUSY, "unavailable", "the worker is stopping or has no broker connection; retry"
        return None

    def hold(self, session: Session, frame: Frame, cmd: RemotingCommand) -> Verdict | None:
        """Store a delayed send of a delay topic and answer it; None: not a delay request (relay it)."""
        ext = send_fields(frame.code, cmd.ext_fields)
        topic = ext.get("b")
        if not topic or not self.cfg.covers(topic):
            return None
        if "AccessKey" in (cmd.ext_fields or {}):
            # Signed (ACL): the release strips the delay properties, which the signature covers,
            # and the proxy cannot sign again; the broker applies its own delay to it instead.
            self.signed_passed += 1
            return None
        props_text = ext.get("i") or ""
        batch = is_batch(frame.code, cmd.ext_fields)
        now = now_ms()
        try:
            due, props, entries = self._due(props_text, cmd.body if batch else b"", now)
        except DelayInvalid as exc:
            return self._refuse(frame, cmd, MESSAGE_ILLEGAL, "invalid", f"invalid delivery time: {exc}")
        if due is None:
            return None
        refusal = self._unholdable(field_int(ext.get("f")), due, now, session)
        if refusal is None:
            refusal = _too_large_for_a_broker(cmd.body, props_text)
        if refusal is not None:
            return self._refuse(frame, cmd, *refusal)
        body = cmd.body
        if entries:
            body, msg_id, keys = _batch_without_delay(entries)
        else:
            msg_id = props.get(UNIQ_KEY) or ""
            keys = props.get(KEYS, "")
        stripped = strip_delay(props_text)
        if not msg_id:  # clients other than Java may not set one: give it one, so msgId means something
            msg_id = uuid.uuid4().hex.upper()
            stripped = stripped + ("" if not stripped or stripped.endswith("\x02") else "\x02") + \
                f"{UNIQ_KEY}\x01{msg_id}\x02"
        rec = CopyRecord.from_send(ext, body=body, properties=stripped, batch=batch, created_ms=now)
        queue_id = rec.queue_id
        held = Held(session.upstream_addr, msg_id.split(",")[0] if batch else msg_id, keys, rec)
        try:
            _dkey, pending = self.store.put(held, due)
        except StoreFull as exc:
            return self._refuse(frame, cmd, C.SYSTEM_BUSY, "full",
                                f"the delay store of worker {self.index} is full: {exc}; retry later")
        except WriteFailed as exc:
            return self._refuse(frame, cmd, C.SYSTEM_BUSY, "write_failed", str(exc))
        n = len(entries) if entries else 1
        later = _answer_later(session)
        if later is not None or frame.is_oneway:
            # The pump goes on with the connection's next frames while the group commit runs, so
            # the sends a connection pipelines share one fsync; the answer is written when it is
            # synced (at a frame boundary of the stream to the client, like every local answer).
            waiting = pending.waiting
            if waiting is None:  # one greenlet answers a whole group commit
                waiting = pending.waiting = []
                gevent.spawn(self._answer_when_stored, pending, waiting)
            # kept until the group is synced: the answer made now, the request without its body
            # (the frame and the body are in the stored value already: not held twice per send)
            oneway = frame.is_oneway
            cmd.body = b""
            waiting.append((later, oneway, cmd, b"" if oneway else held_answer(cmd, msg_id, queue_id), topic, n))
            return divert("delayed: answered once stored")
        try:
            self.store.wait(pending)
        except WriteFailed as exc:
            return self._refuse(frame, cmd, C.SYSTEM_BUSY, "write_failed", f"{exc}; retry")
        self._accepted(topic, n)
        return reply(held_answer(cmd, msg_id, queue_id))

    def _accepted(self, topic: str, n: int) -> None:
        self.accepted += n
        if self.m is not None:
            self.m.accepted.labels(topic).inc(n)

    def _answer_when_stored(self, pending: Any, waiting: list[tuple[Any, ...]]) -> None:
        """Answer the sends of one group commit once it is synced: the answers to one connection
        in one write (each a whole frame, at a frame boundary of the stream to the client)."""
        try:
            self.store.wait(pending)
            error: WriteFailed | None = None
        except WriteFailed as exc:
            error = exc
        writes: dict[int, tuple[Any, Any, list[bytes]]] = {}
        topics: dict[str, int] = {}
        for later, oneway, cmd, answer, topic, n in waiting:
            if error is not None:
                why = f"{error}; retry"
                self._count_refusal("write_failed", why)
                data = b"" if oneway else refusal(cmd, C.SYSTEM_BUSY, f"rmqfast: {why}")
            else:
                topics[topic] = topics.get(topic, 0) + n
                data = answer
            if data and later is not None:
                w = writes.get(id(later[1]))
                if w is None:
                    w = writes[id(later[1])] = (later[0], later[1], [])
                w[2].append(data)
        for topic, n in topics.items():
            self._accepted(topic, n)
        for answer, out, datas in writes.values():
            try:
                answer(out, b"".join(datas), False)
            except OSError:  # the connection closed meanwhile: the messages are stored all the same
                pass

    # Cancel -----------------------------------------------------------------------------------

    def cancel(self, *, msg_id: str | None = None, key: str | None = None) -> dict[str, Any]:
        """Cancel the pending messages with this msgId (or key) held by this worker."""
        done: list[str] = []
        releasing: list[str] = []
        rel = self.releaser
        for dkey in self.store.find(msg_id=msg_id, key=key):
            if dkey in rel.dispatched and any(rel.parking.values()):
                self.store.flush()  # it may be moving to its broker's wait range: look once it has moved
            if dkey in rel.dispatched:
                found = None
            else:
                found = self.store.locate(dkey, [p for p, some in rel.parked.items() if some])
            if found is None or found[0] in rel.dispatched:
                releasing.append(dkey.hex())
                continue
            dkey, value = found
            try:
                mid = Held.decode(value).msg_id
            except Exception:
                mid = ""
            self.releaser.dispatched.add(dkey)  # never released now
            b = self.store.delete(dkey, value)
            b.done.rawlink(lambda _e, k=dkey: self.releaser.dispatched.discard(k))
            done.append(mid)
        self.store.flush()
        self.cancelled += len(done)
        if self.m is not None and done:
            self.m.cancelled.inc(len(done))
        if done:
            log.info("delayed messages cancelled", extra=ctx(worker=self.index, msg_ids=done))
        return {"worker": self.index, "cancelled": done, "already_releasing": len(releasing)}

    def _cancel_requests(self) -> None:
        from rmqfast.delay.cancel import answer_requests

        while not self.closed:
            try:
                answer_requests(self.state_dir, self.index, self._seen_cancels, self.cancel)
            except Exception:
                log.exception("delay cancel requests failed", extra=ctx(worker=self.index))
            gevent.sleep(0.25)

    # Lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self.releaser.start()
        if self.state_dir and self._cancel_loop is None:
            self._cancel_loop = gevent.spawn(self._cancel_requests)
        if self._trim_loop is None:
            self._trim_loop = gevent.spawn(self._trim)

    def _trim(self) -> None:
        """Every TRIM_EVERY seconds with sends accepted or messages released since the last time:
        the free pages in the middle of glibc's heaps go back to the system (in the thread pool:
        the event loop goes on).  Reading and deleting held messages frees a little everywhere."""
        from rmqfast.spill.store import trim_malloc

        last = (-1, -1)
        pool = gevent.get_hub().threadpool
        while not self.closed:
            gevent.sleep(TRIM_EVERY)
            now = (self.accepted, self.releaser.released)
            if now != last:
                last = now
                pool.apply(trim_malloc)

    def publish(self) -> None:
        if self.m is None:
            return
        self.m.pending.set(self.store.messages)
        self.m.pending_bytes.set(self.store.bytes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._cancel_loop is not None:
            self._cancel_loop.kill(block=False)
        if self._trim_loop is not None:
            self._trim_loop.kill(block=False)
        self.releaser.close()
        self.store.close()


class Releaser:
    """Sends held messages when they are due, in due-time order per broker queue."""

    def __init__(self, service: DelayService, *, connect_timeout: float, request_timeout: float,
                 retry_initial: float, retry_max: float) -> None:
        self.svc = service
        self.store = service.store
        self.pool = ConnectionPool(connect_timeout)  # one request at a time: retries, rechecks
        self.channels: dict[str, ReleaseChannel] = {}  # pipelined releases, by broker
        self.request_timeout = request_timeout
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.cursor = DUE_PREFIX
        self.dispatched: set[bytes] = set()  # read for release (or cancelled), delete not yet written
        self.lanes: dict[tuple[str, str, int], deque[Item]] = {}
        self.queued = 0
        self.wake = Event()
        self.space = Event()
        self.closed = False
        self.released = 0
        self.dropped = 0
        self.dead_letters = 0
        self.recheck_found = 0
        # the latest lateness samples (tests): a few thousand, not more (an int object each: 200,000
        # cost a worker up to 7 MB)
        self.lateness_ms: deque[int] = deque(maxlen=4096)
        self._greenlet: Any = None
        self._lane_greenlets: dict[tuple[str, str, int], Any] = {}
        # Messages due before this run started that may have been sent just before a crash: the
        # broker is asked whether it has them before they are sent again (exactly once).
        raw = self.store.db.get(b"m" + b"delay.releasing")
        self.recheck_upto = raw if raw else b""
        # A broker that does not take its releases (down, or slower than its share of the read-ahead)
        # gets its due messages moved to its wait range, read from there once it takes releases again,
        # so that the other brokers' releases are not held up behind it (see _step).
        self.held_for: dict[str, int] = {}  # messages queued in lanes, by broker
        self.parked: dict[bytes, bool] = {p: True for p in self.store.parked_prefixes()}  # wait range: may hold some
        self.parking: dict[bytes, int] = {}  # moves to a wait range not written yet, by range
        self.wcursor: dict[bytes, bytes] = {}  # wait range -> next key to read
        self.wmarks = self.store.parked_marks()  # wait range -> last key taken for release (persisted)
        self.recheck_w = dict(self.wmarks)  # what may have been sent before this run started
        self.parked_moves = 0
        self.read_upto = DUE_PREFIX  # the due range is read up to this key (wait ranges are read up to it)

    def on_put(self, first_key: bytes) -> None:
        if first_key < self.cursor:
            self.cursor = first_key  # an earlier due time arrived behind the cursor
        if first_key < self.read_upto:
            self.read_upto = first_key
        self.wake.set()

    def start(self) -> None:
        if self._greenlet is None:
            self._greenlet = gevent.spawn(self._run)

    @property
    def limit(self) -> int:
        return self.svc.cfg.release_in_flight

    def _run(self) -> None:
        while not self.closed:
            try:
                self._step()
            except Exception:  # the releaser must not die: log, wait, go on
                log.exception("delayed message release failed; retrying", extra=ctx(worker=self.svc.index))
                gevent.sleep(1.0)

    def _maybe_sent(self, k: bytes) -> bool:
        """Whether this message may have reached the broker before a crash (then it is asked first)."""
        if k[:1] == DUE_PREFIX:
            return bool(self.recheck_upto) and k <= self.recheck_upto
        mark = self.recheck_w.get(k[:-16])
        return mark is not None and k <= mark

    @property
    def per_broker(self) -> int:
        """Messages one broker may have queued in lanes; past it its due messages wait in its range."""
        return self.limit * 2

    def _blocked(self, per: int) -> int:
        """Queued messages of brokers at their share: they do not hold up the reading for the others."""
        return sum(n for n in self.held_for.values() if n >= per)

    def _queue(self, k: bytes, v: bytes, held: Held) -> None:
        lane = (held.addr, held.record.topic, held.record.queue_id)
        q = self.lanes.get(lane)
        if q is None:
            q = self.lanes[lane] = deque()
        q.append((k, v, held, split_due_key(k)[0]))
        self.queued += 1
        self.held_for[held.addr] = self.held_for.get(held.addr, 0) + 1
        if lane not in self._lane_greenlets:
            self._lane_greenlets[lane] = gevent.spawn(self._lane, lane)

    def _park(self, k: bytes, v: bytes, held: Held) -> None:
        """Move a due message to its broker's wait range (durably, in the next write of the store)."""
        wkey = parked_key(held.addr, k)
        prefix = wkey[:-16]
        self.parked[prefix] = True
        if wkey < self.wcursor.get(prefix, wkey):
            self.wcursor[prefix] = wkey  # an earlier due time arrived behind that range's reading
        if self._maybe_sent(k):
            # it may have reached the broker before a crash: whatever waits up to it is asked first
            if wkey > self.wmarks.get(prefix, b""):
                self.store.mark_parked(wkey)
                self.wmarks[prefix] = wkey
            if wkey > self.recheck_w.get(prefix, b""):
                self.recheck_w[prefix] = wkey
        self.parking[prefix] = self.parking.get(prefix, 0) + 1
        self.parked_moves += 1
        b = self.store.park(k, wkey, v)

        def written(_e: Any, k: bytes = k, prefix: bytes = prefix) -> None:
            self.dispatched.discard(k)
            self.parking[prefix] -= 1
            self.wake.set()  # the range may be read now

        b.done.rawlink(written)

    def _unpark(self, per: int) -> bool:
        """Queue what waits in the ranges of brokers with room again (half their share free)."""
        took = False
        for prefix, some in list(self.parked.items()):
            if not some:
                continue
            (n,) = struct.unpack_from(">H", prefix, 1)
            addr = prefix[3:3 + n].decode("utf-8", "replace")
            room = per - self.held_for.get(addr, 0)
            if room < per // 2 or self.parking.get(prefix):
                continue  # no room yet; or moves to the range not written yet (they may come first)
            # only what the due range's reading has passed: an earlier message of this broker still
            # in the due range (after a restart) is moved here first, so each queue keeps due order
            before = prefix + self.read_upto[1:]
            items = self.store.read_parked(self.wcursor.get(prefix, prefix), prefix, room, before)
            if len(items) < room:
                nxt = items[-1][0] + b"\x00" if items else self.wcursor.get(prefix, prefix)
                if not self.store.read_parked(nxt, prefix, 1):
                    self.parked[prefix] = False  # drained: its next due messages go to its lanes directly
            if not items:
                continue
            last = items[-1][0]
            if last > self.wmarks.get(prefix, b""):
                self.store.mark_parked(last)  # before sending, as mark_releasing
                self.wmarks[prefix] = last
            self.wcursor[prefix] = last + b"\x00"
            for k, v in items:
                if k in self.dispatched:
                    continue
                self.dispatched.add(k)
                try:
                    held = Held.decode(v)
                except Exception as exc:
                    log.error("undecodable held message; giving it up", extra=ctx(error=str(exc)))
                    self._done(k, v, None, "undecodable")
                    continue
                self._queue(k, v, held)
                took = True
        return took

    def _step(self) -> None:
        cap = self.limit * 4
        per = self.per_broker
        took = self._unpark(per)
        if self.queued - self._blocked(per) >= cap:
            self.space.clear()
            self.space.wait(timeout=1.0)
            return
        now = now_ms()
        # read ahead: what falls due over the next READ_AHEAD_MS is read, decoded and queued in its
        # lane now, so that at its due time only the write to the broker is left
        limit = cap - self.queued + self._blocked(per)
        items = self.store.read_due(self.cursor, now + READ_AHEAD_MS, limit)
        if len(items) < limit:  # everything due up to now + READ_AHEAD_MS has been read
            upto = due_key(now + READ_AHEAD_MS + 1, 0)
            self.read_upto = max(upto, items[-1][0] + b"\x00") if items else max(upto, self.cursor)
        if not items:
            if took or self._unpark(per):
                return
            nxt = self.store.next_due(self.cursor)
            self.wake.clear()
            if nxt is None:
                self.wake.wait(timeout=1.0)
            elif nxt - READ_AHEAD_MS // 2 > now:
                # one read then takes what falls due over READ_AHEAD_MS / 2 .. READ_AHEAD_MS
                self.wake.wait(timeout=min(1.0, (nxt - READ_AHEAD_MS // 2 - now) / 1000))
            return
        last = items[-1][0]
        # written before sending (unsynced: a process crash keeps it): after a crash, what is at
        # or before it may have reached the broker already
        self.store.mark_releasing(last)
        held_for = self.held_for
        parked = self.parked if any(self.parked.values()) else None
        for k, v in items:
            if k in self.dispatched:
                continue
            self.dispatched.add(k)
            try:
                held = Held.decode(v)
            except Exception as exc:
                log.error("undecodable held message; giving it up", extra=ctx(error=str(exc)))
                self._done(k, v, None, "undecodable")
                continue
            if held_for.get(held.addr, 0) >= per or parked is not None and parked.get(parked_prefix(held.addr)):
                self._park(k, v, held)  # its broker is at its share, or older ones of it wait already
            else:
                self._queue(k, v, held)
        self.cursor = last + b"\x00"
        if len(items) >= limit:
            self.read_upto = self.cursor

    def _lane(self, lane: tuple[str, str, int]) -> None:
        q = self.lanes[lane]
        try:
            if q and not self.closed:
                self._pipeline(q)
        finally:
            if not q:
                self.lanes.pop(lane, None)
            self._lane_greenlets.pop(lane, None)
            if q and not self.closed:  # died with work left: a new lane greenlet takes it
                self._lane_greenlets[lane] = gevent.spawn(self._lane, lane)

    def channel(self, addr: str) -> ReleaseChannel:
        ch = self.channels.get(addr)
        if ch is None or ch.closed:
            ch = self.channels[addr] = ReleaseChannel(addr, connect_timeout=self.pool.connect_timeout,
                                                      wrap=self.pool.wrap)
        return ch

    def _fill(self, q: deque[Item], chunks: deque[tuple[Sent | None, int]], flying: int, window: int,
              now: int) -> int:
        """Write the lane's due messages after the ``flying`` ones already written, up to ``window``
        in flight, in groups of at most half the window (each group one write and one wake-up when
        its answers are in); a message that may have been sent before a crash is not pipelined (it
        goes alone, after a recheck).  Returns how many were written."""
        end = min(window, len(q))
        group = max(1, window // 2)
        wrote = 0
        while flying + wrote < end:
            recs = []
            for j in range(flying + wrote, min(end, flying + wrote + group)):
                k, _v, held, due = q[j]
                if due > now or self._maybe_sent(k):
                    break
                recs.append(held.record)
            if not recs:
                break
            try:
                sent: Sent | None = self.channel(q[0][2].addr).send(recs)
                sent.deadline = time.monotonic() + self.request_timeout  # type: ignore[union-attr]
            except RemoteError:
                sent = None  # each goes through _send (retries, back-off)
            chunks.append((sent, len(recs)))
            wrote += len(recs)
            if len(recs) < group:
                break
        return wrote

    def _next_wait(self, q: deque[Item], sent: Sent, flying: int, window: int, now: int) -> float:
        """How long to wait for a group's answers: until its deadline, or until the lane's next
        message falls due when the window has room for it."""
        timeout = sent.deadline - time.monotonic()
        if flying < min(window, len(q)):
            k, _v, _held, due = q[flying]
            if due > now and not self._maybe_sent(k):
                timeout = min(timeout, (due - now) / 1000)
        return timeout

    def _pipeline(self, q: deque[Item]) -> None:
        """Release a lane: each message at its due time; up to ``queue_window`` sends in flight on
        its connection, written in groups as they fall due (no round trip per message); answers
        are taken in order.  A send that did not store at once is sent again by :meth:`_send`
        (retries, back-off) before the next is done."""
        chunks: deque[tuple[Sent | None, int]] = deque()  # written groups, in q's order
        flying = 0  # q[0 .. flying - 1] are written
        while q and not self.closed:
            window = max(1, self.svc.cfg.queue_window)
            now = now_ms()
            if flying < min(window, len(q)):
                flying += self._fill(q, chunks, flying, window, now)
            if not chunks:
                due = q[0][3]
                if due > now:
                    gevent.sleep((due - now) / 1000)  # read ahead: not due yet
                    continue
                # the head could not be pipelined: it may have reached the broker before a crash
                if not self._settle(q, None, 1):
                    return
                continue
            sent, n = chunks[0]
            if sent is not None and not sent.done.is_set():
                timeout = self._next_wait(q, sent, flying, window, now)
                if timeout > 0:
                    sent.done.wait(timeout)
                if not sent.done.is_set() and time.monotonic() < sent.deadline:
                    continue  # the next message fell due: written before these answers came
            chunks.popleft()
            flying -= n
            if sent is not None and not sent.done.is_set():
                ch = self.channels.get(q[0][2].addr)
                if ch is not None:
                    ch.forget(sent)
            if not self._settle(q, sent, n):
                return

    def _settle(self, q: deque[Item], sent: Sent | None, n: int) -> bool:
        """Take the outcome of the lane's first ``n`` messages (written as ``sent``, or not written):
        stored: deleted together; else sent again by :meth:`_send`.  False: stopping."""
        released: list[tuple[bytes, bytes, Held, int]] = []
        try:
            for i in range(n):
                k, v, held, due = q[0]
                code = sent.codes[i] if sent is not None else None
                outcome: bool | str | None = True if code is not None and code in STORED_CODES else \
                    self._send(k, held)
                if outcome is None:
                    return False  # stopping: it stays stored for the next run
                q.popleft()
                self.queued -= 1
                self.held_for[held.addr] -= 1
                if outcome is True:
                    released.append((k, v, held, due))
                elif outcome == DEAD_LETTER:
                    self._dead_letter(k, v, held)
                else:
                    self._done(k, v, held, "refused")
        finally:
            self._released(released)
            self.space.set()
            if q and self.parked.get(parked_prefix(q[0][2].addr)):
                self.wake.set()  # its wait range may be read again
            elif not q and any(self.parked.values()):
                self.wake.set()
        return True

    def _released(self, done: list[tuple[bytes, bytes, Held, int]]) -> None:
        """Messages the broker stored: deleted (one queued removal), counted, their lateness kept."""
        if not done:
            return
        keys = [d[0] for d in done]
        b = self.store.delete_many([(k, len(v), held.index_keys(k)) for k, v, held, _due in done])
        b.done.rawlink(lambda _e: self.dispatched.difference_update(keys))
        now = now_ms()
        self.released += len(done)
        late = [now - due for _k, _v, _held, due in done]
        self.lateness_ms.extend(late)
        m = self.svc.m
        if m is None:
            return
        topics: dict[str, int] = {}
        for _k, _v, held, _due in done:
            topics[held.record.topic] = topics.get(held.record.topic, 0) + 1
        for topic, n in topics.items():
            m.released.labels(topic).inc(n)
        for ms in late:
            m.lateness.observe(max(0, ms) / 1000)

    def _dead_letter(self, k: bytes, v: bytes, held: Held) -> None:
        b = self.store.dead_letter(k, v, held)
        b.done.rawlink(lambda _e: self.dispatched.discard(k))
        self.dead_letters += 1
        if self.svc.m is not None:
            self.svc.m.dead_letters.labels(held.record.topic).inc()
        log.error("delayed message kept as a dead letter: the broker has no such topic",
                  extra=ctx(worker=self.svc.index, msg_id=held.msg_id, topic=held.record.topic, broker=held.addr,
                            due_key=k.hex()))

    def _done(self, k: bytes, v: bytes, held: Held | None, dropped: str | None) -> None:
        b = self.store.delete(k, v, held)
        b.done.rawlink(lambda _e: self.dispatched.discard(k))
        m = self.svc.m
        if dropped is not None:
            self.dropped += 1
            if m is not None:
                m.dropped.labels(dropped).inc()
            return
        assert held is not None
        late = now_ms() - split_due_key(k)[0]
        self.lateness_ms.append(late)
        self.released += 1
        if m is not None:
            m.released.labels(held.record.topic).inc()
            m.lateness.observe(max(0, late) / 1000)

    def _recheck(self, k: bytes, held: Held) -> bool:
        """True when the broker already has this message (sent just before a crash)."""
        from rmqfast.delay.recheck import broker_has

        try:
            return broker_has(self.pool, held, timeout=self.request_timeout)
        except Exception as exc:  # cannot tell: send it (at least once)
            log.warning("cannot ask the broker whether a held message was released before a restart; sending it",
                        extra=ctx(msg_id=held.msg_id, error=str(exc)))
            return False

    def _send(self, k: bytes, held: Held) -> bool | str | None:
        """Send until the broker stores it (True) or refuses it for good (False); None: stopping."""
        rec = held.record
        if self._maybe_sent(k):
            if self._recheck(k, held):
                self.recheck_found += 1
                if self.svc.m is not None:
                    self.svc.m.duplicates_avoided.inc()
                return True
        why: list[str] = []
        ok = send_until_stored(self.pool, held.addr, rec, what="delayed", logger=log, stopping=lambda: self.closed,
                               retry_initial=self.retry_initial, retry_max=self.retry_max,
                               timeout=self.request_timeout, worker=self.svc.index, msg_id=held.msg_id,
                               drop=why.append, missing_topic_attempts=MISSING_TOPIC_ATTEMPTS)
        return DEAD_LETTER if why == ["topic_not_exist"] else ok

    def close(self) -> None:
        self.closed = True
        self.wake.set()
        self.space.set()
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
        for g in list(self._lane_greenlets.values()):
            g.kill(block=True, timeout=2)
        self.pool.close()
        for ch in self.channels.values():
            ch.close()


def _batch_without_delay(entries: list[Any]) -> tuple[bytes, str, str]:
    """A held batch: (its body without the delay properties, msgId, keys)."""
    for e in entries:
        if has_delay_property(e.properties):
            for k in ("DELAY", "TIMER_DELAY_SEC", "TIMER_DELAY_MS", "TIMER_DELIVER_MS", "__STARTDELIVERTIME"):
                e.properties.pop(k, None)
    ids = [e.properties.get(UNIQ_KEY) for e in entries]
    msg_id = ",".join(i for i in ids if i) or uuid.uuid4().hex.upper()
    keys = " ".join(e.properties.get(KEYS, "") for e in entries).strip()
    return encode_batch(entries), msg_id, keys

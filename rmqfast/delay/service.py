"""Proxy-held delayed messages, worker side: the filter that holds them, the releaser, cancel.

* :class:`DelayFilter` sees the sends (10, 310, 320) of the topics ``[delay] topics`` names.  A
  send whose properties ask for a delivery time (:mod:`rmqfast.delay.semantics`) is stored,
  synced (group commit: concurrent producers share an fsync), in the worker's RocksDB spill,
  keyed by due time, with the delivery-time properties removed; then the producer gets SUCCESS
  made by the proxy: ``msgId`` = the message's ``UNIQ_KEY`` (what the consumer sees as msgId),
  ``queueId`` = the queue the producer chose (the release goes to that queue of that broker),
  ``queueOffset`` = -1 (the broker has not stored it yet: there is no offset before the release).
* :class:`rmqfast.delay.releaser.Releaser` seeks the due-time keys from its cursor and sends what is due, in due-time
  order, to the broker the producer's connection went to (one lane per broker, topic and queue:
  a lane sends one message at a time, so the order of due times holds in every queue; lanes run
  side by side).  A message is deleted once the broker answered SUCCESS (at least once: a crash
  between the two sends it again; see :meth:`rmqfast.delay.lanes.ReleaseLanes._recheck`, which asks the broker first).
* Cancel: :func:`rmqfast.delay.cancel.request_cancel` drops a request file that every worker
  applies to its own store (msgId or key).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import gevent

from rmqfast.codec import codes as C
from rmqfast.codec.batch import decode_batch, encode_batch
from rmqfast.codec.command import RemotingCommand, encode, make_response
from rmqfast.codec.properties import KEYS, UNIQ_KEY, parse_properties
from rmqfast.codec.sendheader import TRANSACTION_PREPARED, field_int, is_batch, send_fields
from rmqfast.delay.releaser import Releaser, now_ms
from rmqfast.delay.semantics import DelayInvalid, due_ms, has_delay_property, strip_delay
from rmqfast.delay.settings import DelaySection
from rmqfast.delay.store import DelayStore, Held, StoreFull, WriteFailed
from rmqfast.log import ctx
from rmqfast.proxy.policy import Filter, Frame, Session, Verdict, divert, reply
from rmqfast.proxy.quicktopic import quick_topic
from rmqfast.spill.record import CopyRecord

log = logging.getLogger("rmqfast.delay")

MESSAGE_ILLEGAL = 13
HELD_QUEUE_OFFSET = -1
#: What a broker refuses for good (MESSAGE_ILLEGAL) whatever the retry: a body over its default
#: ``maxMessageSize`` (4 MiB) or properties longer than a short (the commit-log record's field).
#: Held messages are acknowledged before the broker sees them, so these are refused up front.
BROKER_MAX_BODY = 4 * 1024 * 1024
BROKER_MAX_PROPERTIES = 32767
HELD_REMARK = "rmqfast: accepted by rmqfast proxy (delayed); delivered at its due time"
_RESPONSE_EXT = {"MSG_REGION": "DefaultRegion", "TRACE_ON": "false"}
#: How often (seconds) a busy worker gives free heap pages back to the system (see DelayService._trim)
TRIM_EVERY = 2.0
LATENESS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


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

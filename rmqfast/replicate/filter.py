"""The copy path: a policy filter that tees copies of sends to remote clouds.

It asks the scanner for SEND_MESSAGE (10), SEND_MESSAGE_V2 (310) and SEND_BATCH_MESSAGE
(320) requests, lets every one of them through unchanged (it never rewrites or answers a
send, except SYSTEM_BUSY when the spill is full with policy ``reject``), and takes a copy per
remote cloud that the topic's rule selects:

* ``[[replicate.topic]]`` rule, else ``replicate.default``: ``never``, ``always``, or
  ``online`` (only while the remote has consumers online for the topic: the detector's cache);
* an optional tag filter (``tags``: the message's ``TAGS`` must be one of them; a batch is
  judged by its first message's tag);
* never a copy of a copy: a message carrying ``RMQFAST_ORIGIN`` came from another cloud;
* never the system topics (``%RETRY%``, ``%DLQ%``, ``RMQ_SYS_``, ``TBW102``... unless a rule
  names them) nor prepared transaction halves (their commit comes as END_TRANSACTION, which is
  not copied: transactional messages are not delivered across clouds yet).

The copy is taken *before* the request is forwarded (``on_request`` runs in the client-to-broker
pump).  In durable mode its synced group commit is queued there and the broker's *answer* is
held in ``on_response`` (the broker-to-client pump) until the commit is done, so the producer
never sees SUCCESS for a send whose copy is not on disk, while the sends that one connection
pipelines (the Java client multiplexes every thread over one connection) share an fsync.
A failed commit turns the answer into SYSTEM_ERROR (the producer retries; the message may then
be twice in the local cluster, never missing in the remote one).  The local broker's answer
decides the copy's fate: SUCCESS releases it to the deliverer; any other code cancels it.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from rmqfast.clouds.detector import OnlineDetector
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand
from rmqfast.codec.properties import TAGS, parse_properties
from rmqfast.codec.sendheader import TRANSACTION_PREPARED, field_int, is_batch, send_fields
from rmqfast.config import Config, TopicRule
from rmqfast.filters.api import (
    Filter,
    Frame,
    Session,
    Verdict,
    divert,
    error_response,
    reply,
    rewrite,
    slots_of,
)
from rmqfast.log import ctx
from rmqfast.proxy.quicktopic import quick_topic
from rmqfast.replicate.replicator import Replicator
from rmqfast.spill.commit import CommitFailed, SpillFull
from rmqfast.spill.record import ORIGIN_PROPERTY, CopyRecord

log = logging.getLogger("rmqfast.replicate")

_SYSTEM_PREFIXES = ("%RETRY%", "%DLQ%", "RMQ_SYS_", "rmq_sys_", "SCHEDULE_TOPIC", "TBW102", "RMQ_")
_ORIGIN_MARK = ORIGIN_PROPERTY + "\x01"

_PENDING = "replicate_pending"


class ReplicateFilter(Filter):
    name = "replicate"
    # Only the answers to sends it took a copy of (marked in on_request; the scanner finds them
    # by opaque in C): every other response on the broker role is forwarded without Python.
    wants_marked_responses = True

    def __init__(self, cfg: Config, replicator: Replicator, detector: OnlineDetector | None) -> None:
        self.replicator = replicator
        self.detector = detector
        self.rules: dict[str, TopicRule] = {t.name: t for t in cfg.replicate.topics}
        self.default = cfg.replicate.default
        self.remotes = [r.name for r in cfg.clouds.remotes]
        self._slots = slots_of(C.SEND_CODES)
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()

    def request_slots(self) -> set[int]:
        return self._slots

    # Rules ------------------------------------------------------------------------------------

    def targets(self, topic: str, tag: str | None) -> list[str]:
        """The remotes a message of ``topic`` with ``tag`` is copied to, now."""
        rule = self.rules.get(topic)
        if rule is None:
            if self.default == "never" or topic.startswith(_SYSTEM_PREFIXES):
                return []
            mode, tags, remotes = self.default, (), self.remotes
        else:
            mode, tags, remotes = rule.replicate, rule.tags, rule.remotes or self.remotes
        if mode == "never" or (tags and tag not in tags):
            return []
        if mode == "always" or self.detector is None:
            return list(remotes)
        return [r for r in remotes if self.detector.online(r, topic)]

    # Requests ---------------------------------------------------------------------------------

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        if frame.code not in C.SEND_CODES:
            return None
        if self.default == "never":
            topic = quick_topic(frame)
            if topic is not None and topic not in self.rules:
                return None  # no rule can copy it: skip the header decode
        try:
            cmd = frame.command()
        except ValueError:
            return None  # the broker answers malformed frames itself
        try:
            seqs = self.take_send(cmd, frame.is_oneway)
        except SpillFull as exc:
            log.warning("send refused: cross-cloud spill full", extra=ctx(client=session.client_addr))
            if frame.is_oneway:
                return divert(str(exc))
            return reply(error_response(frame, C.SYSTEM_BUSY, str(exc)))
        if seqs and not frame.is_oneway:
            pending: dict[int, list[int]] = session.state.setdefault(_PENDING, {})
            pending[frame.opaque] = seqs
            frame.want_response = True
            self._sessions.add(session)
        return None

    def take_send(self, cmd: RemotingCommand, oneway: bool) -> list[int]:
        """Copy the send ``cmd`` to the remotes its topic and tag select (the rules above); the copies'
        sequence numbers ([] : none).  A oneway send's copy is released at once (durable: after its
        fsync); any other's waits for :meth:`settle` with the broker's answer.  SpillFull: refuse it."""
        ext = send_fields(cmd.code, cmd.ext_fields)
        topic = ext.get("b")
        if not topic:
            return []
        props_text = ext.get("i") or ""
        if _ORIGIN_MARK in props_text:
            self.replicator.count_not_copied("copy_of_copy")
            return []
        if field_int(ext.get("f")) & TRANSACTION_PREPARED:
            return []
        tag = parse_properties(props_text).get(TAGS) if props_text else None
        batch = is_batch(cmd.code, cmd.ext_fields)
        if batch and tag is None and cmd.body:
            tag = _first_batch_tag(cmd.body)
            if _ORIGIN_MARK.encode() in cmd.body:
                self.replicator.count_not_copied("copy_of_copy")
                return []
        remotes = self.targets(topic, tag)
        if not remotes:
            return []
        rec = CopyRecord.from_send(ext, body=cmd.body, properties=props_text, batch=batch,
                                   created_ms=int(time.time() * 1000))
        # Durable: a oneway send has no answer to hold, so it waits for its fsync here; any
        # other send is forwarded at once and its answer waits (on_response), which lets the
        # sends a connection pipelines share one fsync.
        return self.replicator.take(remotes, topic, rec.encode(), awaiting=not oneway, defer=not oneway)

    def settle(self, seqs: list[int], code: int) -> None:
        """The broker answered ``code`` to a send whose copies are ``seqs``: released on SUCCESS
        (durable: after their fsync; CommitFailed when it failed), dropped otherwise."""
        if code != C.SUCCESS:
            self.replicator.cancel(seqs)
            return
        self.replicator.synced(seqs)
        self.replicator.confirm(seqs)

    def on_response(self, session: Session, frame: Frame) -> Verdict | None:
        pending: dict[int, list[int]] | None = session.state.get(_PENDING)
        if not pending:
            return None
        seqs = pending.pop(frame.opaque, None)
        if seqs is None:
            return None
        if frame.code != C.SUCCESS:
            self.replicator.cancel(seqs)
            return None
        try:
            self.replicator.synced(seqs)  # durable: the copy is on disk before the producer hears SUCCESS
        except CommitFailed as exc:
            log.error("copy not synced; the producer is told its send failed",
                      extra=ctx(client=session.client_addr, error=str(exc)))
            return rewrite(error_response(frame, C.SYSTEM_ERROR,
                                          f"rmqfast: the cross-cloud copy could not be stored ({exc}); retry"))
        self.replicator.confirm(seqs)
        return None

    def on_close(self, session: Session) -> None:
        """The connection closed before some answers came: release those copies for delivery
        (the producer may have been answered SUCCESS by the broker; a duplicate in the remote
        cloud is acceptable, a loss is not)."""
        pending = session.state.pop(_PENDING, {})
        for seqs in pending.values():
            self.replicator.confirm(seqs)
        self._sessions.discard(session)

    def sweep(self) -> int:
        """Release the copies of requests whose connection closed before the answer came
        (a safety net behind on_close)."""
        n = 0
        for s in list(self._sessions):
            if getattr(s, "closed", False):
                pending = s.state.pop(_PENDING, {})
                for seqs in pending.values():
                    self.replicator.confirm(seqs)
                    n += len(seqs)
                self._sessions.discard(s)
        return n


def _first_batch_tag(body: bytes) -> str | None:
    from rmqfast.codec.batch import decode_batch

    try:
        entries = decode_batch(body)
    except ValueError:
        return None
    return entries[0].properties.get(TAGS) if entries else None

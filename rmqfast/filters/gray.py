"""The gray filter of the broker chain: carries the decisions of :mod:`rmqfast.gray.rules` out on frames.

It reads, per broker connection:

* ``HEART_BEAT`` (34): the connection's client id (``clientID`` of the body), which says which side
  the client is on.
* ``GET_CONSUMER_LIST_BY_GROUP`` (38): the answer is rewritten to the requester's side (its
  rebalance allocates over its own side's members only); a gray member in the broker's list means
  the gray side is alive.
* ``PULL_MESSAGE`` (11): a pull of a queue the other side owns is answered ``SYSTEM_BUSY`` (the
  client retries 3 s later); the first allowed pull of a queue that was parked on that connection
  becomes a ``QUERY_CONSUMER_OFFSET`` (14) of the group's committed offset, answered to the client
  as ``PULL_NOT_FOUND`` with that offset as ``nextBeginOffset`` (the client's own position is stale).
* ``UPDATE_CONSUMER_OFFSET`` (15): commits of a client for a queue it does not own (or owned stale)
  are dropped.
* sends (10, 310, 320) of split topics: the queue id is rewritten (gray sends to gray queues,
  normal sends to normal ones); the frame is re-encoded by the project's header codec.  Only the
  sends of split topics and of the gray groups' retry topics leave the compiled fast path (the
  scanner's ``policy_topics``, from :meth:`GrayFilter.send_topics`); the sends of other topics need
  nothing here.
* retries of a gray consumer (``CONSUMER_SEND_MSG_BACK`` (36) of a message of a split topic, and the
  Java client's fallback, a send to ``%RETRY%group``): while the gray side owns its queues (a running
  canary, a promote's drain) they fail, so the client consumes the message again itself (Java and Go
  retry a message whose send-back failed in the same process, 5 s later) instead of the broker putting
  it on the retry topic, which the normal side pulls.  A Java client's send-back is answered
  ``NO_PERMISSION`` (the client then tries the fallback send, refused too); a Go client's is not
  answered (rocketmq-client-go counts any answer as sent back, the message would be lost; it fails
  after its 3 s timeout); other clients' pass (their retries go to the normal side).

Only the groups and topics of ``[gray]`` are touched; everything else passes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, encode, make_response
from rmqfast.codec.properties import parse_properties
from rmqfast.codec.sendheader import V1_CODES, field_int, send_fields
from rmqfast.filters.api import Filter, Frame, Session, Verdict, divert, reply, rewrite, slots_of
from rmqfast.gray.config import GrayGroup, GraySection
from rmqfast.gray.handover import Handover, commit_of_pull, held_answer, run_due
from rmqfast.gray.rules import (
    GRAY,
    NORMAL,
    Marker,
    Phase,
    consumer_ids_for,
    is_gray_queue,
    may_commit,
    may_pull,
    phase,
    send_queue,
)
from rmqfast.gray.state import Commands
from rmqfast.log import ctx

log = logging.getLogger("rmqfast.gray")

QUERY_NOT_FOUND = 22
FLAG_SUBSCRIPTION = 1 << 2  # PullSysFlag (commit offset 1, suspend 2, subscription 4, class filter 8)
# reply messages carry a send header, and the broker stores them in its topic and queue
_MAX_TRACKED = 10000
RETRY_PREFIX = "%RETRY%"


class GrayMetrics:
    """Prometheus objects of gray releases (created once per worker)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.sends = Counter("rmqfast_gray_sends_total", "Sends of split topics, by group and side", ["group", "side"])
        self.moved = Counter("rmqfast_gray_sends_moved_total",
                             "Sends whose queue id was rewritten (to the gray or the normal share)", ["group", "side"])
        self.parked = Counter("rmqfast_gray_pulls_parked_total",
                              "Pulls of a queue the other side owns, answered SYSTEM_BUSY", ["group", "side"])
        self.fixes = Counter("rmqfast_gray_offset_fixes_total",
                             "Queues handed to a client from the group's committed offset", ["group", "side"])
        self.commits_dropped = Counter("rmqfast_gray_commits_dropped_total",
                                       "Offset commits of a client for a queue it does not own", ["group", "side"])
        self.answers_dropped = Counter(
            "rmqfast_gray_pull_answers_dropped_total",
            "Answers to pulls the broker held past a switch, turned into 'no message' (the queue changed hands)",
            ["group", "side"])
        self.lists = Counter("rmqfast_gray_consumer_lists_total", "Consumer lists rewritten to one side",
                             ["group", "side"])
        self.retries_kept = Counter(
            "rmqfast_gray_retries_kept_total",
            "A gray consumer's send-back (or retry-topic send) refused so that it consumes the message again",
            ["group"])
        self.held = Counter("rmqfast_gray_pulls_held_total",
                            "Pulls held during a hand-over fence (answered with no message when it ends)", ["group"])
        self.members = Gauge("rmqfast_gray_members", "Members of the group in the last consumer list seen",
                             ["group", "side"], multiprocess_mode="max")


_metrics: GrayMetrics | None = None


def gray_metrics() -> GrayMetrics:
    global _metrics
    if _metrics is None:
        _metrics = GrayMetrics()
    return _metrics


def _peer_ip(addr: str) -> str:
    host, _, _ = addr.rpartition(":")
    return host.strip("[]") or addr


class GrayFilter(Filter):
    name = "gray"
    wants_marked_responses = True
    # the sends are not in the action table: only those of split topics reach Python (send_topics)
    CODES = (C.HEART_BEAT, C.GET_CONSUMER_LIST_BY_GROUP, C.PULL_MESSAGE, C.UPDATE_CONSUMER_OFFSET,
             C.CONSUMER_SEND_MSG_BACK)

    def __init__(self, cfg: GraySection, queues: Callable[[str, str], int | None], commands: Commands,
                 metrics: GrayMetrics | None = None, *, broker_name: Callable[[str, str], str | None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``queues(topic, broker_name)``: the topic's queue count on that broker (None: unknown);
        ``broker_name(upstream_addr, topic)``: the name of the broker a connection goes to (4.x clients
        do not name it in their requests)."""
        self.cfg = cfg
        self.groups: dict[str, tuple[GrayGroup, Marker]] = {g.group: (g, Marker(g)) for g in cfg.groups}
        self.topics = {t: g.group for g in cfg.groups for t in g.topics}
        self.queues = queues
        self.broker_name = broker_name or (lambda addr, topic: None)
        self.commands = commands
        self.metrics = metrics
        self.clock = clock
        start = clock()
        self.alive_at = {g: start for g in self.groups}  # last time a consumer list had a gray member
        self._phases: dict[str, Phase] = {}  # the phase each group was last seen in (logged on change)
        self.handover = Handover(cfg.handover)  # the fence and notification at each phase change

    def request_slots(self) -> set[int]:
        return slots_of(self.CODES)

    def send_topics(self) -> list[bytes] | None:
        return sorted([t.encode() for t in self.topics] + [(RETRY_PREFIX + g).encode() for g in self.groups])

    # State of a group -------------------------------------------------------------------------

    def phase(self, group: str) -> Phase:
        c = self.commands.command(group)
        action, at, drained = (c["action"], c["at"], c.get("drained_at")) if c else (None, 0.0, None)
        lag = getattr(self.commands, "lead", 0.0)  # the workers' common view runs that far behind the file
        ph = phase(action, at, self.clock() - lag, self.cfg.settle, drained, self.cfg.drain_timeout)
        if self._phases.get(group) is not ph:
            self._phases[group] = ph
            log.info("gray: phase", extra=ctx(group=group, phase=ph.value, action=action))
        f, started = self.handover.seen(group, ph, self.clock())
        if started:
            log.info("gray: hand-over started (pulls of the group held, consumers notified to rebalance)",
                     extra=ctx(group=group, phase=ph.value, previous=f.prev.value if f.prev else None,
                               fence=self.cfg.handover, epoch=f.epoch))
        return ph

    def tick(self, sessions: Any) -> None:
        """Called a few times a second by the worker: phase changes are seen without waiting for a frame,
        the group's consumers are notified, held pulls are answered when their fence ends."""
        for group in self.groups:
            self.phase(group)
        run_due(self.handover, sessions, self.clock())

    def gray_alive(self, group: str) -> bool:
        return self.clock() - self.alive_at.get(group, 0.0) < self.cfg.grace

    def side(self, session: Session, marker: Marker) -> str | None:
        cid = session.state.get("gray_cid")
        if cid is None:
            return None
        return GRAY if marker.client_is_gray(cid) else NORMAL

    def _broker(self, session: Session, ext: dict[str, str], topic: str) -> str | None:
        return ext.get("bname") or ext.get("n") or self.broker_name(session.upstream_addr, topic)

    def _is_gray_queue(self, g: GrayGroup, topic: str, broker: str | None, qid: int) -> bool | None:
        """None: the topic's queue count on that broker is unknown."""
        if topic not in g.topics:
            return False  # other topics (retry topics...) belong to the normal side
        n = self.queues(topic, broker) if broker else None
        if n is None:
            return None
        return is_gray_queue(qid, n, g.gray_queues)

    # Requests -----------------------------------------------------------------------------------

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        code = frame.code
        try:
            if code == C.HEART_BEAT:
                self._heartbeat(session, frame)
                return None
            if code == C.GET_CONSUMER_LIST_BY_GROUP:
                return self._consumer_list_request(session, frame)
            if code == C.PULL_MESSAGE:
                return self._pull(session, frame)
            if code == C.UPDATE_CONSUMER_OFFSET:
                return self._commit(session, frame)
            if code in C.ANY_SEND_CODES:
                return self._send(session, frame)
            if code == C.CONSUMER_SEND_MSG_BACK:
                return self._send_back(session, frame)
        except (ValueError, KeyError, TypeError) as exc:  # a header the codec could not read: the broker decides
            log.debug("gray: frame not understood, passed", extra=ctx(code=code, error=str(exc)))
        return None

    def _heartbeat(self, session: Session, frame: Frame) -> None:
        body = frame.body
        if not body:
            return
        try:
            data = json.loads(body)
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        cid = data.get("clientID")
        if isinstance(cid, str) and cid:
            session.state["gray_cid"] = cid
        subs: dict[tuple[str, str], tuple[str, str]] = session.state.setdefault("gray_subs", {})
        for cd in data.get("consumerDataSet") or ():
            group = cd.get("groupName") if isinstance(cd, dict) else None
            if group not in self.groups:
                continue
            session.state.setdefault("gray_groups", set()).add(group)  # notified at each phase change
            for sd in cd.get("subscriptionDataSet") or ():  # empty in 5.x heartbeats that repeat the last one
                if not isinstance(sd, dict) or not isinstance(sd.get("topic"), str):
                    continue
                expr, kind = sd.get("subString"), sd.get("expressionType") or "TAG"
                if isinstance(expr, str) and isinstance(kind, str) and len(subs) < _MAX_TRACKED:
                    subs[(group, sd["topic"])] = (expr, kind)

    def _consumer_list_request(self, session: Session, frame: Frame) -> Verdict | None:
        group = (frame.command().ext_fields or {}).get("consumerGroup")
        if group not in self.groups or frame.is_oneway:
            return None
        pending: dict[int, str] = session.state.setdefault("gray_lists", {})
        if len(pending) >= _MAX_TRACKED:
            pending.clear()
        pending[frame.opaque] = group
        frame.want_response = True
        return None

    def _group_queue(self, session: Session, frame: Frame) -> tuple[Any, ...] | None:
        """(command, group config, topic, queue id, broker, the client's side, whether the queue is
        gray) of a pull or offset commit of a gray group; None for other groups."""
        cmd = frame.command()
        ext = cmd.ext_fields or {}
        entry = self.groups.get(ext.get("consumerGroup", ""))
        if entry is None:
            return None
        g, marker = entry
        topic = ext.get("topic", "")
        qid = field_int(ext.get("queueId"), -1)
        broker = self._broker(session, ext, topic)
        return cmd, g, topic, qid, broker, self.side(session, marker), self._is_gray_queue(g, topic, broker, qid)

    def _pull(self, session: Session, frame: Frame) -> Verdict | None:
        q = self._group_queue(session, frame)
        if q is None:
            return None
        cmd, g, topic, qid, broker, side, gq = q
        key = (g.group, topic, broker, qid)
        parked: dict[tuple[Any, ...], Phase] = session.state.setdefault("gray_parked", {})
        ph = self.phase(g.group)
        if self.handover.fenced(g.group, self.clock()):
            return self._fenced_pull(session, frame, cmd, key, side, gq, ph)
        if side is None or gq is None or not may_pull(side, ph, gq, self.gray_alive(g.group)):
            if len(parked) < _MAX_TRACKED:
                parked.setdefault(key, ph)
            if self.metrics is not None:
                self.metrics.parked.labels(g.group, side or "unknown").inc()
            why = ("client not identified yet (no heartbeat on this connection)" if side is None
                   else "queue count unknown" if gq is None else f"queue owned by the other side ({ph.value})")
            remark = f"rmqfast gray: {topic} {broker} queue {qid} not pulled by this client: {why}"
            return reply(encode(make_response(cmd, C.SYSTEM_BUSY, remark)))
        epoch = self.handover.epoch(g.group)
        if key in parked:  # this client's position for the queue is stale: start it from the committed offset
            return self._offset_fix(session, frame, cmd, key, side, epoch, False)
        if session.state.get("gray_epochs", {}).get(key, 0) != epoch:
            # its first pull since a hand-over: from the committed offset or its own position, the later
            return self._offset_fix(session, frame, cmd, key, side, epoch, True)
        self._own_subscription(session, frame, cmd, g.group, topic)
        # the broker may hold this pull (long polling) past a switch: its answer is checked again
        pulls: dict[int, tuple[Any, ...]] = session.state.setdefault("gray_pulls", {})
        if len(pulls) >= _MAX_TRACKED:
            pulls.clear()
        pulls[frame.opaque] = (key, side, gq, cmd, epoch)
        frame.want_response = True
        owned: dict[tuple[Any, ...], int] = session.state.setdefault("gray_owned", {})
        if len(owned) >= _MAX_TRACKED:
            owned.clear()
        owned[key] = epoch  # it pulls the queue in this phase
        return None

    def _fenced_pull(self, session: Session, frame: Frame, cmd: RemotingCommand, key: tuple[Any, ...],
                     side: str | None, gq: bool | None, ph: Phase) -> Verdict:
        """A pull during a hand-over fence (:mod:`rmqfast.gray.handover`): held, answered with no message;
        once the held pulls were answered, the next pull of the client of the phase before commits its
        consumed offset first."""
        group = key[0]
        f = self.handover.groups[group]
        owned = session.state.get("gray_owned", {})
        if f.released and owned.get(key) == f.epoch - 1 and (commit := commit_of_pull(cmd)) is not None:
            owned.pop(key, None)  # once per fence; after it, its first pull sets its position again
            losing = side is None or gq is None or not may_pull(side, ph, gq, self.gray_alive(group))
            if losing:  # if it gets the queue back: from the committed offset
                session.state.setdefault("gray_parked", {}).setdefault(key, ph)
            last: dict[int, tuple[RemotingCommand, bool]] = session.state.setdefault("gray_last_commits", {})
            if len(last) >= _MAX_TRACKED:
                last.clear()
            last[frame.opaque] = (cmd, losing)
            frame.want_response = True
            offset = (commit.ext_fields or {}).get("commitOffset")
            log.info("gray: consumed offset of the queue's last owner committed", extra=ctx(
                group=group, queue=key[1:], offset=offset, losing=losing, client=session.client_addr))
            return rewrite(encode(commit))
        if self.metrics is not None:
            self.metrics.held.labels(group).inc()
        return self._hold(session, frame, cmd, group)

    def _hold(self, session: Session, frame: Frame, pull: RemotingCommand, group: str) -> Verdict:
        if frame.is_oneway:
            return divert("gray: one-way pull during a hand-over")
        if self.handover.hold(group, session, held_answer(pull)):
            return divert("gray: pull held during a hand-over")
        remark = "rmqfast gray: queues changing hands (too many pulls held)"
        return reply(encode(make_response(pull, C.SYSTEM_BUSY, remark)))

    def _own_subscription(self, session: Session, frame: Frame, cmd: RemotingCommand, group: str, topic: str) -> None:
        """The pull carries this client's own subscription (``FLAG_SUBSCRIPTION``): the broker keeps one
        subscription per group, the last heartbeat's, and the two versions may subscribe to different
        tags; with the flag the broker filters this pull by the expression in it."""
        sub = session.state.get("gray_subs", {}).get((group, topic))
        ext = cmd.ext_fields or {}
        flag = field_int(ext.get("sysFlag"), -1)
        if sub is None or flag < 0 or flag & FLAG_SUBSCRIPTION or "AccessKey" in ext:  # a signature covers them
            return
        new = dict(ext)
        new["sysFlag"] = str(flag | FLAG_SUBSCRIPTION)
        new["subscription"], new["expressionType"] = sub
        frame.data = encode(replace(cmd, ext_fields=new))  # the other filters see (and relay) the new frame
        frame._cmd = None

    def _offset_fix(self, session: Session, frame: Frame, cmd: RemotingCommand, key: tuple[Any, ...],
                    side: str, epoch: int, own_if_later: bool) -> Verdict:
        ext = cmd.ext_fields or {}
        q: dict[str, str] = {"consumerGroup": ext.get("consumerGroup", ""), "topic": ext.get("topic", ""),
                             "queueId": ext.get("queueId", ""), "setZeroIfNotFound": "false"}
        if "bname" in ext:
            q["bname"] = ext["bname"]
        query = RemotingCommand(code=C.QUERY_CONSUMER_OFFSET, language=cmd.language, version=cmd.version,
                                opaque=cmd.opaque, flag=cmd.flag, ext_fields=q, serialize_type=cmd.serialize_type)
        fixes: dict[int, tuple[Any, ...]] = session.state.setdefault("gray_fixes", {})
        if len(fixes) >= _MAX_TRACKED:
            fixes.clear()
        fixes[frame.opaque] = (key, cmd, side, epoch, own_if_later)
        frame.want_response = True
        return rewrite(encode(query))

    def _commit(self, session: Session, frame: Frame) -> Verdict | None:
        q = self._group_queue(session, frame)
        if q is None:
            return None
        cmd, g, topic, qid, broker, side, gq = q
        ph = self.phase(g.group)
        parked_in = session.state.get("gray_parked", {}).get((g.group, topic, broker, qid))
        alive = self.gray_alive(g.group)
        f = self.handover.groups.get(g.group)
        prev = f.prev if f is not None and self.handover.fenced(g.group, self.clock()) else None
        # during a hand-over fence the old owner's last commits count too
        allowed = side is not None and (may_commit(side, ph, gq, alive)
                                        or (prev is not None and may_commit(side, prev, gq, alive)))
        # since a hand-over, only a client that pulled the queue in this phase or the last one commits it
        epoch = self.handover.epoch(g.group)
        seen = epoch == 0 or session.state.get("gray_owned", {}).get((g.group, topic, broker, qid), -1) >= epoch - 1
        ok = gq is not None and allowed and seen and (parked_in is None or parked_in is Phase.ABORTING)
        if ok:
            return None
        if self.metrics is not None:
            self.metrics.commits_dropped.labels(g.group, side or "unknown").inc()
        logged: set[tuple[Any, ...]] = session.state.setdefault("gray_drop_logged", set())
        key = (g.group, topic, broker, qid, ph, parked_in)
        if key not in logged and len(logged) < 64:  # once per connection, queue and reason
            logged.add(key)
            log.info("gray: offset commit dropped (queue not owned by this client)",
                     extra=ctx(group=g.group, topic=topic, broker=broker, queue=qid, side=side, gray_queue=gq,
                               phase=ph.value, gray_alive=self.gray_alive(g.group),
                               parked_in=parked_in.value if parked_in else None, client=session.client_addr,
                               offset=(cmd.ext_fields or {}).get("commitOffset")))
        if frame.is_oneway:
            return divert("gray: offset commit of a queue this client does not own")
        return reply(encode(make_response(cmd, C.SUCCESS)))

    def _send(self, session: Session, frame: Frame) -> Verdict | None:
        # The header is decoded whole: a byte search for the topic can find a decoy (a nested object,
        # a top-level field the broker ignores) while the broker reads the key written otherwise.
        cmd = frame.command()
        f = send_fields(cmd.code, cmd.ext_fields)
        if f.get("b", "").startswith(RETRY_PREFIX):  # the Java client's fallback when a send-back failed
            return self._keep_retry(session, cmd, f["b"][len(RETRY_PREFIX):], f["b"])
        group = self.topics.get(f.get("b", ""))
        if group is None:
            return None
        g, marker = self.groups[group]
        topic = f["b"]
        qid = field_int(f.get("e"), -1)
        broker = f.get("n") or self.broker_name(session.upstream_addr, topic)
        n = self.queues(topic, broker) if broker else None
        props = parse_properties(f.get("i", "")) if marker.prop is not None else {}
        gray = marker.send_is_gray(f.get("a", ""), props, session.state.get("gray_cid"), _peer_ip(session.client_addr))
        side = GRAY if gray else NORMAL
        if self.metrics is not None:
            self.metrics.sends.labels(group, side).inc()
        if n is None:
            log.warning("gray: queue count of a split topic unknown; send passed unchanged",
                        extra=ctx(topic=topic, broker=broker))
            return None
        if n <= g.gray_queues:
            log.error("gray: topic has too few queues on this broker for its gray share; not split",
                      extra=ctx(topic=topic, broker=broker, queues=n, gray_queues=g.gray_queues))
            return None
        new = send_queue(qid, n, g.gray_queues, gray, self.phase(group))
        if new == qid:
            return None
        ext = dict(cmd.ext_fields or {})
        if "AccessKey" in ext:  # the signature covers the queue id: it cannot be rewritten
            remark = f"rmqfast gray: signed send to {topic} queue {qid} cannot be moved to queue {new}"
            return reply(encode(make_response(cmd, C.NO_PERMISSION, remark)))
        ext["queueId" if cmd.code in V1_CODES else "e"] = str(new)
        frame.data = encode(replace(cmd, ext_fields=ext))  # the other filters see (and relay) the new frame
        frame._cmd = None
        if self.metrics is not None:
            self.metrics.moved.labels(group, side).inc()
        return None

    def _send_back(self, session: Session, frame: Frame) -> Verdict | None:
        cmd = frame.command()
        ext = cmd.ext_fields or {}
        entry = self.groups.get(ext.get("group", ""))
        if entry is None or ext.get("originTopic") not in entry[0].topics:
            return None  # other topics of the group: the retry topic, the normal side
        if cmd.language not in ("JAVA", "GO"):
            return None  # whether the client consumes it again after a refusal is not known: the broker retries it
        return self._keep_retry(session, cmd, entry[0].group, ext.get("originTopic", ""))

    def _keep_retry(self, session: Session, cmd: RemotingCommand, group: str, topic: str) -> Verdict | None:
        """A gray consumer's retry is refused while the gray side owns its queues: the client then
        consumes the message again itself, on the gray side (the retry topic is pulled by the normal side)."""
        entry = self.groups.get(group)
        if entry is None or self.side(session, entry[1]) != GRAY:
            return None
        if self.phase(group) not in (Phase.ACTIVE, Phase.PROMOTING):
            return None  # an abort: the normal side takes the retries; promoted: one group
        if self.metrics is not None:
            self.metrics.retries_kept.labels(group).inc()
        if cmd.code == C.CONSUMER_SEND_MSG_BACK and cmd.language == "GO":
            # rocketmq-client-go takes any answer for "sent back" (the message would be lost); unanswered,
            # the send-back fails after its timeout and the client consumes the message again
            return divert("gray: a gray Go consumer's send-back left unanswered (it consumes the message again)")
        remark = f"rmqfast gray: a gray consumer's retry of {topic} stays with it (consume it again locally)"
        return reply(encode(make_response(cmd, C.NO_PERMISSION, remark)))

    def place(self, cmd: RemotingCommand, broker: str, queues: int, peer_ip: str) -> RemotingCommand:
        """A send moved to ``broker`` (``queues`` write queues) by the failover service: the queue id of
        its share there.  The client id of its connection is not known there: the other markers decide."""
        f = send_fields(cmd.code, cmd.ext_fields)
        group = self.topics.get(f.get("b", ""))
        if group is None:
            return cmd
        g, marker = self.groups[group]
        qid = field_int(f.get("e"), -1)
        props = parse_properties(f.get("i", "")) if marker.prop is not None else {}
        gray = marker.send_is_gray(f.get("a", ""), props, None, peer_ip)
        new = send_queue(qid, queues, g.gray_queues, gray, self.phase(group))
        if new == qid:
            return cmd
        ext = dict(cmd.ext_fields or {})
        ext["queueId" if cmd.code in V1_CODES else "e"] = str(new)
        return replace(cmd, ext_fields=ext)

    # Responses ----------------------------------------------------------------------------------

    def on_response(self, session: Session, frame: Frame) -> Verdict | None:
        cut: set[int] | None = session.state.get("gray_cut")
        if cut and frame.opaque in cut:  # the proxy answered this pull when a hand-over started
            cut.discard(frame.opaque)
            return divert("gray: answer to a pull answered at a hand-over")
        lists: dict[int, str] | None = session.state.get("gray_lists")
        if lists and frame.opaque in lists:
            return self._consumer_list_response(session, frame, lists.pop(frame.opaque))
        fixes: dict[int, Any] | None = session.state.get("gray_fixes")
        if fixes and frame.opaque in fixes:
            return self._offset_answer(session, frame, *fixes.pop(frame.opaque))
        last: dict[int, tuple[RemotingCommand, bool]] | None = session.state.get("gray_last_commits")
        if last and frame.opaque in last:  # its last position is committed: the pull waits
            pull, losing = last.pop(frame.opaque)
            if not losing:
                return self._hold(session, frame, pull, (pull.ext_fields or {}).get("consumerGroup", ""))
            remark = f"rmqfast gray: queue handed over (last position committed: {frame.code})"
            return rewrite(encode(make_response(pull, C.SYSTEM_BUSY, remark)))
        pulls: dict[int, Any] | None = session.state.get("gray_pulls")
        if pulls and frame.opaque in pulls:
            return self._pull_answer(session, frame, *pulls.pop(frame.opaque))
        return None

    def _pull_answer(self, session: Session, frame: Frame, key: tuple[Any, ...], side: str, gq: bool,
                     pull: RemotingCommand, epoch: int) -> Verdict | None:
        """The answer to a pull the broker held: if the queue changed hands meanwhile (or a hand-over
        started), the client gets no message (its position stays) and the queue counts as parked for it
        (a hand-over: its next pull starts from the committed offset or its own position)."""
        group = key[0]
        if frame.code != C.SUCCESS:
            return None
        handed = epoch != self.handover.epoch(group) or self.handover.fenced(group, self.clock())
        if not handed and may_pull(side, self.phase(group), gq, self.gray_alive(group)):
            return None
        parked: dict[tuple[Any, ...], Phase] = session.state.setdefault("gray_parked", {})
        if not handed and len(parked) < _MAX_TRACKED:
            parked.setdefault(key, self.phase(group))
        if self.metrics is not None:
            self.metrics.answers_dropped.labels(group, side).inc()
        ext = frame.command().ext_fields or {}
        offset = (pull.ext_fields or {}).get("queueOffset", "0")
        out = {"suggestWhichBrokerId": ext.get("suggestWhichBrokerId", "0"), "nextBeginOffset": offset,
               "minOffset": ext.get("minOffset", "0"), "maxOffset": ext.get("maxOffset", offset)}
        return rewrite(encode(make_response(pull, C.PULL_NOT_FOUND, "rmqfast gray: queue changed hands",
                                            ext_fields=out)))

    def _consumer_list_response(self, session: Session, frame: Frame, group: str) -> Verdict | None:
        if frame.code != C.SUCCESS or not frame.body:
            return None
        try:
            data = json.loads(frame.body)
            ids = data["consumerIdList"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError("consumerIdList is not a list of strings")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("gray: consumer list not understood; passed", extra=ctx(group=group, error=str(exc)))
            return None
        g, marker = self.groups[group]
        n_gray = sum(1 for i in ids if marker.client_is_gray(i))
        if n_gray:
            self.alive_at[group] = self.clock()
        side = self.side(session, marker) or NORMAL
        shown = consumer_ids_for(ids, side, self.phase(group), marker)
        if self.metrics is not None:
            self.metrics.lists.labels(group, side).inc()
            self.metrics.members.labels(group, GRAY).set(n_gray)
            self.metrics.members.labels(group, NORMAL).set(len(ids) - n_gray)
        if shown == ids:
            return None
        return rewrite(frame.with_body(json.dumps({"consumerIdList": shown}, separators=(",", ":")).encode()))

    def _offset_answer(self, session: Session, frame: Frame, key: tuple[Any, ...], pull: RemotingCommand,
                       side: str, epoch: int, own_if_later: bool) -> Verdict:
        resp = frame.command()
        ext = resp.ext_fields or {}
        own = field_int((pull.ext_fields or {}).get("queueOffset"))
        if resp.code == C.SUCCESS and field_int(ext.get("offset"), -1) >= 0:
            offset = field_int(ext.get("offset"))
            if own_if_later:  # a client that kept its queue goes on (what it pulled, it was given)
                offset = max(offset, own)
        elif resp.code in (C.SUCCESS, QUERY_NOT_FOUND):  # never committed: the client's own position stands
            offset = own
        else:
            remark = f"rmqfast gray: committed offset not readable ({resp.code} {resp.remark})"
            return rewrite(encode(make_response(pull, C.SYSTEM_BUSY, remark)))
        session.state.get("gray_parked", {}).pop(key, None)
        epochs: dict[tuple[Any, ...], int] = session.state.setdefault("gray_epochs", {})
        if len(epochs) >= _MAX_TRACKED:
            epochs.clear()
        epochs[key] = epoch
        if self.metrics is not None:
            self.metrics.fixes.labels(key[0], side).inc()
        log.info("gray: queue handed over from the committed offset",
                 extra=ctx(group=key[0], topic=key[1], broker=key[2], queue=key[3], side=side, offset=offset,
                           client=session.client_addr))
        out = {"suggestWhichBrokerId": "0", "nextBeginOffset": str(offset), "minOffset": "0",
               "maxOffset": str(offset)}
        return rewrite(encode(make_response(pull, C.PULL_NOT_FOUND, "rmqfast gray: start from the committed offset",
                                            ext_fields=out)))

    def on_close(self, session: Session) -> None:
        for k in ("gray_lists", "gray_fixes", "gray_parked", "gray_pulls", "gray_subs", "gray_drop_logged",
                  "gray_epochs", "gray_groups", "gray_owned", "gray_last_commits", "gray_cut"):
            session.state.pop(k, None)


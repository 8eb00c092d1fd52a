"""Moving sends off a dead broker to another live master that holds the topic.

A client connection to a broker endpoint whose broker cannot be reached (connect refused or
timed out) is not refused: :class:`FailoverService` serves it.  Each request frame is read
whole and decoded with :mod:`rmqfast.codec.command` (what is decided is what the other broker
reads: the frame sent there is re-encoded from that decoding):

* A send (``SEND_MESSAGE`` 10, ``SEND_MESSAGE_V2`` 310, ``SEND_BATCH_MESSAGE`` 320) that is not
  ordered goes to another master of the topic's route that is alive and has writable queues,
  with the broker name (``n`` / ``bname``) and queue id (``e`` / ``queueId``) rewritten to that
  broker's (``queue id mod its write queues``).  Its answer goes back with the client's opaque.
  An answer that asks to retry elsewhere (SYSTEM_ERROR, SYSTEM_BUSY, SERVICE_NOT_AVAILABLE,
  NO_PERMISSION, TOPIC_NOT_EXIST, GO_AWAY) or no answer makes the next live master try.
* An ordered send is never moved (order would break): it is answered ``SERVICE_NOT_AVAILABLE``
  (14), which 4.x and 5.x producers treat as retryable, with a remark saying why.  A send is
  ordered when its topic matches ``failover.ordered_topics``, when it carries the
  ``failover.ordered_property`` property (``__SHARDINGKEY``: FIFO messages), or when it is a
  transaction half message (its commit goes to the broker the producer believes holds it).
  A producer that picks a queue with a ``MessageQueueSelector`` puts nothing on the wire that
  says so: such topics must be listed in ``failover.ordered_topics``.
* Every other request (pulls, heartbeats, offsets...) is answered ``SYSTEM_ERROR`` naming the
  unreachable broker, as the refusal without failover did; oneway requests are dropped.

The connection is closed, once nothing is in flight, as soon as the broker is seen alive again
(the client reconnects and is relayed to its own broker), and after a second without requests.
Consumers are untouched: route healing keeps the dead broker's queues readable, so they resume
where they were.

Policy: a moved send never passed the relay's filter chain, so the service applies what that chain
would have, toward the live master it is aimed at: ``[limits]`` (it takes tokens like any send;
over a limit it gets SYSTEM_BUSY, over a shape rule it is shaped) and ``[delay]`` (a send asking
for proxy-held delay is held and released to that master at its due time).  A send *resent*
because its broker died with it in flight is not charged nor held again: it went through the chain
when the client sent it (the scanner's limiter took its tokens; a delayed send was held then and
never reached the broker, so it is not among the kept ones) and this is the same message reaching
the cluster once.

Routes come from :class:`RouteBook`: what the worker's route rewrites saw, else asked of the
name servers (on this path only, never on the relay path).
"""

from __future__ import annotations

import itertools
import logging
import operator
import struct
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

import gevent
from gevent import socket
from gevent.event import Event
from gevent.lock import Semaphore

from rmqfast.codec import codes as C
from rmqfast.codec import slot_code
from rmqfast.codec.batch import scanned_batch_count
from rmqfast.codec.command import RemotingCommand, decode_frame, encode, make_response
from rmqfast.codec.properties import parse_properties
from rmqfast.codec.sendheader import TRANSACTION_PREPARED, field_int, is_batch, send_fields
from rmqfast.codec.tables import result_index
from rmqfast.errors import RemotingError
from rmqfast.log import ctx
from rmqfast.proxy.health import BrokerHealth, FailoverSection, HealthMetrics, local_shortage
from rmqfast.proxy.policy import Filter, Frame, Kind, Verdict, slots_of

log = logging.getLogger("rmqfast.failover")

_I32 = struct.Struct(">i")

SERVICE_NOT_AVAILABLE = 14
#: Answers after which the next live master is tried (the producer would retry them too).
TRY_NEXT_CODES = frozenset({C.SYSTEM_ERROR, C.SYSTEM_BUSY, SERVICE_NOT_AVAILABLE, C.NO_PERMISSION,
                            C.TOPIC_NOT_EXIST, C.GO_AWAY})
ROUTE_TTL = 30.0
#: A topic the name servers did not know is not asked for again for this long (every send of it to a
#: dead broker would otherwise cost a name server round trip).
UNKNOWN_TTL = 2.0
#: Requests of one failover connection handled at once; its reading pauses beyond that.
MAX_IN_FLIGHT = 1024
#: Bytes of the requests one failover connection holds at once (each may be a whole max-size
#: frame); its reading pauses beyond that (one request at a time is always taken).
MAX_IN_FLIGHT_BYTES = 64 * 1024 * 1024

Route = tuple[dict[str, str], list[tuple[str, int, int]]]  # masters by name, (name, write queues, perm)


# Routes ------------------------------------------------------------------------------------------


class RouteBook:
    """Topic routes with real broker addresses, as this worker last saw them."""

    def __init__(self, namesrvs: Callable[[], list[str]], *, ttl: float = ROUTE_TTL, timeout: float = 2.0) -> None:
        self.namesrvs = namesrvs
        self.ttl = ttl
        self.timeout = timeout
        self._routes: dict[str, tuple[float, Route]] = {}
        self._unknown: dict[str, float] = {}  # topic -> when the name servers said they do not know it
        self._pool: Any = None

    def learn(self, topic: str, obj: dict[Any, Any]) -> None:
        from rmqfast.clouds.remoting import route_of

        if len(self._routes) > 100000:
            self._routes.clear()
        self._routes[topic] = (time.monotonic(), route_of(obj))

    def cached(self, topic: str) -> Route | None:
        got = self._routes.get(topic)
        return None if got is None else got[1]

    def get(self, topic: str) -> Route | None:
        """The route of ``topic``: cached, else asked of the name servers (blocks this greenlet)."""
        got = self._routes.get(topic)
        now = time.monotonic()
        if got is not None and now - got[0] < self.ttl:
            return got[1]
        if got is None and now - self._unknown.get(topic, -UNKNOWN_TTL) < UNKNOWN_TTL:
            return None
        from rmqfast.clouds.remoting import ConnectionPool, RemoteError, fetch_route

        if self._pool is None:
            self._pool = ConnectionPool(self.timeout)
        try:
            route = fetch_route(self._pool, self.namesrvs(), topic, timeout=self.timeout)
        except RemoteError as exc:
            log.warning("no route for a send to move", extra=ctx(topic=topic, error=str(exc)))
            return got[1] if got is not None else None
        if route is None:
            if len(self._unknown) > 10000:
                self._unknown.clear()
            self._unknown[topic] = time.monotonic()
            return None
        self._unknown.pop(topic, None)
        self._routes[topic] = (time.monotonic(), route)
        return route

    def broker_name_of(self, addr: str) -> str | None:
        for _, (masters, _) in self._routes.values():
            for name, a in masters.items():
                if a == addr:
                    return name
        return None


# Decisions (no sockets) -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendInfo:
    """The fields of a send request header that failover reads and rewrites."""

    topic: str
    queue_id: int
    broker_name: str | None
    properties: str
    sys_flag: int
    v2: bool


def send_info(cmd: RemotingCommand) -> SendInfo | None:
    """The send header of ``cmd``, or None if it is not a send.

    V1 or V2 field names by request code, as the broker decides (``SEND_MESSAGE`` reads
    ``topic``, ``queueId``...; the others ``b``, ``e``...), never by which keys are present.
    """
    if cmd.code not in C.SEND_CODES or cmd.is_response:
        return None
    f = send_fields(cmd.code, cmd.ext_fields)
    topic = f.get("b")
    if not topic:
        return None
    return SendInfo(
        topic=topic,
        queue_id=field_int(f.get("e")),
        broker_name=f.get("n") or (cmd.ext_fields or {}).get("bname"),
        properties=f.get("i") or "",
        sys_flag=field_int(f.get("f")),
        v2=cmd.code != C.SEND_MESSAGE,
    )


def ordered_reason(info: SendInfo, cfg: FailoverSection) -> str | None:
    """Why this send must not be moved (its order or its transaction depends on its broker), or None."""
    if cfg.is_ordered_topic(info.topic):
        return f"topic {info.topic} is listed in failover.ordered_topics"
    prop = cfg.ordered_property
    if prop and (info.properties.startswith(prop + "\x01") or f"\x02{prop}\x01" in info.properties):
        return f"the message carries {prop} (an ordered message)"
    if info.sys_flag & TRANSACTION_PREPARED:
        return "a transaction half message is committed at the broker the producer chose"
    return None


def _messages(cmd: RemotingCommand) -> int:
    """Messages of a send, counted as the relay's scanner counts them for the limiter (a batch: the
    records its totalSize words walk)."""
    return scanned_batch_count(bytes(cmd.body)) if is_batch(cmd.code, cmd.ext_fields) else 1


class _Upstream:
    """What :meth:`rmqfast.delay.service.DelayService.hold` reads of a session: the broker a held send
    is released to (no ordered writer: the hold answers in its verdict once stored)."""

    __slots__ = ("upstream_addr",)

    def __init__(self, upstream_addr: str) -> None:
        self.upstream_addr = upstream_addr


def candidates(route: Route, dead: set[str], exclude_name: str | None, exclude_addr: str) -> list[tuple[str, str, int]]:
    """(broker name, master address, write queues) of the live masters that may take the topic."""
    masters, queues = route
    out = []
    for name, nq, perm in queues:
        addr = masters.get(name)
        if (addr is None or nq <= 0 or not perm & 2 or name == exclude_name or addr == exclude_addr
                or addr in dead):
            continue
        out.append((name, addr, nq))
    return out


def retarget(cmd: RemotingCommand, info: SendInfo, broker_name: str, write_queues: int) -> RemotingCommand:
    """``cmd`` aimed at ``broker_name``: broker name and queue id rewritten, everything else kept."""
    ext = dict(cmd.ext_fields or {})
    qid = info.queue_id % write_queues if info.queue_id >= 0 else info.queue_id
    if info.v2:
        ext["e"] = str(qid)
        if "n" in ext or "bname" not in ext:
            ext["n"] = broker_name
    else:
        ext["queueId"] = str(qid)
    if "bname" in ext:
        ext["bname"] = broker_name
    return replace(cmd, ext_fields=ext)


# A relayed connection whose upstream died -------------------------------------------------------------


#: Copies of sends kept while they are in flight (for a resend when their broker dies): at most
#: this many per connection, bytes per connection, bytes per worker.  A send beyond them is not
#: kept (if its broker dies it is answered SYSTEM_ERROR, as without keeping).
KEEP_PER_CONNECTION = 32
KEEP_BYTES_PER_CONNECTION = 4 * 1024 * 1024
KEEP_BYTES_PER_WORKER = 64 * 1024 * 1024
#: A resend of a send in flight must be answered within this long, else the producer gets SYSTEM_ERROR
#: (and retries it itself, a possible duplicate): its own timeout (3 s by default, retries included)
#: must leave it time for that.
RESEND_DEADLINE = 1.0


class KeepSendsInFlight(Filter):
    """Keeps the bytes of each send forwarded to a broker until it is answered (the last filter of
    the broker chain, so what it keeps is what the broker was sent).

    ``everything``: every send is handed to Python to be kept (``failover.resend = "all"``: the
    sends leave the compiled fast path); else only the sends another filter has handed to Python
    anyway are kept (``"policy"``: no cost on the fast path).  Answers are not seen here: entries
    whose answer came are dropped when the connection's in-flight table says so (at the next send).
    """

    name = "failover-keep"

    def __init__(self, everything: bool = False) -> None:
        self.everything = everything
        self.held = 0  # bytes kept by every connection of the worker's chain

    def request_slots(self) -> set[int]:
        return slots_of(C.SEND_CODES) if self.everything else set()

    def passive_slots(self) -> set[int]:
        return slots_of(C.SEND_CODES)

    def on_request(self, session: Any, frame: Any) -> None:
        if frame.is_oneway or frame.code not in C.SEND_CODES:
            return None
        st = session.state
        kept: dict[int, bytes] | None = st.get("kept")
        if kept is None:
            kept = st["kept"] = {}
            st["kept_bytes"] = 0
            st["keeper"] = self
        elif kept:
            self._prune(session, kept)
        n = len(frame.data)
        if frame.opaque in kept:
            self.release(session, frame.opaque)
        if (len(kept) >= KEEP_PER_CONNECTION or st["kept_bytes"] + n > KEEP_BYTES_PER_CONNECTION
                or self.held + n > KEEP_BYTES_PER_WORKER):
            return None  # not kept: answered SYSTEM_ERROR if its broker dies
        kept[frame.opaque] = bytes(frame.data)
        st["kept_bytes"] += n
        self.held += n
        return None  # decides nothing: the send is forwarded as it is

    def _prune(self, session: Any, kept: dict[int, bytes]) -> None:
        inflight = session.inflight
        if inflight is None:
            return
        waiting = len(inflight)
        if waiting == 0:
            live: set[int] = set()
        elif len(kept) > waiting or len(kept) >= KEEP_PER_CONNECTION:
            live = {o for o, _ in inflight.waiting(0)}
        else:
            return
        for opaque in [o for o in kept if o not in live]:
            self.release(session, opaque)

    def release(self, session: Any, opaque: int) -> bytes | None:
        """The kept copy of ``opaque``'s send (None if none), no longer counted."""
        st = session.state
        data = st.get("kept", {}).pop(opaque, None)
        if data is not None:
            st["kept_bytes"] -= len(data)
            self.held -= len(data)
        return data

    def on_close(self, session: Any) -> None:
        kept = session.state.get("kept")
        if kept:
            for opaque in list(kept):
                self.release(session, opaque)


def answer_in_flight(session: Any, remark: str,
                     resend: Callable[[bytes], RemotingCommand | None] | None = None,
                     resend_timeout: float = RESEND_DEADLINE) -> tuple[int, int, int]:
    """Answer the client requests still waiting on ``session`` (its upstream connection just ended,
    or its broker was seen dead).

    A send whose bytes were kept (:class:`KeepSendsInFlight`) is given to ``resend`` (which moves
    it to another live master and returns that broker's answer, or a refusal for an ordered or
    signed send), all of them at once, and the client gets that answer; the others, and a send
    whose resend did not end within ``resend_timeout``, get SYSTEM_ERROR, which 4.x and 5.x
    producers retry on another broker at once.

    Without it the client only sees the connection close: a 5.x client fails the waiting requests
    at once (``failFast`` on an inactive channel), a 4.9.4 client waits for each one's timeout
    (3 s for a send: the producer has no time left to retry and reports a failure).  The answers
    go out only if the stream to the client is at a frame boundary.  Returns (requests answered,
    sends among them: each may have been stored by the dying broker, so its resend or retry may
    duplicate it, sends among those resent by rmqfast).
    """
    inflight = session.inflight
    out = session.to_client
    if inflight is None or out is None or out.queue or not out.at_boundary():
        return 0, 0, 0
    keeper = session.state.get("keeper") if resend is not None else None
    answered = sends = 0
    moving: list[tuple[int, int, Any]] = []
    for opaque, slot in inflight.waiting(0):
        if inflight.take(0, opaque) is None:
            continue
        is_send = slot_code(slot) in C.SEND_CODES
        sends += is_send
        data = keeper.release(session, opaque) if keeper is not None and is_send else None
        if data is not None:
            moving.append((opaque, slot, gevent.spawn(_resend_one, resend, data)))
            continue
        try:
            _answer_error(session, out, opaque, slot, remark)
        except OSError:  # the client went too (a reset or broken pipe): nobody is left to answer
            break
        answered += 1
    if not moving:
        return answered, sends, 0
    st = session.state
    st["resending"] = st.get("resending", 0) + 1  # whoever closes this connection waits for the answers
    try:
        gevent.joinall([g for _, _, g in moving], timeout=resend_timeout)
    finally:
        st["resending"] -= 1
    resent = 0
    for opaque, slot, g in moving:
        got = g.value if g.ready() else None
        if not g.ready():
            g.kill(block=False)
        if session.closed or out.queue or not out.at_boundary():
            log.warning("a send in flight was resent but its client connection went meanwhile",
                        extra=ctx(client=getattr(session, "client_addr", ""), resent=got is not None))
            continue  # nothing can be told
        try:
            if got is None:
                log.warning("a send in flight was not resent in time; answered SYSTEM_ERROR (the producer "
                            "retries it)", extra=ctx(client=getattr(session, "client_addr", ""),
                                                     deadline=resend_timeout))
                _answer_error(session, out, opaque, slot, remark)
            else:
                session.stats.count_result(slot, result_index(got.code))
                session.answer(out, encode(replace(got, opaque=opaque)), True)
                resent += 1
        except OSError:  # the client went meanwhile (a reset or broken pipe)
            log.warning("a send in flight was resent but its client connection went meanwhile",
                        extra=ctx(client=getattr(session, "client_addr", ""), resent=got is not None))
            break
        answered += 1
    return answered, sends, resent


def wait_resends(session: Any, timeout: float = RESEND_DEADLINE + 0.5) -> None:
    """Wait (at most ``timeout``) until no :func:`answer_in_flight` of ``session`` is resending:
    closing it sooner would lose the answers (the broker's death is seen by the relay and by the
    prober at about the same time, each may answer some of the requests)."""
    deadline = time.monotonic() + timeout
    while session.state.get("resending") and time.monotonic() < deadline:
        gevent.sleep(0.02)


def _resend_one(resend: Callable[[bytes], RemotingCommand | None], data: bytes) -> RemotingCommand | None:
    try:
        return resend(data)
    except Exception:  # a resend that fails is answered SYSTEM_ERROR (never breaks the close)
        log.exception("resending a send in flight failed")
        return None


def _answer_error(session: Any, out: Any, opaque: int, slot: int, remark: str) -> None:
    data = encode(RemotingCommand(code=C.SYSTEM_ERROR, flag=C.FLAG_RESPONSE, opaque=opaque, remark=remark))
    session.stats.count_result(slot, result_index(C.SYSTEM_ERROR))
    session.answer(out, data, True)


_INFLIGHT = operator.attrgetter("inflight")


def with_requests(tables: dict[Any, Any]) -> list[Any]:
    """The sessions of ``tables`` (in-flight table -> its session) with a request in flight.

    ``filter`` tests each table's truth (no request: false) in C and touches neither the sessions
    nor anything else of them: the sweep ten times a second over 10,000 idle connections costs a
    look at 10,000 small tables, not at 10,000 sessions."""
    return [tables[t] for t in filter(None, tables)]


def stalled_sends(sessions: Collection[Any], now: float) -> dict[str, float]:
    """Broker address -> the longest time (seconds) a send relayed on one of its connections has
    waited for its answer with nothing at all read back from the broker on that connection since.

    Called a few times a second (the worker's sweep); a send's age counts from the sweep that first
    saw it waiting (the in-flight table is not asked for times), so it is under-estimated by at most
    one sweep period.  Long-polled pulls and other requests a broker may hold are not counted.

    Only the sessions with a request in flight are looked at: ``compress`` picks them by their
    in-flight table's truth (None, or no request: false) without a line of Python per session, so
    thousands of idle connections cost the sweep next to nothing."""
    out: dict[str, float] = {}
    for s in itertools.compress(sessions, map(_INFLIGHT, sessions)):
        inflight = s.inflight
        if s.role != "broker" or s.closed or inflight is None or not len(inflight) or not s.upstream_addr:
            continue
        oldest = next((o for o, slot in inflight.waiting(0) if slot_code(slot) in C.SEND_CODES), None)
        if oldest is None:
            s.stall_mark = None
            continue
        mark = getattr(s, "stall_mark", None)
        if mark is None or mark[0] != oldest:
            s.stall_mark = (oldest, now)
            continue
        waited = min(now - mark[1], now - s.heard[0])
        if waited > out.get(s.upstream_addr, 0.0):
            out[s.upstream_addr] = waited
    return out


# Serving a client whose broker is down -------------------------------------------------------------


class FailoverService:
    """One per worker: moves sends of clients connected to a dead broker's endpoint."""

    def __init__(
        self,
        cfg: FailoverSection,
        health: BrokerHealth,
        book: RouteBook,
        metrics: HealthMetrics | None = None,
        *,
        max_frame: int = 16 * 1024 * 1024,
        pool: Any = None,
    ) -> None:
        from rmqfast.clouds.remoting import ConnectionPool

        self.cfg = cfg
        self.health = health
        self.book = book
        self.metrics = metrics
        self.max_frame = max_frame
        self.pool = pool or ConnectionPool(cfg.probe_timeout)
        self._rr = itertools.count()
        self.moved = 0
        self.refused = 0
        self.stopping = False  # the worker drains: connections close once nothing is in flight
        #: a connection without requests for this long is closed (the client reconnects when it needs to;
        #: a client that only waits, a consumer, then learns at once that its broker is still away)
        self.idle_close = 1.0
        #: [acl] with unsigned = "deny" (set by the worker, and on reload): the sends served here never pass
        #: the relay's filter chain, so the allowlist's refusal of unsigned sends is made here too (signed
        #: sends are never moved at all)
        self.acl_denies_unsigned = False
        #: [gray] (set by the worker, and on reload): ``place(cmd, broker_name, write_queues, peer_ip)``, the
        #: moved send with the queue id of its gray or normal share on that broker (rmqfast.gray.filter)
        self.place: Callable[[RemotingCommand, str, int, str], RemotingCommand] | None = None
        #: [limits] (set by the worker, and on reload): its rmqfast.limits.worker.WorkerLimits; a moved send
        #: takes tokens from the shared buckets like a relayed one
        self.limits: Any = None
        #: [delay] (set by the worker, and on reload): its rmqfast.delay.service.DelayService; a moved send that
        #: asks for proxy-held delay is held for the live master it would have gone to
        self.delay: Any = None
        #: [clouds] / [replicate] (set by the worker, and on reload): its rmqfast.replicate.ReplicateFilter; a
        #: moved send is copied to the remote clouds its topic and tag select, released when a broker stores it
        self.replicate: Any = None
        #: policy.message_addresses = "all" (set by the worker, and on reload): the answer of a moved send
        #: never passes the relay's scanner, so the offset ids in its msgId are mapped to proxy endpoints
        #: here (rmqfast.proxy.addresses.RewriteMessageAddresses.map_offset_ids; None: left as they are)
        self.offset_ids: Callable[[str], str | None] | None = None

    # One send -----------------------------------------------------------------------------------

    def move(self, cmd: RemotingCommand, dead_addr: str, peer: str = "", *, relayed: bool = False,
             nbytes: int = 0) -> tuple[RemotingCommand, str]:
        """Send ``cmd`` (a send aimed at the dead broker ``dead_addr``, from client IP ``peer``) elsewhere.

        ``relayed``: a send in flight resent (it passed the relay's filter chain, limits and delay
        included, when the client sent it); else the send limits and proxy-held delay apply here.
        ``nbytes``: the size of the client's frame (what the relay's limiter charges; 0: re-encoded).

        Returns (the answer to give the client, with its opaque; a label for logs/metrics:
        the broker that stored it, ``held`` / ``shaped`` (the proxy took it), or ``refused:<reason>``).
        """
        info = send_info(cmd)
        assert info is not None
        if "AccessKey" in (cmd.ext_fields or {}):  # ACL (rmqfast.proxy.acl): a move would void the signature
            return self._refuse(cmd, dead_addr, "signed", f"rmqfast: broker {dead_addr} is unreachable and this "
                                "signed send (AccessKey) is not moved to another broker: its signature covers the "
                                "broker name and queue id a move changes; retry (on another broker)")
        if self.acl_denies_unsigned:  # [acl] unsigned = "deny": the relay's allowlist refuses this send
            return self._refuse(cmd, dead_addr, "unsigned", "rmqfast: unsigned request (no AccessKey) refused by the "
                                "proxy's topic allowlist; sign requests, or set acl.unsigned = \"allow\"",
                                code=C.NO_PERMISSION)
        reason = ordered_reason(info, self.cfg)
        if reason is not None:
            return self._refuse(cmd, dead_addr, "ordered", f"rmqfast: broker {dead_addr} is unreachable and this "
                                f"send is not moved to another broker because {reason}; retry later")
        route = self.book.get(info.topic)
        if route is None:
            return self._refuse(cmd, dead_addr, "no_route",
                                f"rmqfast: broker {dead_addr} is unreachable and no route of topic {info.topic} "
                                "is known to move the send; retry later")
        dead_name = info.broker_name or self.book.broker_name_of(dead_addr)
        cands = candidates(route, self.health.down(), dead_name, dead_addr)
        if not cands:
            return self._refuse(cmd, dead_addr, "no_live_master",
                                f"rmqfast: broker {dead_addr} is unreachable and no other live master holds "
                                f"topic {info.topic}; retry later")
        start = next(self._rr)
        if not relayed and (self.limits is not None or self.delay is not None):
            taken = self._policy(cmd, info, cands[start % len(cands)], dead_addr, peer, nbytes)
            if taken is not None:
                return taken
        seqs: list[int] = []
        if not relayed and self.replicate is not None:
            from rmqfast.spill.commit import SpillFull

            try:
                seqs = self.replicate.take_send(cmd, cmd.is_oneway)
            except SpillFull as exc:
                return self._refuse(cmd, dead_addr, "spill_full", str(exc), code=C.SYSTEM_BUSY)
        result = self._try(cmd, info, cands, start, dead_addr, peer)
        if seqs and not cmd.is_oneway:  # a oneway send's copies were released when taken
            from rmqfast.spill.commit import CommitFailed

            try:
                self.replicate.settle(seqs, result[0].code)
            except CommitFailed as exc:
                return make_response(cmd, C.SYSTEM_ERROR, f"rmqfast: the cross-cloud copy could not be stored "
                                     f"({exc}); retry"), "refused:copy_not_synced"
        return result

    def _try(self, cmd: RemotingCommand, info: SendInfo, cands: list[tuple[str, str, int]], start: int,
             dead_addr: str, peer: str) -> tuple[RemotingCommand, str]:
        """Send to the candidates from ``start`` on until one stores it; see :meth:`move`."""
        last: RemotingCommand | None = None
        errors = []
        for k in range(len(cands)):
            name, addr, nq = cands[(start + k) % len(cands)]
            out = retarget(cmd, info, name, nq)
            if self.place is not None:
                out = self.place(out, name, nq, peer)
            try:
                answer = self._request(addr, out)
            except Exception as exc:  # RemoteError: connect refused, closed, no answer in time
                errors.append(f"{addr}: {exc}")
                if not local_shortage(exc):  # out of descriptors ourselves: nothing to suspect the broker of
                    self.health.suspect(addr, f"a moved send failed: {exc}")
                continue
            if answer.code in TRY_NEXT_CODES:
                last = answer
                errors.append(f"{addr}: code {answer.code}")
                continue
            self.moved += 1
            if self.metrics is not None:
                self.metrics.failovers.labels(dead_addr, addr).inc()
            fields = answer.ext_fields or {}
            if self.offset_ids is not None and fields.get("msgId"):
                mapped = self.offset_ids(fields["msgId"])
                if mapped is not None:
                    answer = replace(answer, ext_fields={**fields, "msgId": mapped})
            return replace(answer, opaque=cmd.opaque), addr
        if last is not None:
            return replace(last, opaque=cmd.opaque), "refused:other_broker_error"
        return self._refuse(cmd, dead_addr, "other_broker_unreachable",
                            f"rmqfast: broker {dead_addr} is unreachable and moving the send failed "
                            f"({'; '.join(errors)}); retry later")

    def _policy(self, cmd: RemotingCommand, info: SendInfo, target: tuple[str, str, int], dead_addr: str, peer: str,
                nbytes: int) -> tuple[RemotingCommand, str] | None:
        """``[limits]`` and ``[delay]`` for a send about to be moved to ``target`` (name, address, write
        queues), in the relay chain's order: the limit first (a refused send is not held), then the
        hold.  The answer when the proxy answers the send itself; None: move it."""
        name, addr, nq = target
        out = retarget(cmd, info, name, nq)
        if self.place is not None:
            out = self.place(out, name, nq, peer)
        limits = self.limits
        if limits is not None:
            lim = limits.limiter_for()
            if lim.active:
                tag = parse_properties(info.properties).get("TAGS") if info.properties else None
                msgs = _messages(cmd)
                index = lim.admit(info.topic.encode(), tag.encode() if tag is not None else None, msgs,
                                  nbytes or len(encode(cmd)))
                if index >= 0:
                    return self._taken(cmd, self._over_limit(out, index, addr), dead_addr, "shaped"
                                       if limits.is_shape(index) else "send_limit")
        delay = self.delay
        if delay is not None and delay.cfg.covers(info.topic):
            v = delay.hold(_Upstream(addr), Frame(encode(out), out.code, out.flag, out.opaque), out)
            if v is not None:
                return self._taken(cmd, v, dead_addr, "held")
        return None

    def _over_limit(self, out: RemotingCommand, index: int, addr: str) -> Verdict:
        return self.limits.answer(Frame(encode(out), out.code, out.flag, out.opaque, index), index, addr, out)

    def _taken(self, cmd: RemotingCommand, v: Verdict, dead_addr: str, what: str) -> tuple[RemotingCommand, str]:
        """The answer of a moved send the proxy answered itself (limit, shaping, hold): verdict ``v``."""
        if v.kind is Kind.REPLY:
            answer = replace(decode_frame(v.data), opaque=cmd.opaque)
        elif cmd.is_oneway:  # taken (or dropped) without an answer: none is written for a oneway send
            return make_response(cmd, C.SUCCESS, f"rmqfast: {v.reason}"), what
        else:  # a send the filter could not read
            answer = make_response(cmd, C.SYSTEM_BUSY, f"rmqfast: {v.reason}")
        if answer.code != C.SUCCESS:
            self.refused += 1
            if self.metrics is not None:
                self.metrics.failover_refused.labels(dead_addr, what).inc()
            return answer, f"refused:{what}"
        return answer, what

    def _request(self, addr: str, cmd: RemotingCommand) -> RemotingCommand:
        conn = self.pool.get(addr)
        return conn.request_command(cmd, timeout=self.cfg.send_timeout)  # type: ignore[no-any-return]

    def _refuse(self, cmd: RemotingCommand, dead_addr: str, reason: str, remark: str,
                code: int = SERVICE_NOT_AVAILABLE) -> tuple[RemotingCommand, str]:
        self.refused += 1
        if self.metrics is not None:
            self.metrics.failover_refused.labels(dead_addr, reason).inc()
        resp = make_response(cmd, code, remark,
                             ext_fields={"MSG_REGION": "DefaultRegion", "TRACE_ON": "false"})
        return resp, f"refused:{reason}"

    # A whole connection -------------------------------------------------------------------------

    def serve(self, client: socket.socket, client_addr: str, dead_addr: str,
              on_answer: Callable[[int, int], None] | None = None) -> None:
        """Serve ``client`` while ``dead_addr`` is down; returns when it closed or the broker is back.

        ``on_answer(request_code, response_code)`` is told every answer (counters).
        """
        lock = Semaphore()
        in_flight = [0]
        done = Event()

        def write(data: bytes) -> None:
            with lock:
                client.sendall(data)

        def handle(cmd: RemotingCommand, size: int) -> None:
            try:
                if cmd.code in C.SEND_CODES and send_info(cmd) is not None:
                    if self.place is None:
                        answer, to = self.move(cmd, dead_addr, nbytes=size)
                    else:  # [gray] markers may name client networks
                        answer, to = self.move(cmd, dead_addr, client_addr.rpartition(":")[0].strip("[]"),
                                               nbytes=size)
                    log.debug("send moved", extra=ctx(broker=dead_addr, to=to, client=client_addr))
                else:
                    remark = f"rmqfast: upstream unreachable ({dead_addr}: broker seen dead); retry later"
                    answer = make_response(cmd, C.SYSTEM_ERROR, remark)
                if on_answer is not None:
                    on_answer(cmd.code, answer.code)
                if not cmd.is_oneway:
                    write(encode(answer))
            except (OSError, RemotingError, ValueError) as exc:
                log.info("failover answer not written", extra=ctx(client=client_addr, error=str(exc)))
            finally:
                in_flight[0] -= 1
                done.set()

        log.info("serving a client of a dead broker: sends are moved", extra=ctx(broker=dead_addr, client=client_addr))
        client.settimeout(None)
        last = [time.monotonic()]  # when the last request arrived
        reader = gevent.spawn(self._read_loop, client, in_flight, done, handle, last)
        try:
            while not reader.dead:
                if in_flight[0] == 0:
                    why = ("draining" if self.stopping else "broker is back" if not self.health.is_down(dead_addr)
                           else "idle" if time.monotonic() - last[0] > self.idle_close else "")
                    if why:
                        log.info("closing a failover connection", extra=ctx(broker=dead_addr, client=client_addr,
                                                                            why=why))
                        break
                gevent.wait([reader], timeout=self.cfg.probe_interval_down)
        finally:
            reader.kill(block=True, timeout=1)
            deadline = time.monotonic() + self.cfg.send_timeout + 1
            while in_flight[0] > 0 and time.monotonic() < deadline:
                done.clear()
                done.wait(timeout=0.1)
            try:
                client.close()
            except OSError:
                pass

    def _read_loop(self, client: socket.socket, in_flight: list[int], done: Any,
                   handle: Callable[[RemotingCommand, int], None], last: list[float]) -> None:
        buf = bytearray()
        held = [0]  # bytes of the requests being handled

        def sized(cmd: RemotingCommand, size: int) -> None:
            try:
                handle(cmd, size + 4)  # the whole frame, as the relay's limiter charges it
            finally:
                held[0] -= size
                done.set()

        try:
            while True:
                chunk = client.recv(65536)
                if not chunk:
                    return
                buf += chunk
                while len(buf) >= 4:
                    (n,) = _I32.unpack_from(buf, 0)
                    if n < 4 or n > self.max_frame:
                        log.warning("protocol error on a failover connection; closing",
                                    extra=ctx(frame_length=n))
                        return
                    if len(buf) < 4 + n:
                        break
                    frame = bytes(buf[: 4 + n])
                    del buf[: 4 + n]
                    cmd = decode_frame(frame)
                    if cmd.is_response:
                        continue  # answers to broker-to-client requests: no broker to give them to
                    # a client pipelining without end waits here (count and bytes: 1024 max-size frames
                    # would be gigabytes)
                    while in_flight[0] >= MAX_IN_FLIGHT or (in_flight[0] and held[0] + n > MAX_IN_FLIGHT_BYTES):
                        done.clear()
                        done.wait(timeout=0.1)
                    in_flight[0] += 1
                    held[0] += n
                    last[0] = time.monotonic()
                    done.clear()
                    gevent.spawn(sized, cmd, n)
        except (OSError, ValueError) as exc:
            log.info("failover connection ended", extra=ctx(error=str(exc)))


"""Sending copies to one remote cluster as a producer, in order per message queue.

Route: ``GET_ROUTEINFO_BY_TOPIC`` (105) at the remote name servers (cached; refreshed on
errors and every ``route_ttl`` seconds); a topic the remote does not know is sent through
the ``TBW102`` route with ``defaultTopic`` set, like the Java client does, so a broker with
``autoCreateTopicEnable`` creates it.

Queue: the writable queues of the route, sorted by (broker name, queue id) as the Java client
sorts them; the copy goes to queue ``original_queue_id mod count``, so every message of one
original queue (one sharding key of an ordered producer) lands in one remote queue.

Lanes: one per *source* queue (topic, A's broker name, A's queue id), whatever the route says
and whether or not there is a route at all: the remote queue is chosen when a copy is sent, not
when it is submitted.  One greenlet per lane sends one copy at a time and waits for its answer
before the next, so the copies of one source queue are stored in B in the order they were
submitted, retries, a remote outage and a missing route included.  (Lanes used to be keyed by
the remote queue, with copies submitted while B had no route parked in a lane of their own;
after B came back both lanes sent at once and B stored later copies of a key before earlier
ones.)  A lane keeps the remote queue it chose while that broker stays a master of the route.

Request: ``SEND_MESSAGE_V2`` (310), or ``SEND_BATCH_MESSAGE`` (320) for batches, to the master
of the chosen queue's broker, header fields ``a``..``n`` of ``SendMessageRequestHeaderV2``.
The body, flag, system flag (compression), born timestamp and every property (``UNIQ_KEY``
too) are the producer's; the property ``RMQFAST_ORIGIN=<local cloud>`` is added (to every
message of a batch) so that no rmqfast copies it back.

Answers SUCCESS, FLUSH_DISK_TIMEOUT (10), FLUSH_SLAVE_TIMEOUT (12) and SLAVE_NOT_AVAILABLE
(11) mean the message is stored (as for the Java client).  MESSAGE_ILLEGAL (13) and a batch
body that cannot be re-encoded can never succeed: the copy is given up and counted
(``rmqfast_deliver_failures_total``).  Everything else (connection errors, SYSTEM_BUSY,
TOPIC_NOT_EXIST while the topic is created, unexpected errors...) is retried with exponential
backoff from ``retry_initial`` to ``retry_max``, forever: a remote that is away makes the backlog
grow, it does not lose copies.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gevent
from gevent.event import Event

from rmqfast.clouds.remoting import ConnectionPool, RemoteError, fetch_route
from rmqfast.clouds.send import PERMANENT_CODES, STORED_CODES, build_request
from rmqfast.errors import BodyError
from rmqfast.log import ctx
from rmqfast.spill.record import CopyRecord

log = logging.getLogger("rmqfast.deliver")

QUERY_MESSAGE = 12
QUERY_NOT_FOUND = 22


@dataclass
class Item:
    seq: int
    record: CopyRecord
    raw: bytes
    done: Callable[[int, int], None]  # (seq, status)
    alive: Callable[[], bool]
    attempts: int = 0
    #: it may already be stored in B (sent before a crash, or a send whose answer was lost):
    #: B is asked for its UNIQ_KEY before it is sent (again)
    maybe_stored: bool = False


def uniq_key(properties: str) -> str | None:
    """The ``UNIQ_KEY`` of a properties string (None: none)."""
    i = properties.find("UNIQ_KEY\x01")
    if i < 0 or (i > 0 and properties[i - 1] != "\x02"):
        return None
    i += 9
    j = properties.find("\x02", i)
    return properties[i:] if j < 0 else properties[i:j]


@dataclass
class _Route:
    masters: dict[str, str]
    queues: list[tuple[str, int]]
    fetched: float
    via_default: bool = False


@dataclass
class _Lane:
    items: deque[Item] = field(default_factory=deque)
    wake: Event = field(default_factory=Event)
    greenlet: Any = None
    dest: tuple[str, int] | None = None  # the remote (broker name, queue id) it sends to


def lane_key(rec: CopyRecord) -> tuple[str, str, int]:
    """The unit of order: the source queue (topic, A's broker name, A's queue id) of a copy."""
    return rec.topic, rec.broker_name, rec.queue_id


class RemoteSender:
    def __init__(
        self,
        name: str,
        namesrvs: list[str],
        origin: str,
        *,
        retry_initial: float = 0.1,
        retry_max: float = 5.0,
        timeout: float = 3.0,
        route_ttl: float = 30.0,
        metrics: Any = None,
        on_status: Callable[[str, bool, str], None] | None = None,
        credentials: tuple[str, str] | None = None,
    ) -> None:
        self.name = name
        self.namesrvs = namesrvs
        self.origin = origin
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.timeout = timeout
        self.route_ttl = route_ttl
        self.metrics = metrics
        self.on_status = on_status
        self.pool = ConnectionPool(timeout, credentials)  # signed for a remote with ACL on
        self.routes: dict[str, _Route] = {}
        self.lanes: dict[tuple[str, str, int], _Lane] = {}
        self.up = True
        self.delivered = 0
        self.retries = 0
        self.failures = 0
        self.skipped = 0  # copies found already stored in B (not sent again)

    # Routing --------------------------------------------------------------------------------

    def route(self, topic: str, *, force: bool = False) -> _Route:
        r = self.routes.get(topic)
        if r is not None and not force and time.monotonic() - r.fetched < self.route_ttl:
            return r
        got = fetch_route(self.pool, self.namesrvs, topic, timeout=self.timeout)
        via_default = False
        if got is None:
            got = fetch_route(self.pool, self.namesrvs, "TBW102", timeout=self.timeout)
            via_default = True
            if got is None:
                raise RemoteError(
                    f"remote {self.name} knows neither topic {topic} nor TBW102 (auto-creation is off): "
                    f"create {topic} in {self.name}"
                )
        masters, qdatas = got
        queues = sorted(
            (bname, qid)
            for bname, n, perm in qdatas
            if perm & 2 and bname in masters
            for qid in range(min(n, 4) if via_default else n)
        )
        if not queues:
            raise RemoteError(f"remote {self.name} has no writable queue for {topic}")
        r = _Route(masters, queues, time.monotonic(), via_default)
        self.routes[topic] = r
        return r

    def target(self, rec: CopyRecord) -> tuple[str, int]:
        qs = self.route(rec.topic).queues
        return qs[rec.queue_id % len(qs)]

    # Lanes ----------------------------------------------------------------------------------

    def submit(self, item: Item) -> None:
        """Queue a copy behind the earlier copies of its source queue (no network here: the
        remote queue is chosen when it is sent, so a missing route cannot split a lane)."""
        key = lane_key(item.record)
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = _Lane()
            lane.greenlet = gevent.spawn(self._lane_loop, key, lane)
        lane.items.append(item)
        lane.wake.set()

    def backlog(self) -> int:
        return sum(len(x.items) for x in self.lanes.values())

    def _lane_loop(self, key: tuple[str, str, int], lane: _Lane) -> None:
        while True:
            if not lane.items:
                lane.wake.clear()
                lane.wake.wait()
                continue
            item = lane.items[0]
            if not item.alive():  # the worker that sent it went away; it sends again
                lane.items.popleft()
                continue
            status = self._send_until_done(item, lane)
            lane.items.popleft()
            item.done(item.seq, status)

    def _send_until_done(self, item: Item, lane: _Lane) -> int:
        delay = self.retry_initial
        rec = item.record
        while True:
            try:
                bname, qid = self._destination(rec, lane)
                addr = self.route(rec.topic).masters[bname]
                if item.maybe_stored and self._already_stored(rec, addr):
                    return 0
                item.maybe_stored = False
                code, ext, body = build_request(rec, bname, qid, self.origin)
                item.maybe_stored = True  # until the answer says otherwise: it may be stored unanswered
                resp = self.pool.request(addr, code, ext, body, timeout=self.timeout)
                item.maybe_stored = False
                done, err = self._answered(rec, addr, resp)
                if done is not None:
                    return done
            except RemoteError as exc:
                err = str(exc)
                self.routes.pop(rec.topic, None)
                self._set_up(False, err)
            except BodyError as exc:  # a batch body we cannot re-encode: it can never be sent
                self._give_up(rec, "unencodable", "cannot encode a copy; giving it up", error=str(exc))
                return 1
            except Exception as exc:  # anything else (a route that changed under us...): retry, never lose
                err = f"{type(exc).__name__}: {exc}"
                self.routes.pop(rec.topic, None)
                log.exception("unexpected error sending a copy; retrying", extra=ctx(remote=self.name,
                                                                                    topic=rec.topic))
            self._retrying(item, err, delay)
            gevent.sleep(delay)
            delay = min(self.retry_max, delay * 2)
            if not item.alive():
                return 1  # the worker will send it again; nothing to acknowledge

    def _already_stored(self, rec: CopyRecord, addr: str) -> bool:
        """Whether the broker ``addr`` already holds this copy, by its ``UNIQ_KEY`` (QUERY_MESSAGE,
        12, with ``_UNIQUE_KEY_QUERY``): a copy that may have been stored without an answer is not
        stored twice.  A batch or a copy without UNIQ_KEY cannot be looked up: False (sent again,
        at least once).  RemoteError when B cannot answer (the caller retries)."""
        key = None if rec.is_batch else uniq_key(rec.properties)
        if key is None:
            return False
        ext = {"topic": rec.topic, "key": key, "maxNum": "32", "beginTimestamp": "0",
               "endTimestamp": str(2**63 - 1), "_UNIQUE_KEY_QUERY": "true"}
        resp = self.pool.request(addr, QUERY_MESSAGE, ext, b"", timeout=self.timeout)
        if resp.code == QUERY_NOT_FOUND:
            return False
        if resp.code != 0:
            raise RemoteError(f"{addr} answered code {resp.code} to the look-up of a copy by UNIQ_KEY: {resp.remark}")
        self.skipped += 1
        self._set_up(True, "")
        log.info("copy already stored in the remote; not sent again", extra=ctx(remote=self.name, topic=rec.topic,
                                                                               uniq_key=key))
        if self.metrics is not None:
            self.metrics.already_stored(self.name)
        return True

    def _destination(self, rec: CopyRecord, lane: _Lane) -> tuple[str, int]:
        """(broker name, queue id) a copy goes to: the lane's remote queue while that broker is a
        master of the topic's route, else the target the route gives (kept for the next ones)."""
        route = self.route(rec.topic)  # RemoteError when there is none: the caller retries
        if lane.dest is None or lane.dest[0] not in route.masters:
            lane.dest = self.target(rec)
        return lane.dest

    def _answered(self, rec: CopyRecord, addr: str, resp: Any) -> tuple[int | None, str]:
        """The remote's answer: (0, "") stored, (1, "") refused for good, (None, error) retry."""
        if resp.code in STORED_CODES:
            self._set_up(True, "")
            self.delivered += 1
            if self.metrics is not None:
                self.metrics.delivered(self.name, rec)
            return 0, ""
        if resp.code in PERMANENT_CODES:
            self._give_up(rec, f"code_{resp.code}", "remote refused a copy for good; giving it up",
                          code=resp.code, remark=resp.remark)
            return 1, ""
        if resp.code == 17:
            self.routes.pop(rec.topic, None)
        return None, f"{addr} answered code {resp.code}: {resp.remark}"

    def _give_up(self, rec: CopyRecord, reason: str, message: str, **fields: Any) -> None:
        self.failures += 1
        log.error(message, extra=ctx(remote=self.name, topic=rec.topic, **fields))
        if self.metrics is not None:
            self.metrics.failed(self.name, reason)

    def _retrying(self, item: Item, err: str, delay: float) -> None:
        item.attempts += 1
        self.retries += 1
        if self.metrics is not None:
            self.metrics.retried(self.name)
        if item.attempts in (1, 10) or item.attempts % 100 == 0:
            log.warning(
                "remote send failed; retrying",
                extra=ctx(remote=self.name, topic=item.record.topic, attempt=item.attempts, error=err,
                          retry_in_s=round(delay, 3)),
            )

    def _set_up(self, up: bool, error: str) -> None:
        if up != self.up:
            self.up = up
            log.warning("remote cloud is " + ("reachable again" if up else "unreachable"),
                        extra=ctx(remote=self.name, error=error))
            if self.on_status is not None:
                self.on_status(self.name, up, error)

    def close(self) -> None:
        for lane in self.lanes.values():
            if lane.greenlet is not None:
                lane.greenlet.kill(block=False)
        self.pool.close()

"""Sending copies to one remote cluster as a producer, in order per message queue.

Route: ``GET_ROUTEINFO_BY_TOPIC`` (105) at the remote name servers (cached; refreshed on
errors and every ``route_ttl`` seconds); a topic the remote does not know is sent through
the ``TBW102`` route with ``defaultTopic`` set, like the Java client does, so a broker with
``autoCreateTopicEnable`` creates it.

Queue: the writable queues of the route, sorted by (broker name, queue id) as the Java client
sorts them; the copy goes to queue ``original_queue_id mod count``, so every message of one
original queue (one sharding key of an ordered producer) lands in one remote queue.  Each
remote queue is a lane served by one greenlet that sends one copy at a time and waits for its
answer: order per queue is kept, retries included.

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

@dataclass
class Item:
    seq: int
    record: CopyRecord
    raw: bytes
    done: Callable[[int, int], None]  # (seq, status)
    alive: Callable[[], bool]
    attempts: int = 0


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
        try:
            bname, qid = self.target(item.record)
        except Exception as exc:
            # No route yet (remote away): park in a lane of its own; it re-routes when sending.
            self._set_up(False, str(exc))
            bname, qid = "", -1
        key = (item.record.topic, bname, qid)
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
            status = self._send_until_done(item, key)
            lane.items.popleft()
            item.done(item.seq, status)

    def _send_until_done(self, item: Item, key: tuple[str, str, int]) -> int:
        delay = self.retry_initial
        rec = item.record
        while True:
            try:
                bname, qid = self._destination(rec, key)
                addr = self.route(rec.topic).masters[bname]
                code, ext, body = build_request(rec, bname, qid, self.origin)
                resp = self.pool.request(addr, code, ext, body, timeout=self.timeout)
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

    def _destination(self, rec: CopyRecord, key: tuple[str, str, int]) -> tuple[str, int]:
        """(broker name, queue id) a copy goes to: its lane's queue while that broker is a master
        of the topic's route, else the target the route gives."""
        if key[2] < 0:
            return self.target(rec)
        if key[1] not in self.route(rec.topic).masters:
            return self.target(rec)
        return key[1], key[2]

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

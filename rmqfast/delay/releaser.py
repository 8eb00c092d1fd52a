"""The delay releaser: seeks the due-time keys from its cursor and queues what is due, in due-time
order, into the lanes of the broker the producer's connection went to
(:mod:`rmqfast.delay.lanes` sends them).  A broker that does not take its releases gets its due
messages moved to its wait range, read from there once it takes releases again, so the other
brokers' releases are not held up behind it.
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

import gevent
from gevent.event import Event

from rmqfast.clouds.remoting import ConnectionPool
from rmqfast.delay.lanes import Item, ReleaseLanes, now_ms
from rmqfast.delay.store import DUE_PREFIX, Held, due_key, parked_key, parked_prefix, split_due_key
from rmqfast.log import ctx

if TYPE_CHECKING:
    from rmqfast.delay.channel import ReleaseChannel
    from rmqfast.delay.service import DelayService

log = logging.getLogger("rmqfast.delay")

#: Held messages are read this long before they fall due (decoded and queued in their lane), so
#: that at the due time only the write to the broker is left.
READ_AHEAD_MS = 20
class Releaser(ReleaseLanes):
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
                held = self._take(k, v)
                if held is None:
                    continue
                self._queue(k, v, held)
                took = True
        return took

    def _take(self, k: bytes, v: bytes) -> Held | None:
        """A read message to dispatch once: None when it is dispatched already, or undecodable (then
        given up, counted and logged)."""
        if k in self.dispatched:
            return None
        self.dispatched.add(k)
        try:
            return Held.decode(v)
        except Exception as exc:
            log.error("undecodable held message; giving it up", extra=ctx(error=str(exc)))
            self._done(k, v, None, "undecodable")
            return None

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
            held = self._take(k, v)
            if held is None:
                continue
            if held_for.get(held.addr, 0) >= per or parked is not None and parked.get(parked_prefix(held.addr)):
                self._park(k, v, held)  # its broker is at its share, or older ones of it wait already
            else:
                self._queue(k, v, held)
        self.cursor = last + b"\x00"
        if len(items) >= limit:
            self.read_upto = self.cursor

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


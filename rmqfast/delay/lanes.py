"""The lanes of the delay releaser: one per broker, topic and queue, each sending one message at a
time (pipelined over the broker's release channel) so that the order of due times holds in every
queue, and what becomes of a release: stored (deleted here), refused for good (dropped), a topic
that stays missing (dead letter), or possibly sent before a crash (the broker is asked first).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import gevent

from rmqfast.clouds.remoting import RemoteError
from rmqfast.clouds.send import STORED_CODES, send_until_stored
from rmqfast.delay.channel import ReleaseChannel, Sent
from rmqfast.delay.store import Held, parked_prefix, split_due_key
from rmqfast.log import ctx

log = logging.getLogger("rmqfast.delay")

#: A release the broker answers TOPIC_NOT_EXIST this many times in a row (back-off between
#: attempts: [replicate] retry_initial .. retry_max) is kept as a dead letter instead.
MISSING_TOPIC_ATTEMPTS = 20
DEAD_LETTER = "dead_letter"
#: A message queued for release: due key, stored value, the decoded message, due time (epoch ms).
Item = tuple[bytes, bytes, Held, int]


def now_ms() -> int:
    return int(time.time() * 1000)


class ReleaseLanes:
    """The sending half of :class:`rmqfast.delay.releaser.Releaser` (a mixin: the releaser's state
    lives in its instance)."""

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


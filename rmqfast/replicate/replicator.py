"""The worker side of cross-cloud delivery: lanes, the in-memory channel, the spill, the feeder.

Every copy belongs to a lane, one per (remote, topic).  A lane holds, in sequence order:

* ``mem``: copies in memory (fast mode: not in RocksDB; durable mode: in RocksDB too, cached);
* then, when ``spilled``, copies that are only in RocksDB, read back in key order.

Fast mode: a copy goes to memory while the channel (``replicate.channel_size`` copies, counted
across lanes, in-flight ones included) has room and its remote is up; otherwise it is written
to RocksDB unsynced and its lane becomes *spilled*: every later copy of the lane goes to RocksDB
too, until the lane's RocksDB part is fully acknowledged.  So memory copies are always older
than spilled ones and the lane's order holds.  A crash loses at most the channel's content:
that bound is the ``rmqfast_replicate_max_loss_messages`` gauge.

Durable mode: every copy is group-committed (synced) before the producer's request is
forwarded, so ``kill -9`` of any process loses no copy of an acknowledged send; memory only
caches it.

Acknowledged sends only: a copy is taken when the request passes (so the durable commit
precedes the producer's answer) and waits in ``awaiting`` for the local broker's response: SUCCESS
releases it, any other code cancels it (deleted, never delivered).  A copy whose answer never
comes (the producer's connection closed mid-request) is released when its session is seen
closed, or after ``AWAIT_TIMEOUT`` seconds: delivered at least once rather than lost (B may
then hold a message A did not store; after a crash the same applies to copies whose answer was
pending).

The feeder greenlet sends copies, lane heads first, over the Unix socket to the worker's deliver
process, at most ``replicate.max_in_flight`` unacknowledged; acknowledged copies are deleted.
When the link breaks every unacknowledged copy is sent again after reconnecting, in order.

A worker that starts with copies in its spill (it replaced a crashed one) says so in its hello
(``replaying``) and tells its deliver process once every copy it inherited was handed over
(``D``): meanwhile the deliver process holds the other workers' copies, so an ordered producer
that moved to another worker does not overtake its own older copies (:mod:`rmqfast.deliver.hold`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import gevent
from gevent import socket
from gevent.event import Event

from rmqfast.config import Config
from rmqfast.deliver import protocol as P
from rmqfast.log import ctx
from rmqfast.spill.commit import CommitFailed, GroupCommitter, SpillFull
from rmqfast.spill.record import created_ms_of
from rmqfast.spill.store import SHAPE_REMOTE_PREFIX, SpillStore, lane_prefix, worker_dir

log = logging.getLogger("rmqfast.replicate")

#: Seconds a copy may wait for its local broker answer before it is released anyway.
AWAIT_TIMEOUT = 30.0
#: Copies read from RocksDB per lane per pass.
READ_AHEAD = 256


@dataclass
class _Copy:
    seq: int
    value: bytes
    in_db: bool
    counted: bool = False  # counts against the in-memory channel (replicate.channel_size)


@dataclass
class Lane:
    remote: str
    topic: str
    mem: deque[_Copy] = field(default_factory=deque)
    dbbuf: deque[_Copy] = field(default_factory=deque)
    spilled: bool = False
    cursor: int = -1  # highest sequence taken from mem or read from RocksDB
    inflight: int = 0
    unsynced: int = 0  # deferred durable copies only in RocksDB whose commit is not done yet

    def append_mem(self, c: _Copy) -> None:
        if self.mem and self.mem[-1].seq > c.seq:  # woken out of order after a group commit
            i = len(self.mem)
            while i > 0 and self.mem[i - 1].seq > c.seq:
                i -= 1
            self.mem.insert(i, c)
        else:
            self.mem.append(c)


@dataclass
class _InFlight:
    lane: Lane
    copy: _Copy
    sent_at: float


class Replicator:
    def __init__(self, cfg: Config, index: int, metrics: Any = None) -> None:
        rp = cfg.replicate
        self.cfg = cfg
        self.index = index
        self.metrics = metrics
        self.durable = rp.durability == "durable"
        self.channel_size = rp.channel_size
        self.max_in_flight = rp.max_in_flight
        self.on_disk_full = rp.on_disk_full
        self.store = SpillStore(
            worker_dir(cfg.proxy.state_dir, index),
            write_buffer_bytes=rp.write_buffer_bytes,
            block_cache_bytes=rp.block_cache_bytes,
            disk_cap_bytes=rp.disk_cap_bytes,
        )
        self.committer = GroupCommitter(self.store) if self.durable else None
        self.lanes: dict[tuple[str, str], Lane] = {}
        for remote, topic in list(self.store.lanes):  # resume after a restart: all of it is in RocksDB
            if remote.startswith(SHAPE_REMOTE_PREFIX):
                continue  # peak shaving's backlog in the same spill (rmqfast.limits.shaper)
            self.lanes[(remote, topic)] = Lane(remote, topic, spilled=True)
        self.mem_count = 0  # copies in memory only (fast mode), in-flight included
        self.awaiting: dict[int, float] = {}  # seq -> deadline (monotonic)
        self.cancelled: set[int] = set()
        self.commits: dict[int, Any] = {}  # seq -> its pending group-commit batch (deferred durable takes)
        self.inflight: dict[int, _InFlight] = {}
        self.remote_up: dict[str, bool] = {r.name: True for r in cfg.clouds.remotes}
        self.deletes: list[tuple[str, str, int, int]] = []
        self.sock_path = P.socket_path(cfg.proxy.state_dir, index % rp.deliver_processes)
        self.link: socket.socket | None = None
        self.wake = Event()
        self.copied = 0
        self.not_copied: dict[str, int] = {}
        self.delivered = 0
        self.gave_up = 0
        self._greenlets: list[gevent.Greenlet] = []
        self.closed = False
        # copies inherited from a previous run (sequence <= replay_upto) are replayed before the
        # deliver process lets the other workers' newer copies pass (rmqfast.deliver.hold)
        self.replay_upto = self.store.next_seq() - 1
        self.replaying = bool(self.lanes)
        # copies up to this sequence may have reached the remote already (handed over by the
        # previous run, or before a link broke): sent as RESEND, looked up in B before sending
        self.maybe_sent_upto = self.replay_upto
        if self.store.messages:
            log.info("resuming spilled copies", extra=ctx(worker=index, messages=self.store.messages,
                                                           bytes=self.store.bytes))

    def start(self) -> None:
        self._greenlets = [gevent.spawn(self._feed_loop), gevent.spawn(self._delete_loop)]

    # The copy path (called by the filter) --------------------------------------------------------

    def lane(self, remote: str, topic: str) -> Lane:
        ln = self.lanes.get((remote, topic))
        if ln is None:
            ln = self.lanes[(remote, topic)] = Lane(remote, topic)
        return ln

    def count_not_copied(self, reason: str, n: int = 1) -> None:
        self.not_copied[reason] = self.not_copied.get(reason, 0) + n
        if self.metrics is not None:
            self.metrics.not_copied.labels(reason).inc(n)

    def take(self, remotes: list[str], topic: str, value: bytes, *, awaiting: bool = True,
             defer: bool = False) -> list[int]:
        """Take one copy per remote; returns the sequence numbers (the filter's tokens).

        Durable mode blocks this greenlet until the synced group commit is done, unless
        ``defer``: then the commit is only queued and :meth:`synced` must be called (and
        succeed) before the producer may see its answer.  Raises :class:`SpillFull` when the
        disk cap is hit with policy ``reject``; with ``drop`` the copy is counted as not copied
        and ``[]`` is returned.
        """
        lanes = [self.lane(r, topic) for r in remotes]
        to_db = [
            ln for ln in lanes
            if self.durable or ln.spilled or self.mem_count >= self.channel_size or not self.remote_up.get(ln.remote)
        ]
        if to_db and not self._room(sum(len(lane_prefix(ln.remote, topic)) + 8 + len(value) for ln in to_db)):
            self.count_not_copied("disk_full", len(remotes))
            return []
        seqs = [self.store.next_seq() for _ in lanes]
        deadline = time.monotonic() + AWAIT_TIMEOUT
        if awaiting:
            for s in seqs:
                self.awaiting[s] = deadline
        db_items = [(ln.remote, topic, s, value) for ln, s in zip(lanes, seqs, strict=True) if ln in to_db]
        try:
            batch = self._store(db_items, defer)
        except (CommitFailed, Exception) as exc:
            for s in seqs:
                self.awaiting.pop(s, None)
            log.error("cannot store a copy", extra=ctx(worker=self.index, topic=topic, error=str(exc)))
            self.count_not_copied("spill_error", len(remotes))
            if self.durable:
                raise SpillFull(f"rmqfast: the cross-cloud spill of worker {self.index} failed ({exc}); retry later"
                                ) from exc
            return []
        for ln, s in zip(lanes, seqs, strict=True):
            self._place(ln, s, value, ln in to_db, batch if self.durable and defer else None)
        self.copied += len(lanes)
        if self.metrics is not None:
            self.metrics.copies.inc(len(lanes))
        self.wake.set()
        return seqs

    def _room(self, need: int) -> bool:
        """Whether ``need`` more bytes fit in the spill; over the cap with policy ``reject``:
        :class:`SpillFull`."""
        if not self.store.would_exceed(need):
            return True
        if self.on_disk_full == "reject":
            if self.metrics is not None:
                self.metrics.rejected.inc()
            raise SpillFull(
                f"rmqfast: the cross-cloud spill of worker {self.index} is full "
                f"({self.store.bytes} of {self.store.disk_cap_bytes} bytes, replicate.disk_cap_bytes); "
                "retry later"
            )
        return False

    def _store(self, db_items: list[tuple[str, str, int, bytes]], defer: bool) -> Any:
        """Write the copies that go to RocksDB: synced now, queued for a group commit (``defer``:
        the commit batch is returned), or unsynced (not durable)."""
        if self.durable and defer:
            assert self.committer is not None
            return self.committer.enqueue(db_items)
        if self.durable:
            assert self.committer is not None
            self.committer.commit_seqs(db_items)
        elif db_items:
            self.store.write(db_items, sync=False)
        return None

    def _place(self, ln: Lane, s: int, value: bytes, in_db: bool, batch: Any) -> None:
        """Where one taken copy waits for the deliverer (``batch``: its deferred commit, or None)."""
        if not in_db:
            ln.append_mem(_Copy(s, value, False, True))
            self.mem_count += 1
        elif self.durable and not ln.spilled and self.mem_count < self.channel_size:
            ln.append_mem(_Copy(s, value, True, True))  # cached; in RocksDB too
            self.mem_count += 1
            if batch is not None:
                self.commits[s] = (batch, None)
        else:
            ln.spilled = True
            if batch is not None:
                # not readable until synced: the lane must not look drained meanwhile
                ln.unsynced += 1
                self.commits[s] = (batch, ln)

    def synced(self, seqs: list[int]) -> None:
        """Wait until the deferred commit of these copies is done (durable mode, ``take(defer=True)``).

        Raises :class:`CommitFailed` if it failed: the copies are cancelled and the caller must
        not let the producer believe its send was taken care of.
        """
        batch = None
        for s in seqs:
            entry = self.commits.get(s)
            if entry is not None:
                batch = entry[0]
        if batch is None or self.committer is None:
            return
        try:
            self.committer.wait(batch)
        except CommitFailed:
            self.cancel(seqs)
            self.count_not_copied("spill_error", len(seqs))
            raise
        finally:
            self._release(seqs)

    def _release(self, seqs: list[int]) -> None:
        for s in seqs:
            entry = self.commits.pop(s, None)
            if entry is not None and entry[1] is not None:
                entry[1].unsynced -= 1

    def confirm(self, seqs: list[int]) -> None:
        """The local broker stored the message: its copies may go."""
        self._release(seqs)
        for s in seqs:
            self.awaiting.pop(s, None)
        self.wake.set()

    def cancel(self, seqs: list[int]) -> None:
        """The local broker refused the message: its copies are dropped."""
        self._release(seqs)
        for s in seqs:
            if self.awaiting.pop(s, None) is not None:
                self.cancelled.add(s)
        self.wake.set()

    # The feeder --------------------------------------------------------------------------------

    def _connect(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(self.sock_path))
            # a deliver process killed between its accept and this HELLO resets the link here: try
            # again later (an exception would end the feeder, and no copy would leave this worker)
            s.sendall(P.json_frame(P.HELLO, {"worker": self.index, "pid": os.getpid(), "replaying": self.replaying}))
        except OSError:
            s.close()
            return False
        self.link = s
        gevent.spawn(self._read_loop, s)
        log.info("connected to the deliver process", extra=ctx(worker=self.index, socket=str(self.sock_path)))
        return True

    def _read_loop(self, s: socket.socket) -> None:
        reader = P.FrameReader()
        try:
            while True:
                data = s.recv(65536)
                if not data:
                    break
                for kind, payload in reader.feed(data):
                    if kind == P.ACK:
                        seq, status = P.parse_ack(memoryview(payload))
                        self._on_ack(seq, status)
                    elif kind == P.STATUS:
                        st = json.loads(payload)
                        self.remote_up[str(st.get("remote"))] = bool(st.get("up"))
        except (OSError, ValueError) as exc:
            log.warning("deliver link failed", extra=ctx(worker=self.index, error=str(exc)))
        finally:
            if self.link is s:
                self._link_lost()
            try:
                s.close()
            except OSError:
                pass

    def _link_lost(self) -> None:
        """Everything unacknowledged goes back to its lane, to be sent again in order."""
        self.link = None
        for r in self.remote_up:
            self.remote_up[r] = True
        back: dict[tuple[str, str], list[_Copy]] = {}
        if self.inflight:
            self.maybe_sent_upto = max(self.maybe_sent_upto, max(self.inflight))
        for f in self.inflight.values():
            back.setdefault((f.lane.remote, f.lane.topic), []).append(f.copy)
            f.lane.inflight -= 1
        self.inflight.clear()
        for key, ln in self.lanes.items():
            ln.dbbuf.clear()
            if self.durable:  # everything is in RocksDB: read the lane again from its start
                for c in ln.mem:  # a cached copy whose commit is still running is not readable yet
                    entry = self.commits.get(c.seq)
                    if entry is not None and entry[1] is None:
                        self.commits[c.seq] = (entry[0], ln)
                        ln.unsynced += 1
                self.mem_count -= sum(1 for c in ln.mem if c.counted)
                self.mem_count -= sum(1 for c in back.get(key, []) if c.counted)
                ln.mem.clear()
                ln.spilled = True
                ln.cursor = -1
                continue
            copies = sorted((c for c in back.get(key, []) if not c.in_db), key=lambda c: c.seq)
            for c in reversed(copies):
                ln.mem.appendleft(c)
            if ln.spilled:
                ln.cursor = -1
            elif ln.mem:
                ln.cursor = ln.mem[0].seq - 1
        log.warning("deliver link lost; unacknowledged copies will be sent again",
                    extra=ctx(worker=self.index, resend=sum(len(v) for v in back.values())))

    def _on_ack(self, seq: int, status: int) -> None:
        f = self.inflight.pop(seq, None)
        if f is None:
            return
        f.lane.inflight -= 1
        if f.copy.in_db:
            self.deletes.append((f.lane.remote, f.lane.topic, seq, len(f.copy.value)))
        if f.copy.counted:
            self.mem_count -= 1
        if status == P.ACK_DELIVERED:
            self.delivered += 1
        else:
            self.gave_up += 1
        self.wake.set()

    def _delete_loop(self) -> None:
        n = 0
        while not self.closed:
            gevent.sleep(0.02)
            self.flush_deletes()
            n += 1
            if n % 250 == 0:  # forget idle lanes every 5 s
                for key, ln in list(self.lanes.items()):
                    if not (ln.mem or ln.dbbuf or ln.spilled or ln.inflight or key in self.store.lanes):
                        del self.lanes[key]

    def flush_deletes(self) -> None:
        if self.deletes:
            batch, self.deletes = self.deletes, []
            self.store.delete(batch)

    def _feed_loop(self) -> None:
        last_try = 0.0
        while not self.closed:
            self.wake.wait(timeout=0.05)
            self.wake.clear()
            if self.link is None:
                now = time.monotonic()
                if now - last_try < 0.5:
                    continue
                last_try = now
                if not self._connect():
                    continue
            try:
                self.pump()
                if self.replaying:
                    self._check_replayed()
            except Exception as exc:  # the feeder must never die: log, drop the link, start over
                if not isinstance(exc, OSError):
                    log.exception("feeder failed; resetting the deliver link", extra=ctx(worker=self.index))
                log.warning("cannot hand copies to the deliver process", extra=ctx(worker=self.index, error=str(exc)))
                link, self.link = self.link, None
                if link is not None:
                    link.close()
                    self._link_lost()

    def _head(self, ln: Lane, now: float) -> tuple[_Copy | None, bool]:
        """(next copy of the lane, blocked): skips cancelled copies, stops at one awaiting its answer."""
        while True:
            if ln.mem:
                q, from_mem = ln.mem, True
            else:
                if not ln.dbbuf and ln.spilled:
                    got = self.store.read_lane(ln.remote, ln.topic, ln.cursor, READ_AHEAD)
                    for s, v in got:
                        ln.dbbuf.append(_Copy(s, v, True))
                        ln.cursor = s
                    if not got:
                        # everything stored was read; in fast mode stay spilled until it is acknowledged
                        if ln.unsynced == 0 and (self.durable or (ln.remote, ln.topic) not in self.store.lanes):
                            ln.spilled = False
                q, from_mem = ln.dbbuf, False
            if not q:
                return None, False
            c = q[0]
            if c.seq in self.cancelled:
                q.popleft()
                self.cancelled.discard(c.seq)
                if c.in_db:
                    self.deletes.append((ln.remote, ln.topic, c.seq, len(c.value)))
                if c.counted:
                    self.mem_count -= 1
                if from_mem:
                    ln.cursor = max(ln.cursor, c.seq)
                continue
            deadline = self.awaiting.get(c.seq)
            if deadline is not None:
                if now < deadline:
                    return c, True
                self.awaiting.pop(c.seq, None)  # no answer in time: deliver (at least once)
            return c, False

    def pump(self) -> int:
        """Send what the window allows; returns the number of copies sent."""
        link = self.link
        if link is None:
            return 0
        now = time.monotonic()
        out: list[bytes] = []
        sent = 0
        progress = True
        while progress and len(self.inflight) < self.max_in_flight:
            progress = False
            for ln in list(self.lanes.values()):
                n = 0
                while n < 64 and len(self.inflight) < self.max_in_flight:
                    c, blocked = self._head(ln, now)
                    if c is None or blocked:
                        break
                    (ln.mem if ln.mem and ln.mem[0] is c else ln.dbbuf).popleft()
                    ln.cursor = max(ln.cursor, c.seq)
                    ln.inflight += 1
                    self.inflight[c.seq] = _InFlight(ln, c, now)
                    out.append(P.copy_frame(c.seq, ln.remote, c.value,
                                            P.RESEND if c.seq <= self.maybe_sent_upto else P.COPY))
                    n += 1
                if n:
                    progress = True
                    sent += n
        if out:
            link.sendall(b"".join(out))
        return sent

    def _check_replayed(self) -> None:
        """Tell the deliver process once every inherited copy was handed over (or dropped)."""
        link = self.link
        if link is None:
            return
        now = time.monotonic()
        for ln in list(self.lanes.values()):
            c, _blocked = self._head(ln, now)
            if c is not None and c.seq <= self.replay_upto:
                return
        link.sendall(P.frame(P.REPLAYED, b""))
        self.replaying = False
        log.info("inherited copies handed over", extra=ctx(worker=self.index, upto=self.replay_upto))

    # Stats ----------------------------------------------------------------------------------

    def backlog(self) -> dict[tuple[str, str], tuple[int, int, float | None]]:
        """(messages, bytes, oldest age in seconds) per (remote, topic), memory and spill together."""
        now_ms = time.time() * 1000
        acc: dict[tuple[str, str], list[Any]] = {}

        def add(key: tuple[str, str], n: int, b: int, created: int | None) -> None:
            a = acc.setdefault(key, [0, 0, None])
            a[0] += n
            a[1] += b
            if created is not None and (a[2] is None or created < a[2]):
                a[2] = created

        for key, st in self.store.lanes.items():
            if key[0].startswith(SHAPE_REMOTE_PREFIX):
                continue
            add(key, st.messages, st.bytes, self.store.oldest_ms(*key))
        for key, ln in self.lanes.items():
            for c in ln.mem:
                if not c.in_db:
                    add(key, 1, len(c.value), created_ms_of(c.value))
        for f in self.inflight.values():
            if not f.copy.in_db:
                add((f.lane.remote, f.lane.topic), 1, len(f.copy.value), created_ms_of(f.copy.value))
        return {
            k: (v[0], v[1], max(0.0, (now_ms - v[2]) / 1000) if v[2] is not None else None) for k, v in acc.items()
        }

    def close(self) -> None:
        self.closed = True
        for g in self._greenlets:
            g.kill(block=False)
        if self.committer is not None:
            self.committer.close()
        self.flush_deletes()
        if self.link is not None:
            self.link.close()
        self.store.close()

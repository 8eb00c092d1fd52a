"""Held delayed messages, in the worker's spill RocksDB, keyed by due time.

Keys (beside the spill's ``b"c"`` copy lanes and ``b"m"`` meta keys, one database per worker)::

    b"d" + due_ms (u64 BE) + seq (u64 BE)            -> u16 len + broker addr, u16 len + msgId,
                                                        u16 len + keys, then a CopyRecord
    b"e" + b"u" + msgId + NUL + due_ms + seq        -> b""   (cancel by msgId)
    b"e" + b"k" + key + NUL + due_ms + seq          -> b""   (cancel by key, one per KEYS entry)
    b"w" + u16 len + broker addr + due_ms + seq     -> the value of a "d" key, moved to its broker's
                                                        wait range (the broker is down or slow)
    b"x" + due_ms (u64 BE) + seq (u64 BE)            -> the value of a "d" key: a dead letter (the broker
                                                        kept answering that its topic does not exist)
    b"m" + b"delay.releasing.w." + broker addr      -> the last "w" key of that broker taken for release
    b"m" + b"delay.stats"                           -> u64 messages, u64 bytes (due and index keys
                                                        and values: what max_pending_bytes caps)

Iterating ``b"d"`` keys is iterating in due-time order (ties in order of arrival), so the
releaser seeks to its cursor and reads only what is due: it never scans what is pending.  A
message due for a broker that does not take its releases (down, or slower than its share of the
read-ahead) is moved to that broker's ``b"w"`` range, also in due order, and read from there
when the broker takes releases again: the other brokers' releases do not wait behind it.  Every
key of a held message ends with its due time and sequence (16 bytes), which the cancel index
entries name.
Nothing per message is kept in memory.  The counters are written in the same ``WriteBatch``
as the change they count (one writer greenlet makes every write), so they are exact after a
crash and a restart does not scan the pending messages.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gevent
from gevent.event import Event

from rmqfast.log import ctx
from rmqfast.spill.record import CopyRecord

log = logging.getLogger("rmqfast.delay")

_KEY = struct.Struct(">QQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
#: the fixed part of an encoded CopyRecord (rmqfast.spill.record), read by the release's decoder
_RECORD_FIXED = struct.Struct(">BBqiiqiii")
RECORD_VERSION = 1
_STATS = struct.Struct(">QQ")
DUE_PREFIX = b"d"
INDEX_PREFIX = b"e"
DEAD_PREFIX = b"x"
PARK_PREFIX = b"w"
PARKED_RELEASING_PREFIX = b"m" + b"delay.releasing.w."
STATS_KEY = b"m" + b"delay.stats"
#: The last due key the releaser took (see :meth:`DelayStore.mark_releasing`)
RELEASING_KEY = b"m" + b"delay.releasing"
#: Longest a write waits out RocksDB's write stalls (in gevent) before it is refused (SYSTEM_BUSY).
STALL_WAIT_MAX = 30.0
#: Largest due time a key can hold (year 9999): keeps the big-endian order meaningful.
MAX_DUE_MS = 253402300799999


def _stalled(exc: Exception) -> bool:
    """A write refused because RocksDB would have stalled it (``no_slowdown``: Status::Incomplete)."""
    why = str(exc).lower()
    return "incomplete" in why or "stall" in why


class StoreFull(RuntimeError):
    """Accepting this message would pass ``[delay] max_pending_bytes``."""


class WriteFailed(RuntimeError):
    """The synced write failed: the message is not stored (the producer must not hear SUCCESS)."""


def due_key(due: int, seq: int) -> bytes:
    return DUE_PREFIX + _KEY.pack(min(max(due, 0), MAX_DUE_MS), seq)


def split_due_key(key: bytes) -> tuple[int, int]:
    """(due ms, seq) of a held message's key (``b"d"``, ``b"w"`` or ``b"x"``: the last 16 bytes)."""
    return _KEY.unpack_from(key, len(key) - 16)  # type: ignore[return-value]


def parked_prefix(addr: str) -> bytes:
    """The start of a broker's wait range: ``b"w"`` + u16 length + its address."""
    return PARK_PREFIX + _s16(addr)


def parked_key(addr: str, dkey: bytes) -> bytes:
    """Where a due key's message waits for its broker."""
    return parked_prefix(addr) + dkey[-16:]


def _s16(s: str) -> bytes:
    b = s.encode("utf-8", "replace")[:65535]
    return _U16.pack(len(b)) + b


@dataclass
class Held:
    """One held message as stored."""

    addr: str  # the broker (host:port) the producer's connection went to
    msg_id: str
    keys: str  # the KEYS property (space-separated), for cancel by key
    record: CopyRecord

    def encode(self) -> bytes:
        return _s16(self.addr) + _s16(self.msg_id) + _s16(self.keys) + self.record.encode()

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Held:
        if not isinstance(data, bytes):
            data = bytes(data)
        try:
            return _decode(data)
        except Exception:  # malformed: read again by the checking decoders, which say what is wrong
            pass
        mv = memoryview(data)
        pos = 0
        out = []
        for _ in range(3):
            (n,) = _U16.unpack_from(mv, pos)
            out.append(bytes(mv[pos + 2 : pos + 2 + n]).decode("utf-8", "replace"))
            pos += 2 + n
        return cls(out[0], out[1], out[2], CopyRecord.decode(mv[pos:]))

    def index_keys(self, dkey: bytes) -> list[bytes]:
        tail = b"\x00" + dkey[-16:]
        out = [INDEX_PREFIX + b"u" + self.msg_id.encode("utf-8", "replace") + tail] if self.msg_id else []
        for k in {k for k in self.keys.split(" ") if k}:
            out.append(INDEX_PREFIX + b"k" + k.encode("utf-8", "replace") + tail)
        return out


def _decode(data: bytes) -> Held:
    """:meth:`Held.decode` of a well-formed value, in one pass over the bytes (the release reads
    every held message once: this is its hot path); raises on anything else."""
    u16 = _U16.unpack_from
    (n,) = u16(data, 0)
    addr = data[2 : 2 + n].decode("utf-8", "replace")
    pos = 2 + n
    (n,) = u16(data, pos)
    msg_id = data[pos + 2 : pos + 2 + n].decode("utf-8", "replace")
    pos += 2 + n
    (n,) = u16(data, pos)
    keys = data[pos + 2 : pos + 2 + n].decode("utf-8", "replace")
    pos += 2 + n
    version, kind, created, qid, sys_flag, born, flag, recon, max_recon = _RECORD_FIXED.unpack_from(data, pos)
    if version != RECORD_VERSION:
        raise ValueError(f"record version {version}")
    pos += _RECORD_FIXED.size
    (n,) = u16(data, pos)
    topic = data[pos + 2 : pos + 2 + n].decode("utf-8", "replace")
    pos += 2 + n
    (n,) = u16(data, pos)
    broker_name = data[pos + 2 : pos + 2 + n].decode("utf-8", "replace")
    pos += 2 + n
    (n,) = u16(data, pos)
    group = data[pos + 2 : pos + 2 + n].decode("utf-8", "replace")
    pos += 2 + n
    (n,) = _U32.unpack_from(data, pos)
    props = data[pos + 4 : pos + 4 + n].decode("utf-8", "replace")
    pos += 4 + n
    if pos > len(data):
        raise ValueError("truncated")
    return Held(addr, msg_id, keys, CopyRecord(topic, data[pos:], props, qid, sys_flag, born, flag, recon, max_recon,
                                               broker_name, group, kind, created))


class _Batch:
    __slots__ = ("puts", "deletes", "dead", "moves", "done", "error", "sync", "waiting")

    def __init__(self) -> None:
        self.puts: list[tuple[bytes, bytes, list[bytes]]] = []  # (due key, value, index keys)
        self.deletes: list[tuple[bytes, int, list[bytes]]] = []  # (due key, value length, index keys)
        self.dead: list[tuple[bytes, bytes, list[bytes]]] = []  # (due key, value, index keys): to the x range
        self.moves: list[tuple[bytes, bytes, bytes]] = []  # (due key, wait key, value): to a broker's w range
        self.done = Event()
        self.error: BaseException | None = None
        self.sync = False
        self.waiting: list[Any] | None = None  # the sends the filter answers once this batch is synced


class DelayStore:
    """The held messages of one worker: group-committed writes, due-ordered reads, counters.

    ``db``: an open rocksdict ``Rdict`` in raw mode (the worker's spill database, shared with the
    cross-cloud copies and peak shaving: one writer per RocksDB directory).
    """

    def __init__(self, db: Any, *, max_pending_bytes: int, path: str = "") -> None:
        import rocksdict as r

        self.db = db
        self.path = path
        self.max_pending_bytes = max_pending_bytes
        self._wb = r.WriteBatch
        self._sync = r.WriteOptions()
        self._sync.sync = True
        self._nosync = r.WriteOptions()
        self._nosync.sync = False
        # The writer's writes: never synced by the write itself (rocksdict holds the GIL through a
        # write, so an fsync inside it would stop every greenlet of the worker; the WAL is synced
        # after it by flush_wal, which lets the GIL go), and never slowed down inside RocksDB (a
        # stalled write would hold the GIL too): a stall is waited out in gevent, see _put_batch.
        self._fast = r.WriteOptions()
        self._fast.sync = False
        self._fast.no_slowdown = True
        self.stalls = 0
        self._ro = r.ReadOptions
        # Held messages are read once, in key order (release, cancel lookups): their blocks would
        # only push other data out of the block cache and grow the worker's memory.
        self._scan_once = r.ReadOptions()
        self._scan_once.fill_cache(False)
        raw = db.get(STATS_KEY)
        self.messages, self.bytes = _STATS.unpack(raw) if raw and len(raw) == _STATS.size else (0, 0)
        if not raw and self._first_due() is not None:  # stats lost (older layout): count once
            self.messages, self.bytes = self._count()
        self.reserved = 0  # bytes queued for a commit, not written yet
        self.fsyncs = 0
        self.synced_messages = 0
        top = self._last_seq()
        self._seq = top + 1
        self._pending = _Batch()
        self._wake = Event()
        self._closed = False
        self.on_put: Any = None  # callable(due key) after a put is written (the releaser's wake-up)
        self._greenlet = gevent.spawn(self._run)

    # Reading ----------------------------------------------------------------------------------

    def _iter(self, start: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        it = self.db.iter(self._scan_once)
        it.seek(start)
        while it.valid():
            k = it.key()
            if not k.startswith(prefix):
                break
            yield k, it.value()
            it.next()

    def read_parked(self, after: bytes, prefix: bytes, limit: int,
                    before: bytes = b"\xff") -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` messages of one broker's wait range (``prefix``), from ``after`` on, each
        with a key below ``before``."""
        out: list[tuple[bytes, bytes]] = []
        if limit <= 0:
            return out
        for kv in self._iter(after, prefix):
            if kv[0] >= before:
                break
            out.append(kv)
            if len(out) >= limit:
                break
        return out

    def parked_prefixes(self) -> list[bytes]:
        """The wait ranges that hold messages (one seek per broker, not one step per message)."""
        out = []
        it = self.db.iter(self._scan_once)
        it.seek(PARK_PREFIX)
        while it.valid():
            k = it.key()
            if not k.startswith(PARK_PREFIX):
                break
            prefix = k[:-16]
            out.append(prefix)
            it.seek(prefix + b"\xff" * 17)
        return out

    def parked_marks(self) -> dict[bytes, bytes]:
        """Per wait range, the last key taken for release (:meth:`mark_parked`)."""
        return {PARK_PREFIX + k[len(PARKED_RELEASING_PREFIX):]: v
                for k, v in self._iter(PARKED_RELEASING_PREFIX, PARKED_RELEASING_PREFIX)}

    def locate(self, dkey: bytes, prefixes: Any = ()) -> tuple[bytes, bytes] | None:
        """(key, value) of a pending message by its due key: in the due range, else in one of the
        brokers' wait ranges (``prefixes``); None when it is in neither."""
        v = self.db.get(dkey)
        if v is not None:
            return dkey, v
        for prefix in prefixes:
            k = prefix + dkey[-16:]
            v = self.db.get(k)
            if v is not None:
                return k, v
        return None

    def _first_due(self) -> bytes | None:
        for k, _v in self._iter(DUE_PREFIX, DUE_PREFIX):
            return k
        return None

    def _last_seq(self) -> int:
        """Largest sequence in use: the counter is kept in meta; keys are the fallback."""
        raw = self.db.get(b"m" + b"delay.seq")
        top = _KEY.unpack(raw)[1] if raw and len(raw) == 16 else -1
        return top

    def _count(self) -> tuple[int, int]:
        n = b = 0
        for k, v in [*self._iter(DUE_PREFIX, DUE_PREFIX), *self._iter(PARK_PREFIX, PARK_PREFIX)]:
            n += 1
            b += len(k) + len(v)
            try:
                b += sum(map(len, Held.decode(v).index_keys(k)))
            except Exception:  # undecodable: no index entries to count
                pass
        return n, b

    def read_due(self, after: bytes, now_ms: int, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` messages with a key from ``after`` on and due at ``now_ms`` or before."""
        ro = self._ro()
        ro.fill_cache(False)
        # the iterator stops at the bound: nothing past what is due is read
        ro.set_iterate_upper_bound(due_key(now_ms + 1, 0) if now_ms < MAX_DUE_MS else DUE_PREFIX + b"\xff")
        out: list[tuple[bytes, bytes]] = []
        if limit <= 0:
            return out
        for kv in self.db.items(from_key=after, read_opt=ro):
            out.append(kv)
            if len(out) >= limit:
                break
        return out

    def next_due(self, after: bytes) -> int | None:
        """Due time of the first message from ``after`` on (one seek)."""
        for k, _v in self._iter(after, DUE_PREFIX):
            return split_due_key(k)[0]
        return None

    def find(self, *, msg_id: str | None = None, key: str | None = None) -> list[bytes]:
        """Due keys of the pending messages with this msgId or this key."""
        if msg_id:
            p = INDEX_PREFIX + b"u" + msg_id.encode() + b"\x00"
        elif key:
            p = INDEX_PREFIX + b"k" + key.encode() + b"\x00"
        else:
            return []
        return [DUE_PREFIX + k[len(p):] for k, _v in self._iter(p, p)]

    def get(self, dkey: bytes) -> bytes | None:
        return self.db.get(dkey)

    def scan(self, limit: int = 100) -> list[tuple[bytes, bytes]]:
        out = []
        for kv in self._iter(DUE_PREFIX, DUE_PREFIX):
            out.append(kv)
            if len(out) >= limit:
                break
        return out

    # Writing (one writer greenlet) ------------------------------------------------------------

    def next_seq(self) -> int:
        s = self._seq
        self._seq += 1
        return s

    def would_exceed(self, nbytes: int) -> bool:
        return self.bytes + self.reserved + nbytes > self.max_pending_bytes

    def put(self, held: Held, due: int) -> tuple[bytes, _Batch]:
        """Queue a held message for the next synced write; :meth:`wait` on the batch.

        Raises :class:`StoreFull` past ``max_pending_bytes`` and :class:`WriteFailed` when closed.
        """
        if self._closed:
            raise WriteFailed("the delay store is closed (the worker is stopping)")
        value = held.encode()
        dkey = due_key(due, self.next_seq())
        idx = held.index_keys(dkey)
        n = len(dkey) + len(value) + sum(map(len, idx))
        if self.would_exceed(n):
            raise StoreFull(f"{self.bytes + self.reserved} of {self.max_pending_bytes} bytes held "
                            "([delay] max_pending_bytes)")
        batch = self._pending
        batch.puts.append((dkey, value, idx))
        batch.sync = True
        self.reserved += n
        self._wake.set()
        return dkey, batch

    def mark_releasing(self, dkey: bytes) -> None:
        """Record the last due key taken for release, before it is sent (unsynced: a process crash
        keeps it); a write stall is waited out in gevent (see :meth:`_put_batch`)."""
        self._mark(RELEASING_KEY, dkey)

    def mark_parked(self, wkey: bytes) -> None:
        """The same for a broker's wait range: its last key taken for release (or moved there after
        it may have been sent before a crash), before it is sent."""
        self._mark(PARKED_RELEASING_PREFIX + wkey[1:-16], wkey)

    def _mark(self, mark: bytes, key: bytes) -> None:
        waited = 0.0
        while True:
            try:
                self.db.put(mark, key, self._fast)
                return
            except Exception as exc:
                if not _stalled(exc) or waited >= STALL_WAIT_MAX:
                    raise
            self.stalls += 1
            gevent.sleep(0.005)
            waited += 0.005

    def wait(self, batch: _Batch) -> None:
        batch.done.wait()
        if batch.error is not None:
            raise WriteFailed(f"synced write to the delay store {self.path} failed: {batch.error}") from batch.error

    def delete(self, dkey: bytes, value: bytes, held: Held | None = None) -> _Batch:
        """Queue the removal of a released or cancelled message (written unsynced, soon)."""
        try:
            idx = (held or Held.decode(value)).index_keys(dkey)
        except Exception:  # undecodable: its index entries cannot be named; the message goes anyway
            idx = []
        batch = self._pending
        batch.deletes.append((dkey, len(value), idx))
        self._wake.set()
        return batch

    def delete_many(self, items: list[tuple[bytes, int, list[bytes]]]) -> _Batch:
        """Queue the removal of released messages: (due key, value length, index keys) each."""
        batch = self._pending
        batch.deletes.extend(items)
        self._wake.set()
        return batch

    def dead_letter(self, dkey: bytes, value: bytes, held: Held) -> _Batch:
        """Queue the move of a message the broker cannot take (no such topic) to the dead-letter
        range: no longer pending or released, still on disk (and counted in the bytes held)."""
        batch = self._pending
        batch.dead.append((dkey, value, held.index_keys(dkey)))
        self._wake.set()
        return batch

    def park(self, dkey: bytes, wkey: bytes, value: bytes) -> _Batch:
        """Queue the move of a due message to its broker's wait range (same value, same index entries:
        they name the due time and sequence, which both keys end with)."""
        batch = self._pending
        batch.moves.append((dkey, wkey, value))
        self._wake.set()
        return batch

    def dead_letters(self, limit: int = 100) -> list[tuple[bytes, bytes]]:
        """The first ``limit`` dead letters: (their due key, value)."""
        out = []
        for k, v in self._iter(DEAD_PREFIX, DEAD_PREFIX):
            out.append((DUE_PREFIX + k[-16:], v))
            if len(out) >= limit:
                break
        return out

    def _run(self) -> None:
        pool = gevent.get_hub().threadpool
        while True:
            self._wake.wait()
            self._wake.clear()
            batch = self._pending
            if not batch.puts and not batch.deletes and not batch.dead and not batch.moves:
                if self._closed:
                    return
                continue
            self._pending = _Batch()
            self._write(batch, pool)
            p = self._pending
            if self._closed and not p.puts and not p.deletes and not p.dead and not p.moves:
                return

    def _batch_of(self, batch: _Batch) -> tuple[Any, int, int, int]:
        """The WriteBatch of a batch: (write batch, messages, bytes, bytes put) after it."""
        wb = self._wb(raw_mode=True)
        messages, nbytes = self.messages, self.bytes
        put_bytes = 0
        for dkey, value, idx in batch.puts:
            wb.put(dkey, value)
            for k in idx:
                wb.put(k, b"")
            messages += 1
            put_bytes += len(dkey) + len(value) + sum(map(len, idx))
        for dkey, vlen, idx in batch.deletes:
            wb.delete(dkey)
            for k in idx:
                wb.delete(k)
            messages -= 1
            nbytes -= len(dkey) + vlen + sum(map(len, idx))
        for dkey, value, idx in batch.dead:
            wb.delete(dkey)
            for k in idx:
                wb.delete(k)
            wb.put(DEAD_PREFIX + dkey[-16:], value)
            messages -= 1
            nbytes -= sum(map(len, idx)) + len(dkey) - 17  # the x key is as long as a d key
        for dkey, wkey, value in batch.moves:
            wb.delete(dkey)
            wb.put(wkey, value)
            nbytes += len(wkey) - len(dkey)
        nbytes += put_bytes
        wb.put(STATS_KEY, _STATS.pack(max(0, messages), max(0, nbytes)))
        if batch.puts:
            wb.put(b"m" + b"delay.seq", _KEY.pack(0, self._seq - 1))
        return wb, messages, nbytes, put_bytes

    def _put_batch(self, batch: _Batch, pool: Any) -> tuple[int, int, int]:
        """Write a batch to the memtable and the WAL (unsynced); a write stall (RocksDB would make
        the write wait, holding the GIL) is waited out here, in gevent, and the batch written again."""
        waited = 0.0
        while True:
            wb, messages, nbytes, put_bytes = self._batch_of(batch)
            try:
                self.db.write(wb, self._fast if pool is not None else self._nosync)
                return messages, nbytes, put_bytes
            except Exception as exc:
                if not _stalled(exc) or waited >= STALL_WAIT_MAX:
                    raise
            self.stalls += 1  # memtables full or too many level-0 files: flush and compaction catch up
            gevent.sleep(0.005)
            waited += 0.005

    def _write(self, batch: _Batch, pool: Any = None) -> None:
        put_bytes = sum(len(d) + len(v) + sum(map(len, idx)) for d, v, idx in batch.puts)
        try:
            messages, nbytes, put_bytes = self._put_batch(batch, pool)
            if batch.sync:
                # group commit: one fsync of the WAL for every write so far; flush_wal lets the GIL
                # go, so the worker goes on taking sends (the next group) meanwhile
                if pool is not None:
                    pool.apply(self.db.flush_wal, (True,))
                else:
                    self.db.flush_wal(True)
        except Exception as exc:  # disk full, I/O error: every waiter hears it
            log.error("delay store write failed", extra=ctx(error=str(exc), path=self.path))
            batch.error = exc
        else:
            self.messages, self.bytes = max(0, messages), max(0, nbytes)
            if batch.sync:
                self.fsyncs += 1
                self.synced_messages += len(batch.puts)
        self.reserved -= put_bytes
        batch.done.set()
        if batch.error is None and batch.puts and self.on_put is not None:
            self.on_put(min(p[0] for p in batch.puts))

    def flush(self) -> None:
        """Wait until everything queued so far is written."""
        batch = self._pending
        if batch.puts or batch.deletes or batch.dead or batch.moves:
            self._wake.set()
            batch.done.wait()

    def close(self) -> None:
        """Write what is queued, then stop the writer (the database stays open: its owner closes it)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._greenlet.join(timeout=10)
        batch = self._pending
        if batch.puts or batch.deletes or batch.dead or batch.moves:
            self._pending = _Batch()
            self._write(batch)

"""Held delayed messages, in the worker's spill RocksDB, keyed by due time.

Keys (beside the spill's ``b"c"`` copy lanes and ``b"m"`` meta keys, one database per worker)::

    b"d" + due_ms (u64 BE) + seq (u64 BE)            -> u16 len + broker addr, u16 len + msgId,
                                                        u16 len + keys, then a CopyRecord
    b"e" + b"u" + msgId + NUL + due_ms + seq        -> b""   (cancel by msgId)
    b"e" + b"k" + key + NUL + due_ms + seq          -> b""   (cancel by key, one per KEYS entry)
    b"x" + due_ms (u64 BE) + seq (u64 BE)            -> the value of a "d" key: a dead letter (the broker
                                                        kept answering that its topic does not exist)
    b"m" + b"delay.stats"                           -> u64 messages, u64 bytes (due and index keys
                                                        and values: what max_pending_bytes caps)

Iterating ``b"d"`` keys is iterating in due-time order (ties in order of arrival), so the
releaser seeks to its cursor and reads only what is due: it never scans what is pending.
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
_STATS = struct.Struct(">QQ")
DUE_PREFIX = b"d"
INDEX_PREFIX = b"e"
DEAD_PREFIX = b"x"
STATS_KEY = b"m" + b"delay.stats"
#: Largest due time a key can hold (year 9999): keeps the big-endian order meaningful.
MAX_DUE_MS = 253402300799999


class StoreFull(RuntimeError):
    """Accepting this message would pass ``[delay] max_pending_bytes``."""


class WriteFailed(RuntimeError):
    """The synced write failed: the message is not stored (the producer must not hear SUCCESS)."""


def due_key(due: int, seq: int) -> bytes:
    return DUE_PREFIX + _KEY.pack(min(max(due, 0), MAX_DUE_MS), seq)


def split_due_key(key: bytes) -> tuple[int, int]:
    return _KEY.unpack_from(key, 1)  # type: ignore[return-value]


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
    def decode(cls, data: bytes) -> Held:
        mv = memoryview(data)
        pos = 0
        out = []
        for _ in range(3):
            (n,) = _U16.unpack_from(mv, pos)
            out.append(bytes(mv[pos + 2 : pos + 2 + n]).decode("utf-8", "replace"))
            pos += 2 + n
        return cls(out[0], out[1], out[2], CopyRecord.decode(mv[pos:]))

    def index_keys(self, dkey: bytes) -> list[bytes]:
        tail = b"\x00" + dkey[1:]
        out = [INDEX_PREFIX + b"u" + self.msg_id.encode("utf-8", "replace") + tail] if self.msg_id else []
        for k in {k for k in self.keys.split(" ") if k}:
            out.append(INDEX_PREFIX + b"k" + k.encode("utf-8", "replace") + tail)
        return out


class _Batch:
    __slots__ = ("puts", "deletes", "dead", "done", "error", "sync")

    def __init__(self) -> None:
        self.puts: list[tuple[bytes, bytes, list[bytes]]] = []  # (due key, value, index keys)
        self.deletes: list[tuple[bytes, int, list[bytes]]] = []  # (due key, value length, index keys)
        self.dead: list[tuple[bytes, bytes, list[bytes]]] = []  # (due key, value, index keys): to the x range
        self.done = Event()
        self.error: BaseException | None = None
        self.sync = False


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
        for k, v in self._iter(DUE_PREFIX, DUE_PREFIX):
            n += 1
            b += len(k) + len(v)
            try:
                b += sum(map(len, Held.decode(v).index_keys(k)))
            except Exception:  # undecodable: no index entries to count
                pass
        return n, b

    def read_due(self, after: bytes, now_ms: int, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` messages with a key from ``after`` on and due at ``now_ms`` or before."""
        end = due_key(now_ms, 0xFFFFFFFFFFFFFFFF)
        out: list[tuple[bytes, bytes]] = []
        for k, v in self._iter(after, DUE_PREFIX):
            if k > end:
                break
            out.append((k, v))
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

    def dead_letter(self, dkey: bytes, value: bytes, held: Held) -> _Batch:
        """Queue the move of a message the broker cannot take (no such topic) to the dead-letter
        range: no longer pending or released, still on disk (and counted in the bytes held)."""
        batch = self._pending
        batch.dead.append((dkey, value, held.index_keys(dkey)))
        self._wake.set()
        return batch

    def dead_letters(self, limit: int = 100) -> list[tuple[bytes, bytes]]:
        """The first ``limit`` dead letters: (their due key, value)."""
        out = []
        for k, v in self._iter(DEAD_PREFIX, DEAD_PREFIX):
            out.append((DUE_PREFIX + k[1:], v))
            if len(out) >= limit:
                break
        return out

    def _run(self) -> None:
        pool = gevent.get_hub().threadpool
        while True:
            self._wake.wait()
            self._wake.clear()
            batch = self._pending
            if not batch.puts and not batch.deletes and not batch.dead:
                if self._closed:
                    return
                continue
            self._pending = _Batch()
            self._write(batch, pool)
            if self._closed and not self._pending.puts and not self._pending.deletes and not self._pending.dead:
                return

    def _write(self, batch: _Batch, pool: Any = None) -> None:
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
            wb.put(DEAD_PREFIX + dkey[1:], value)
            messages -= 1
            nbytes -= sum(map(len, idx))
        nbytes += put_bytes
        wb.put(STATS_KEY, _STATS.pack(max(0, messages), max(0, nbytes)))
        if batch.puts:
            wb.put(b"m" + b"delay.seq", _KEY.pack(0, self._seq - 1))
        opts = self._sync if batch.sync else self._nosync
        try:
            if pool is not None and batch.sync:
                pool.apply(self.db.write, (wb, opts))
            else:
                self.db.write(wb, opts)
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
        if batch.puts or batch.deletes or batch.dead:
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
        if batch.puts or batch.deletes or batch.dead:
            self._pending = _Batch()
            self._write(batch)

"""The per-worker spill: one RocksDB (rocksdict) per worker, in its own directory.

Layout: ``<state_dir>/spill/worker-<N>/`` holds one database; nothing is shared between
workers, so there is never more than one writer (RocksDB allows one writer process).

Keys order copies so that a drainer reads them per remote and topic in order of arrival::

    b"c" + remote + b"\\x00" + topic + b"\\x00" + seq (u64, big-endian)

A message queue belongs to one topic, so reading a (remote, topic) lane in key order keeps the
order of every message queue and sharding key of that topic.  ``seq`` is one counter per
database, recovered on open as the largest sequence present plus one.  Values are encoded
:class:`~rmqfast.spill.record.CopyRecord`.

Writes are ``WriteBatch``es: synced (``WriteOptions.sync``) in durable mode, so an
acknowledged copy survives ``kill -9`` and power loss of the host's page cache; unsynced in
fast mode (still in the WAL, so a process crash loses nothing that reached RocksDB; only an
OS crash can).  Delivered copies are deleted with point deletes in one unsynced batch (a lost
delete means a duplicate delivery after a crash, never a loss).

Accounting: the number of copies, their bytes (key + value) and the lanes are counted in
memory; on open they are recovered with one scan of the database (proportional to the
backlog).  The disk cap applies to these logical bytes; RocksDB's own overhead (WAL, files
awaiting compaction) comes on top, so set the cap to about two thirds of what the volume
may hold.
"""

from __future__ import annotations

import ctypes
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rmqfast.spill.record import created_ms_of

_SEQ = struct.Struct(">Q")
LANE_PREFIX = b"c"
#: Lanes whose "remote" starts with this hold peak shaving's backlog (``[[limits.rule]] mode =
#: "shape"``, :mod:`rmqfast.limits.shaper`): ``@shape:<local broker host:port>``.  Configured
#: remote names cannot contain '@', so the cross-cloud replicator never mistakes them for its own.
SHAPE_REMOTE_PREFIX = "@shape:"


#: glibc arenas for the threads of a process that writes a spill (mallopt M_ARENA_MAX)
MALLOC_ARENAS = 2
#: allocations from this size on are mapped on their own (mallopt M_MMAP_THRESHOLD, fixed)
MMAP_THRESHOLD = 256 << 10
_arenas_bounded = False


def bound_malloc_arenas() -> None:
    """At most :data:`MALLOC_ARENAS` glibc malloc arenas in this process (once, before RocksDB
    starts its threads).

    RocksDB's own memory is bounded by the options below (memtables, block cache, table
    readers), but every thread that allocates (the flush and compaction threads, the thread
    that makes the synced writes) gets a glibc arena of its own by default (up to 8 per core),
    and memory a thread freed stays resident in its arena: a worker holding delayed messages
    grew from 46 to 62-66 MB RSS while accepting and releasing although RocksDB counted
    ~11 MB (memtables, block cache, readers).  Two arenas keep that slack small; the threads
    that share them are few and rarely allocate at once.
    """
    global _arenas_bounded
    if _arenas_bounded:
        return
    _arenas_bounded = True
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-8, MALLOC_ARENAS)  # M_ARENA_MAX (glibc; a no-op elsewhere)
        # A fixed mmap threshold: RocksDB's large blocks (memtable arena blocks, compaction
        # readahead) are mapped and unmapped each time instead of raising glibc's dynamic
        # threshold (to 32 MiB, and the heap's trim threshold with it) and staying in the heap
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def trim_malloc() -> None:
    """Give the free pages inside glibc's heaps back to the system (malloc_trim(0)): what a burst
    of reads and writes freed in the middle of a heap stays resident otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class SpillError(RuntimeError):
    """The spill database cannot be opened or used; the message says which directory and why."""


@dataclass
class LaneStats:
    messages: int = 0
    bytes: int = 0


def lane_prefix(remote: str, topic: str) -> bytes:
    return LANE_PREFIX + remote.encode() + b"\x00" + topic.encode() + b"\x00"


def make_key(remote: str, topic: str, seq: int) -> bytes:
    return lane_prefix(remote, topic) + _SEQ.pack(seq)


def split_key(key: bytes) -> tuple[str, str, int]:
    """(remote, topic, seq) of a lane key."""
    if not key.startswith(LANE_PREFIX) or len(key) < 11:
        raise SpillError(f"spill key {key!r} is not a copy key (expected b'c' + remote + NUL + topic + NUL + seq)")
    body = key[1:-8]
    remote, sep, topic = body[:-1].partition(b"\x00")
    if not sep or body[-1:] != b"\x00":
        raise SpillError(f"spill key {key!r} does not separate remote and topic with NUL bytes")
    return remote.decode(), topic.decode(), _SEQ.unpack(key[-8:])[0]


def worker_dir(state_dir: str | Path, index: int) -> Path:
    return Path(state_dir) / "spill" / f"worker-{index}"


class SpillStore:
    """One worker's spill database.

    ``access``: ``"rw"`` (the worker), ``"ro"`` (a stopped proxy's spill, for ``rmqfast spill``)
    or ``"secondary"`` (a running proxy's spill, read beside its writer).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        write_buffer_bytes: int = 4 << 20,
        block_cache_bytes: int = 4 << 20,
        disk_cap_bytes: int = 1 << 30,
        access: str = "rw",
        max_open_files: int = 32,
    ) -> None:
        import rocksdict as r

        self.path = Path(path)
        self.disk_cap_bytes = disk_cap_bytes
        self.access = access
        opts = r.Options(raw_mode=True)
        opts.create_if_missing(access == "rw")
        opts.set_write_buffer_size(max(64 << 10, write_buffer_bytes))
        opts.set_max_write_buffer_number(2)
        opts.set_keep_log_file_num(2)
        opts.set_max_background_jobs(1)
        table = r.BlockBasedOptions()
        table.set_block_cache(r.Cache(max(64 << 10, block_cache_bytes)))
        # Memory bounded whatever the volume held: index blocks live in the block cache, and at
        # most `max_open_files` table readers stay open (an open reader keeps its index, ~8 MB per
        # GB of 1 KiB messages, outside any cache).
        table.set_cache_index_and_filter_blocks(True)
        # Partitioned index: a table's index is cut into 4 KiB partitions read into the cache as
        # needed, under a small top-level index kept pinned.  A whole index (0.5-1 MB for a 64 MB
        # table of 1 KiB messages) would otherwise be read into the cache at each miss, and a few
        # MiB of cache hold only a few (10 M delayed messages held, 4 MiB cache, whole indexes:
        # worker RSS 75 MB while releasing; partitioned: 66 MB).
        table.set_index_type(r.BlockBasedIndexType.two_level_index_search())
        table.set_metadata_block_size(4096)
        table.set_pin_top_level_index_and_filter(True)
        opts.set_block_based_table_factory(table)
        opts.set_max_open_files(max_open_files)
        # Transient buffers of the background threads, allocated whatever the options above: a
        # compaction reads each input file with its own readahead buffer (2 MiB each by default:
        # ~10 MiB with a few level-0 files) and every file written (WAL, flush and compaction
        # output) buffers 1 MiB: 256 KiB each.
        opts.set_compaction_readahead_size(256 << 10)
        opts.set_writable_file_max_buffer_size(256 << 10)
        self._secondary_dir: tempfile.TemporaryDirectory[str] | None = None
        if access == "rw":
            bound_malloc_arenas()
        try:
            if access == "rw":
                self.path.mkdir(parents=True, exist_ok=True)
                self.db = r.Rdict(str(self.path), opts)
            elif access == "ro":
                self.db = r.Rdict(str(self.path), opts, access_type=r.AccessType.read_only(False))
            elif access == "secondary":
                opts.set_max_open_files(-1)
                self._secondary_dir = tempfile.TemporaryDirectory(prefix="rmqfast-spill-secondary-")
                self.db = r.Rdict(
                    str(self.path), opts, access_type=r.AccessType.secondary(self._secondary_dir.name)
                )
                self.db.try_catch_up_with_primary()
            else:
                raise ValueError(f"access must be 'rw', 'ro' or 'secondary', not {access!r}")
        except Exception as exc:
            if isinstance(exc, ValueError) and "access must be" in str(exc):
                raise
            hint = (
                "is another process (a running worker) using it? Only one writer may open a spill directory"
                if access == "rw"
                else "does the directory hold a spill database?"
            )
            raise SpillError(f"cannot open the spill database in {self.path} ({access}): {exc}; {hint}") from exc
        self._sync = r.WriteOptions()
        self._sync.sync = True
        self._nosync = r.WriteOptions()
        self._nosync.sync = False
        self._wb = r.WriteBatch
        self.lanes: dict[tuple[str, str], LaneStats] = {}
        self.messages = 0
        self.bytes = 0
        self.fsyncs = 0
        self.synced_messages = 0
        self.reserved = 0  # bytes queued for a group commit, not written yet
        self._next_seq = 0
        self._recover()

    # Recovery -------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Count the backlog per lane and find the next sequence number (one scan)."""
        top = -1
        for key, value in self._iter_from(LANE_PREFIX):
            remote, topic, seq = split_key(key)
            st = self.lanes.setdefault((remote, topic), LaneStats())
            n = len(key) + len(value)
            st.messages += 1
            st.bytes += n
            self.messages += 1
            self.bytes += n
            top = max(top, seq)
        self._next_seq = top + 1

    def _iter_from(self, start: bytes, prefix: bytes = LANE_PREFIX) -> Iterator[tuple[bytes, bytes]]:
        it = self.db.iter()
        it.seek(start)
        while it.valid():
            k = it.key()
            if not k.startswith(prefix):
                break
            yield k, it.value()
            it.next()

    # Writing --------------------------------------------------------------------------------

    def next_seq(self) -> int:
        s = self._next_seq
        self._next_seq += 1
        return s

    def would_exceed(self, nbytes: int) -> bool:
        return self.bytes + self.reserved + nbytes > self.disk_cap_bytes

    @staticmethod
    def size_of(items: list[tuple[str, str, int, bytes]]) -> int:
        """Bytes (key + value) these copies take, as the accounting counts them."""
        return sum(len(lane_prefix(r, t)) + 8 + len(v) for r, t, _s, v in items)

    def write(self, items: list[tuple[str, str, int, bytes]], *, sync: bool) -> None:
        """Write copies ``(remote, topic, seq, value)`` in one batch, synced or not."""
        if not items:
            return
        self.write_unaccounted(items, sync=sync)
        self.account(items, sync=sync)

    def write_unaccounted(self, items: list[tuple[str, str, int, bytes]], *, sync: bool) -> None:
        """The database write alone (safe to run in a native thread; call :meth:`account` after)."""
        wb = self._wb(raw_mode=True)
        for remote, topic, seq, value in items:
            wb.put(make_key(remote, topic, seq), value)
        self.db.write(wb, self._sync if sync else self._nosync)

    def sync_wal(self) -> None:
        """Sync the write-ahead log: every write made before it is durable once it returns.

        Unlike a write with ``sync=True`` (rocksdict holds the GIL through it), this lets the GIL go
        during the fsync, so run in a native thread it does not stop the worker's other greenlets."""
        self.db.flush_wal(True)

    def account(self, items: list[tuple[str, str, int, bytes]], *, sync: bool) -> None:
        if sync:
            self.fsyncs += 1
            self.synced_messages += len(items)
        for remote, topic, _seq, value in items:
            n = len(lane_prefix(remote, topic)) + 8 + len(value)
            st = self.lanes.setdefault((remote, topic), LaneStats())
            st.messages += 1
            st.bytes += n
            self.messages += 1
            self.bytes += n

    def delete(self, items: list[tuple[str, str, int, int]]) -> None:
        """Delete delivered copies ``(remote, topic, seq, value_length)`` in one unsynced batch."""
        if not items:
            return
        wb = self._wb(raw_mode=True)
        for remote, topic, seq, vlen in items:
            key = make_key(remote, topic, seq)
            wb.delete(key)
            n = len(key) + vlen
            st = self.lanes.get((remote, topic))
            if st is not None:
                st.messages -= 1
                st.bytes -= n
                if st.messages <= 0:
                    del self.lanes[(remote, topic)]
            self.messages -= 1
            self.bytes -= n
        self.db.write(wb, self._nosync)

    def delete_lane(self, remote: str, topic: str) -> None:
        """Drop a whole lane (range delete), e.g. a remote removed from the configuration."""
        p = lane_prefix(remote, topic)
        self.db.delete_range(p, p[:-1] + b"\x01")
        st = self.lanes.pop((remote, topic), None)
        if st is not None:
            self.messages -= st.messages
            self.bytes -= st.bytes

    # Small state beside the copies (b"m" keys sort after every copy key) ----------------------

    def get_meta(self, name: str) -> bytes | None:
        return self.db.get(b"m" + name.encode())

    def put_meta(self, name: str, value: bytes) -> None:
        self.db.put(b"m" + name.encode(), value, self._nosync)

    # Reading --------------------------------------------------------------------------------

    def read_lane(self, remote: str, topic: str, after_seq: int, limit: int) -> list[tuple[int, bytes]]:
        """Up to ``limit`` copies of a lane with a sequence above ``after_seq``, in order."""
        p = lane_prefix(remote, topic)
        out: list[tuple[int, bytes]] = []
        for key, value in self._iter_from(p + _SEQ.pack(after_seq + 1 if after_seq >= 0 else 0), p):
            out.append((_SEQ.unpack(key[-8:])[0], value))
            if len(out) >= limit:
                break
        return out

    def oldest_ms(self, remote: str, topic: str) -> int | None:
        """Creation time of the lane's first stored copy (one seek)."""
        p = lane_prefix(remote, topic)
        for _key, value in self._iter_from(p, p):
            return created_ms_of(value)
        return None

    def scan(self) -> Iterator[tuple[str, str, int, bytes]]:
        """Every stored copy, lane by lane, in order."""
        for key, value in self._iter_from(LANE_PREFIX):
            remote, topic, seq = split_key(key)
            yield remote, topic, seq, value

    def stats(self) -> list[dict[str, object]]:
        """Backlog per lane: messages, bytes, age of the oldest copy in seconds."""
        now = time.time() * 1000
        out = []
        for (remote, topic), st in sorted(self.lanes.items()):
            oldest = self.oldest_ms(remote, topic)
            out.append(
                {
                    "remote": remote,
                    "topic": topic,
                    "messages": st.messages,
                    "bytes": st.bytes,
                    "oldest_age_s": round(max(0.0, (now - oldest) / 1000), 3) if oldest is not None else None,
                }
            )
        return out

    def close(self) -> None:
        try:
            self.db.close()
        finally:
            if self._secondary_dir is not None:
                self._secondary_dir.cleanup()

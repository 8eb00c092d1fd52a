"""Group commit: concurrent producers' copies become one synced RocksDB write.

A producer's greenlet calls :meth:`GroupCommitter.commit` (or :meth:`~GroupCommitter.enqueue` now
and :meth:`~GroupCommitter.wait` later); the copies get their sequence
numbers at once (so keys follow arrival order) and join the pending batch; the greenlet then
waits.  One committer greenlet takes everything pending, writes it as one unsynced ``WriteBatch``
and then syncs the write-ahead log with ``flush_wal(sync=True)`` in a native thread, and wakes
every waiter.  The sync is not asked of the write itself: rocksdict holds the GIL through a
synced write, so every greenlet of the worker would stop for the whole fsync; ``flush_wal`` lets
the GIL go, and the hub keeps serving other connections meanwhile.  While one fsync runs,
the next batch fills, so under concurrency there are many messages per fsync; a lone producer
pays one fsync per message, as it must.
"""

from __future__ import annotations

import logging

import gevent
import gevent.event
from gevent.event import Event

from rmqfast.log import ctx
from rmqfast.spill.store import SpillStore

log = logging.getLogger("rmqfast.spill")


class SpillFull(RuntimeError):
    """The spill reached ``replicate.disk_cap_bytes`` and the policy is ``reject``."""


class CommitFailed(RuntimeError):
    """The synced write failed: the copies were not stored (the caller must not acknowledge them)."""


class _Batch:
    __slots__ = ("items", "done", "error")

    def __init__(self) -> None:
        self.items: list[tuple[str, str, int, bytes]] = []
        self.done = Event()
        self.error: BaseException | None = None


class GroupCommitter:
    def __init__(self, store: SpillStore) -> None:
        self.store = store
        self._pending = _Batch()
        self._wake = Event()
        self._closed = False
        self.batches = 0
        self._greenlet = gevent.spawn(self._run)

    def commit(self, items: list[tuple[str, str, bytes]]) -> list[int]:
        """Store ``(remote, topic, value)`` copies durably; returns their sequence numbers.

        Raises :class:`CommitFailed` when RocksDB refused the write.
        """
        seqs = [self.store.next_seq() for _ in items]
        self.commit_seqs([(r, t, s, v) for (r, t, v), s in zip(items, seqs, strict=True)])
        return seqs

    def commit_seqs(self, items: list[tuple[str, str, int, bytes]]) -> None:
        """Like :meth:`commit` for copies whose sequence numbers the caller took already
        (:meth:`SpillStore.next_seq`), so it can register them before waiting."""
        self.wait(self.enqueue(items))

    def enqueue(self, items: list[tuple[str, str, int, bytes]]) -> _Batch:
        """Add copies to the next synced batch without waiting; :meth:`wait` on the result later.

        This lets the proxy forward a send at once and hold only its *answer* until the copy is
        synced, so the sends one connection pipelines share an fsync too.
        """
        if self._closed:
            raise CommitFailed("the spill committer is closed (the worker is stopping)")
        batch = self._pending
        batch.items.extend(items)
        self.store.reserved += self.store.size_of(items)
        self._wake.set()
        return batch

    def wait(self, batch: _Batch) -> None:
        """Block this greenlet until ``batch`` is synced; :class:`CommitFailed` if it was not."""
        batch.done.wait()
        if batch.error is not None:
            raise CommitFailed(f"synced spill write to {self.store.path} failed: {batch.error}") from batch.error

    def _run(self) -> None:
        pool = gevent.get_hub().threadpool
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            batch = self._pending
            if not batch.items:
                continue
            self._pending = _Batch()
            try:
                self.store.write_unaccounted(batch.items, sync=False)  # the memtable and the WAL buffer
                pool.apply(self.store.sync_wal)  # the fsync, off the GIL: the copies are durable after it
                self.store.reserved -= self.store.size_of(batch.items)
                self.store.account(batch.items, sync=True)
                self.batches += 1
            except Exception as exc:  # disk full, I/O error: every waiter hears it
                self.store.reserved -= self.store.size_of(batch.items)
                log.error("synced spill write failed", extra=ctx(error=str(exc), path=str(self.store.path)))
                batch.error = exc
            batch.done.set()

    @property
    def messages_per_fsync(self) -> float:
        return self.store.synced_messages / self.store.fsyncs if self.store.fsyncs else 0.0

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._greenlet.join(timeout=5)
        batch = self._pending
        if batch.items:  # a graceful stop still stores what was queued
            self.store.reserved -= self.store.size_of(batch.items)
            try:
                self.store.write(batch.items, sync=True)
            except Exception as exc:
                batch.error = exc
            batch.done.set()

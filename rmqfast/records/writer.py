"""Rotating record files written off the hot path.

The caller (a gevent worker) only appends tuples to an in-memory list.  Full batches go
through a bounded queue to one background thread, which encodes them and appends them to
the open file.  A file is written under a hidden temporary name (``.NAME.tmp``: Spark and
Hadoop skip names that start with ``.`` or ``_``) and renamed to its final name when it is
closed, so readers never see half a file; a crash leaves at most one ``.tmp`` file per
writer, which the Spark job reports as incomplete and skips.

Rotation: a file is closed when it has been open ``rotate_seconds``, or when it reaches
``rotate_bytes`` (checked after each batch, so a file can exceed it by one batch).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from rmqfast.log import ctx
from rmqfast.records.parquet import Column, ParquetWriter

log = logging.getLogger("rmqfast.records")

FORMATS = ("parquet", "jsonl")
SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl"}


class _OpenFile:
    def __init__(self, final: Path, tmp: Path, f: IO[bytes], pq: ParquetWriter | None) -> None:
        self.final = final
        self.tmp = tmp
        self.f = f
        self.pq = pq
        self.opened = time.monotonic()
        self.rows = 0
        self.bytes = 0


class RotatingWriter:
    """One stream of records (one schema) for one worker.

    ``add(row)`` appends a tuple in column order; ``tick()`` (once a second) hands the
    buffer to the writer thread when a batch is full or the file is due to rotate;
    ``close()`` writes everything and renames the last file.
    """

    def __init__(self, directory: str | os.PathLike[str], prefix: str, columns: Sequence[Column], *,
                 fmt: str = "parquet", rotate_seconds: float = 60.0, rotate_bytes: int = 64 << 20,
                 batch_rows: int = 65536, metadata: dict[str, str] | None = None, codec: str = "gzip",
                 max_queued: int = 16) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"records.format: {fmt!r} is not allowed; expected one of {', '.join(FORMATS)}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.columns = list(columns)
        self.names = [c.name for c in self.columns]
        self.fmt = fmt
        self.rotate_seconds = rotate_seconds
        self.rotate_bytes = rotate_bytes
        self.batch_rows = batch_rows
        self.metadata = dict(metadata or {})
        self.codec = codec
        self.rows: list[tuple] = []
        self.first_row_at = 0.0
        self.dropped = 0
        self.files_written: list[Path] = []
        self.rows_written = 0
        self.errors = 0
        self._seq = 0
        self._open: _OpenFile | None = None  # owned by the thread
        self._q: queue.Queue[tuple[list[tuple], bool] | None] = queue.Queue(max_queued)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"records-{prefix}", daemon=True)
        self._thread.start()
        self._closed = False

    # Caller side (worker loop) ----------------------------------------------------------

    def add(self, row: tuple) -> None:
        if not self.rows:
            self.first_row_at = time.monotonic()
        self.rows.append(row)
        if len(self.rows) >= self.batch_rows:
            self._submit(rotate=False)

    def tick(self) -> None:
        """Once a second: rotate when the open (or buffered) file is old enough."""
        now = time.monotonic()
        f = self._open  # read without the thread's cooperation: at worst one tick late
        if (self.rows and now - self.first_row_at >= self.rotate_seconds) or (
            f is not None and now - f.opened >= self.rotate_seconds
        ):
            self._submit(rotate=True)

    def flush(self) -> None:
        """Write what is buffered and close the current file (it becomes visible)."""
        self._submit(rotate=True)

    def _submit(self, rotate: bool) -> None:
        rows, self.rows = self.rows, []
        self._put((rows, rotate))

    def _put(self, item: tuple[list[tuple], bool]) -> None:
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self.dropped += len(item[0])
            if self.dropped == len(item[0]) or self.dropped % 100000 < len(item[0]):
                log.warning("record writer is behind; records dropped",
                            extra=ctx(stream=self.prefix, dropped_total=self.dropped))

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._submit(rotate=True)
        self._q.put(None)
        self._thread.join(timeout)

    # Writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            rows, rotate = item
            try:
                if rows:
                    self._write(rows)
                f = self._open
                if f is not None and (rotate or f.bytes >= self.rotate_bytes
                                      or time.monotonic() - f.opened >= self.rotate_seconds):
                    self._finish()
            except Exception:  # disk full, directory removed...: count, log, carry on
                self.errors += 1
                log.exception("writing records failed", extra=ctx(stream=self.prefix, dir=str(self.dir)))
                self._abandon()

    def _new_file(self) -> _OpenFile:
        self._seq += 1
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
        name = f"{self.prefix}-{stamp}-{os.getpid()}-{self._seq:05d}{SUFFIX[self.fmt]}"
        final = self.dir / name
        tmp = self.dir / f".{name}.tmp"
        f = open(tmp, "wb")
        pq = ParquetWriter(f, self.columns, codec=self.codec, metadata=self.metadata) if self.fmt == "parquet" else None
        return _OpenFile(final, tmp, f, pq)

    def _write(self, rows: list[tuple]) -> None:
        f = self._open
        if f is None:
            f = self._open = self._new_file()
        if f.pq is not None:
            cols = list(zip(*rows, strict=True))
            f.pq.write_row_group(dict(zip(self.names, cols, strict=True)))
            f.bytes = f.pq.bytes_written
        else:
            names = self.names
            data = "".join(json.dumps(dict(zip(names, r, strict=True)), separators=(",", ":")) + "\n" for r in rows)
            b = data.encode()
            f.f.write(b)
            f.bytes += len(b)
        f.rows += len(rows)

    def _finish(self) -> None:
        f = self._open
        if f is None:
            return
        self._open = None
        if f.pq is not None:
            f.pq.close()
        f.f.flush()
        os.fsync(f.f.fileno())
        f.f.close()
        os.replace(f.tmp, f.final)
        with self._lock:
            self.files_written.append(f.final)
            self.rows_written += f.rows

    def _abandon(self) -> None:
        f = self._open
        self._open = None
        if f is not None:
            try:
                f.f.close()
            except OSError:
                pass


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of one JSON-lines record file (tests and debugging)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]

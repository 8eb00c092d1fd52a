"""The releaser's connection to a broker: pipelined sends, answers matched by opaque.

Releases are written with ``ROCKETMQ`` (binary) headers: the broker answers in the serialize
type of the request (``response.setSerializeTypeCurrentRPC(cmd.getSerializeTypeCurrentRPC())``
in apache/rocketmq ``NettyRemotingAbstract``), so neither side quotes or parses JSON, and the
reader takes the answer's code, opaque and flag at their fixed offsets.  A JSON answer (a
broker that answers otherwise) is decoded in full.  Many sends are written with one
``sendall`` and stay in flight together; each has an :class:`~gevent.event.AsyncResult` that
receives ``(code, remark)``.
"""

from __future__ import annotations

import itertools
import re
import struct
from collections.abc import Callable
from typing import Any

import gevent
from gevent.event import AsyncResult
from gevent.lock import Semaphore

from rmqfast.clouds.remoting import CLIENT_VERSION, RemoteError, open_socket
from rmqfast.codec.codes import FLAG_RESPONSE, SERIALIZE_ROCKETMQ
from rmqfast.codec.command import decode_frame
from rmqfast.spill.record import CopyRecord

_HEAD = struct.Struct(">iI")  # frame length, serialize type << 24 | header length
_FIXED = struct.Struct(">hBhiii")  # code, language, version, opaque, flag, remark length
_ANSWER = struct.Struct(">iIhBhiii")  # the two above, read at once from an answer
_JSON_CODE = re.compile(rb'"code":(-?[0-9]{1,10})[,}]')
_JSON_FLAG = re.compile(rb'"flag":([0-9]{1,10})[,}]')
_JSON_OPAQUE = re.compile(rb'"opaque":(-?[0-9]{1,10})[,}]')
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_KEYS = {k: _I16.pack(1) + k.encode() for k in "abcdefghijklmn"}
SEND_MESSAGE_V2 = 310
SEND_BATCH_MESSAGE = 320


def _field(key: str, value: bytes) -> bytes:
    return _KEYS[key] + _I32.pack(len(value)) + value


def release_frame(rec: CopyRecord, opaque: int) -> bytes:
    """The SEND_MESSAGE_V2 (SEND_BATCH_MESSAGE for a batch) frame of a release: the producer's
    header fields (as :func:`rmqfast.deliver.sender.build_request` makes them), ROCKETMQ header."""
    props = rec.properties.encode("utf-8", "replace")
    ext = b"".join((
        _field("a", (rec.producer_group or "RMQFAST_DELIVER").encode("utf-8", "replace")),
        _field("b", rec.topic.encode("utf-8", "replace")),
        _field("c", b"TBW102"), _field("d", b"4"),
        _field("e", b"%d" % rec.queue_id), _field("f", b"%d" % rec.sys_flag),
        _field("g", b"%d" % rec.born_timestamp), _field("h", b"%d" % rec.flag),
        _field("i", props), _field("j", b"%d" % rec.reconsume_times), _field("k", b"false"),
        _field("l", b"%d" % rec.max_reconsume_times), _field("m", b"true" if rec.is_batch else b"false"),
        _field("n", rec.broker_name.encode("utf-8", "replace")) if rec.broker_name else b"",
    ))
    code = SEND_BATCH_MESSAGE if rec.is_batch else SEND_MESSAGE_V2
    header = _FIXED.pack(code, 0, CLIENT_VERSION, opaque, 0, 0) + _I32.pack(len(ext)) + ext
    return b"".join((_HEAD.pack(4 + len(header) + len(rec.body), (SERIALIZE_ROCKETMQ << 24) | len(header)),
                     header, rec.body))


def parse_answer(frame: bytes) -> tuple[int, int, int, str]:
    """(opaque, flag, code, remark) of a whole frame (length word included)."""
    _n, mark, code, _lang, _ver, opaque, flag, rlen = _ANSWER.unpack_from(frame, 0)
    if mark >> 24 == SERIALIZE_ROCKETMQ:
        remark = frame[25 : 25 + rlen].decode("utf-8", "replace") if rlen > 0 else ""
        return opaque, flag, code, remark
    # JSON: a SUCCESS needs no more than its code, flag and opaque, found as unquoted integers
    # after their keys (a quote inside a JSON string is always escaped, and every extFields
    # value is a string, so these can only be the top-level fields); anything else is decoded.
    header = frame[8 : 8 + (mark & 0xFFFFFF)]
    c, f, o = _JSON_CODE.search(header), _JSON_FLAG.search(header), _JSON_OPAQUE.search(header)
    if c is not None and f is not None and o is not None and c.group(1) == b"0":
        return int(o.group(1)), int(f.group(1)), 0, ""
    cmd = decode_frame(frame)
    return cmd.opaque, cmd.flag, cmd.code, cmd.remark or ""


class ReleaseChannel:
    """One connection to ``addr`` ("host:port") for releases; used by many lanes at once."""

    _opaques = itertools.count(1)

    def __init__(self, addr: str, *, connect_timeout: float = 3.0, wrap: Callable[[Any, str], Any] | None = None
                 ) -> None:
        self.addr = addr
        self.sock = open_socket(addr, connect_timeout, wrap)  # wrap: TLS to the broker ([tls.upstream])
        self.closed = False
        self._pending: dict[int, AsyncResult] = {}
        self._lock = Semaphore()
        self._reader = gevent.spawn(self._read_loop)

    def _read_loop(self) -> None:
        buf = b""
        error: Exception = RemoteError(f"connection to {self.addr} closed by the remote side")
        pending = self._pending
        try:
            while True:
                chunk = self.sock.recv(1 << 18)
                if not chunk:
                    break
                buf = buf + chunk if buf else chunk
                pos, end = 0, len(buf)
                while end - pos >= 4:
                    (n,) = _I32.unpack_from(buf, pos)
                    if n < 21:  # shorter than any answer's header
                        raise RemoteError(f"frame length {n} at an answer's start")
                    if end - pos < 4 + n:
                        break
                    opaque, flag, code, remark = parse_answer(buf[pos : pos + 4 + n])
                    pos += 4 + n
                    if flag & FLAG_RESPONSE:
                        w = pending.pop(opaque, None)
                        if w is not None:
                            w.set((code, remark))
                buf = buf[pos:]
        except Exception as exc:  # socket errors, undecodable frames
            error = RemoteError(f"connection to {self.addr} failed: {exc}")
        finally:
            self.closed = True
            for w in pending.values():
                w.set_exception(error)
            pending.clear()
            try:
                self.sock.close()
            except OSError:
                pass

    def send(self, records: list[CopyRecord]) -> list[AsyncResult]:
        """Write the releases of ``records`` in one ``sendall``; a waiter per record, in order.
        Raises :class:`RemoteError` when the connection is closed or the write fails."""
        if self.closed:
            raise RemoteError(f"connection to {self.addr} is closed")
        waiters: list[AsyncResult] = []
        frames = []
        opaques = []
        for rec in records:
            opaque = next(self._opaques) & 0x7FFFFFFF
            w: AsyncResult = AsyncResult()
            self._pending[opaque] = w
            waiters.append(w)
            opaques.append(opaque)
            frames.append(release_frame(rec, opaque))
        try:
            with self._lock:
                self.sock.sendall(b"".join(frames))
        except OSError as exc:
            for o in opaques:
                self._pending.pop(o, None)
            self.close()
            raise RemoteError(f"cannot send {len(frames)} releases to {self.addr}: {exc}") from exc
        return waiters

    def forget(self, waiter: Any) -> None:
        """Drop a waiter that timed out (its answer, if it comes, is ignored)."""
        for o, w in list(self._pending.items()):
            if w is waiter:
                del self._pending[o]
                return

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

"""The releaser's connection to a broker: pipelined sends, answers matched by opaque.

Releases are written with ``ROCKETMQ`` (binary) headers: the broker answers in the serialize
type of the request (``response.setSerializeTypeCurrentRPC(cmd.getSerializeTypeCurrentRPC())``
in apache/rocketmq ``NettyRemotingAbstract``), so neither side quotes or parses JSON, and the
reader takes the answer's code, opaque and flag at their fixed offsets.  A JSON answer (a
broker that answers otherwise) is decoded in full.  The releases the lanes queue in one turn
of the event loop go out in one write and stay in flight together; each group a lane queues
has one :class:`Sent`, whose ``codes`` fill as the answers come and whose ``done`` is set once
all are in (one wake-up per group, not per message).
"""

from __future__ import annotations

import itertools
import re
import struct
from collections.abc import Callable
from typing import Any

import gevent
from gevent.event import Event

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


_CD = _field("c", b"TBW102") + _field("d", b"4")
_K = _field("k", b"false")
_M = (_field("m", b"false"), _field("m", b"true"))


def release_frame(rec: CopyRecord, opaque: int) -> bytes:
    """The SEND_MESSAGE_V2 (SEND_BATCH_MESSAGE for a batch) frame of a release: the producer's
    header fields (as :func:`rmqfast.clouds.send.build_request` makes them, in the order
    a .. n), ROCKETMQ header."""
    i32 = _I32.pack
    a = (rec.producer_group or "RMQFAST_DELIVER").encode("utf-8", "replace")
    b = rec.topic.encode("utf-8", "replace")
    e = b"%d" % rec.queue_id
    f = b"%d" % rec.sys_flag
    g = b"%d" % rec.born_timestamp
    h = b"%d" % rec.flag
    i = rec.properties.encode("utf-8", "replace")
    j = b"%d" % rec.reconsume_times
    m = b"%d" % rec.max_reconsume_times
    n = rec.broker_name.encode("utf-8", "replace")
    ext = b"".join((
        b"\x00\x01a", i32(len(a)), a, b"\x00\x01b", i32(len(b)), b, _CD,
        b"\x00\x01e", i32(len(e)), e, b"\x00\x01f", i32(len(f)), f, b"\x00\x01g", i32(len(g)), g,
        b"\x00\x01h", i32(len(h)), h, b"\x00\x01i", i32(len(i)), i, b"\x00\x01j", i32(len(j)), j, _K,
        b"\x00\x01l", i32(len(m)), m, _M[rec.is_batch],
        b"\x00\x01n" + i32(len(n)) + n if n else b"",
    ))
    batch = rec.is_batch
    hlen = _FIXED.size + 4 + len(ext)
    return b"".join((_HEAD.pack(4 + hlen + len(rec.body), (SERIALIZE_ROCKETMQ << 24) | hlen),
                     _FIXED.pack(SEND_BATCH_MESSAGE if batch else SEND_MESSAGE_V2, 0, CLIENT_VERSION, opaque, 0, 0),
                     i32(len(ext)), ext, rec.body))


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


class Sent:
    """The answers to releases written together: ``codes[i]`` is the broker's answer code to the
    i-th (None until answered); ``done`` is set when every one is answered or the connection
    failed (``error``)."""

    __slots__ = ("codes", "left", "done", "error", "opaques", "deadline")

    def __init__(self, n: int) -> None:
        self.codes: list[int | None] = [None] * n
        self.left = n
        self.done = Event()
        self.error: Exception | None = None
        self.opaques: list[int] = []
        self.deadline = 0.0


class ReleaseChannel:
    """One connection to ``addr`` ("host:port") for releases; used by many lanes at once."""

    _opaques = itertools.count(1)

    def __init__(self, addr: str, *, connect_timeout: float = 3.0, wrap: Callable[[Any, str], Any] | None = None
                 ) -> None:
        self.addr = addr
        self.sock = open_socket(addr, connect_timeout, wrap)  # wrap: TLS to the broker ([tls.upstream])
        self.closed = False
        self._pending: dict[int, tuple[Sent, int]] = {}
        self._out: list[bytes] = []  # frames written by the lanes, not yet sent
        self._more = Event()
        self._reader = gevent.spawn(self._read_loop)
        self._writer = gevent.spawn(self._write_loop)

    def _read_loop(self) -> None:
        buf = b""
        error: Exception = RemoteError(f"connection to {self.addr} closed by the remote side")
        pending = self._pending
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
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
                    opaque, flag, code, _remark = parse_answer(buf[pos : pos + 4 + n])
                    pos += 4 + n
                    if flag & FLAG_RESPONSE:
                        entry = pending.pop(opaque, None)
                        if entry is not None:
                            sent, i = entry
                            sent.codes[i] = code
                            sent.left -= 1
                            if sent.left == 0:
                                sent.done.set()
                buf = buf[pos:]
        except Exception as exc:  # socket errors, undecodable frames
            error = RemoteError(f"connection to {self.addr} failed: {exc}")
        finally:
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        """The connection is gone: every release not answered yet hears it."""
        self.closed = True
        self._more.set()
        for sent, _i in self._pending.values():
            sent.error = error
            sent.done.set()
        self._pending.clear()
        self._out.clear()
        try:
            self.sock.close()
        except OSError:
            pass

    def _write_loop(self) -> None:
        """Write what the lanes queued, all of it in one write: the lanes that fall due in the
        same turn of the event loop share a write (and the broker a read)."""
        out = self._out
        while not self.closed:
            self._more.wait()
            self._more.clear()
            if not out or self.closed:
                continue
            view = memoryview(b"".join(out))
            out.clear()
            try:
                while view:  # send (not sendall: no socket option read per write); waits when full
                    view = view[self.sock.send(view) :]
            except OSError as exc:
                self._fail(RemoteError(f"cannot send releases to {self.addr}: {exc}"))

    def send(self, records: list[CopyRecord]) -> Sent:
        """Queue the releases of ``records`` for the channel's next write; their answers come in
        one :class:`Sent` (a failed connection fails it).  Raises :class:`RemoteError` when the
        connection is closed."""
        if self.closed:
            raise RemoteError(f"connection to {self.addr} is closed")
        sent = Sent(len(records))
        pending = self._pending
        out = self._out
        for i, rec in enumerate(records):
            opaque = next(self._opaques) & 0x7FFFFFFF
            pending[opaque] = (sent, i)
            sent.opaques.append(opaque)
            out.append(release_frame(rec, opaque))
        self._more.set()
        return sent

    def forget(self, sent: Sent) -> None:
        """Drop the waiters of releases not answered in time (their answers, if they come, are ignored)."""
        for o in sent.opaques:
            self._pending.pop(o, None)

    def close(self) -> None:
        self.closed = True
        self._more.set()
        try:
            self.sock.close()
        except OSError:
            pass

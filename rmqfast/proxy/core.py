"""The decisions of a relay session, without sockets (sans-IO).

:class:`SessionCore` is what a session decides once the scanner has handed it a whole frame:
it runs the filter chain, carries out the verdict (relay, relay rewritten, answer locally,
drop, close), times the requests it relays, keeps the answers the proxy makes itself until
the stream they go into is at a frame boundary, and counts what a drain waits for.  It writes
only through :class:`Writer` objects (one per destination: the socket's ordered writer), so a
unit test drives it with frames and writers that record what was written where
(tests/test_session_core.py); :class:`rmqfast.proxy.relay.Session` adds the sockets and the
pumps.

The pumps call :meth:`SessionCore.policy` only for frames the scanner handed over (EV_POLICY):
frames relayed by the compiled pump never reach Python.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from typing import Any

from rmqfast.codec import code_slot
from rmqfast.codec import codes as C
from rmqfast.codec.command import decode_frame
from rmqfast.codec.tables import R_ONEWAY, result_index
from rmqfast.filters.api import PASS, FilterChain, Frame, Kind, Verdict
from rmqfast.log import ctx

log = logging.getLogger("rmqfast.relay")

#: Bytes of answers the proxy made itself that one stream may hold back for its next frame boundary
#: (a client that stops reading keeps the stream to it mid-frame while its requests go on being
#: answered locally); past it the connection closes.
MAX_HELD_ANSWERS = 4 << 20


class PumpState:
    """What a pump shows the writer of its destination (the C Pump has the same attributes;
    the Python pump and tests use this one)."""

    __slots__ = ("at_boundary", "hold", "stalled_since")

    def __init__(self) -> None:
        self.at_boundary = True  # the bytes written to the destination end at a frame boundary
        self.hold = False  # a local answer waits for the next boundary
        self.stalled_since = 0  # monotonic ns of the last receive while mid-frame (0: not mid-frame)


class Writer:
    """The one writer of a destination: the pump that forwards into it (``pump``), plus the
    answers the proxy makes itself (NO_PERMISSION, SYSTEM_BUSY, shaped SUCCESS...) waiting in
    ``queue`` for a frame boundary of that forwarded stream.  :meth:`write` writes whole; the
    relay's socket writer blocks the calling greenlet until it is written."""

    __slots__ = ("pump", "queue", "held")

    def __init__(self) -> None:
        self.pump: Any = None  # a C Pump or a PumpState, once the pump runs
        self.held = 0  # bytes in ``queue`` (bounded by MAX_HELD_ANSWERS)
        # (frame, answers a client request?); no answer waiting is one shared empty tuple, not a
        # deque per writer (~760 bytes each, two per connection): a deque is made for the first answer
        self.queue: deque[tuple[bytes, bool]] | tuple[()] = ()

    def write(self, data: Any) -> None:
        raise NotImplementedError

    def at_boundary(self) -> bool:
        return self.pump is None or bool(self.pump.at_boundary)

    def write_at_boundary(self, data: Any) -> bool:
        """Write a frame the proxy made itself at the boundary the caller found; False when the
        stream left that boundary before the write could start (the caller queues it instead)."""
        self.write(data)
        return True


class SessionCore:
    """A client connection and its upstream connection, as the filters and the drain see them.

    ``to_client`` and ``to_upstream`` are the two writers (set by whoever does the I/O);
    ``c2u``/``u2c`` the two scanners and ``inflight`` their shared in-flight table.
    """

    def __init__(self, role: str, client_addr: str, chain: FilterChain, stats: Any) -> None:
        self.role = role
        self.client_addr = client_addr
        self.upstream_addr = ""
        self.chain = chain
        self.stats = stats
        self._state: dict[str, Any] | None = None  # ``state``, once a filter keeps something
        self.closed = False
        self.c2u: Any = None
        self.u2c: Any = None
        self.inflight: Any = None  # requests awaiting answers, shared by c2u and u2c (timing, results)
        self.to_client: Writer | None = None
        self.to_upstream: Writer | None = None
        self.local_answers = 0  # client requests answered (or dropped) by the proxy, answers written
        self.answers_overflow = False  # more answers waited for a frame boundary than MAX_HELD_ANSWERS

    @property
    def state(self) -> dict[str, Any]:
        """The filters' per-connection state (made on first use: most connections never need one)."""
        st = self._state
        if st is None:
            st = self._state = {}
        return st

    @state.setter
    def state(self, value: dict[str, Any]) -> None:
        self._state = value

    # Frames the scanner handed over ---------------------------------------------------------

    def policy(self, out: Writer, frame: Frame, from_client: bool) -> bool:
        """A whole frame for the policy, read by the pump that writes to ``out``, whose stream
        is at a frame boundary; False when the connection must be closed."""
        if out.queue:
            self.flush_answers(out)  # at a boundary: answers queued earlier go first
        try:
            if frame.flag & C.FLAG_RESPONSE:
                verdict = self.chain.on_response(self, frame)
            elif from_client:
                verdict = self.chain.on_request(self, frame)
            else:  # requests from the broker to the client (39, 40, 307, 309...) are always relayed
                verdict = PASS
        except OSError:
            raise  # the relay's own end of a connection
        except Exception as exc:  # a frame a filter cannot handle: only this connection ends, logged once
            log.warning(
                "filter failed on a frame; closing connection",
                extra=ctx(role=self.role, client=self.client_addr, code=frame.code, flag=frame.flag,
                          error=f"{type(exc).__name__}: {exc}"[:300]),
                exc_info=not isinstance(exc, RecursionError),
            )
            return False
        return self.apply(verdict, frame, out, from_client)

    def apply(self, verdict: Verdict, frame: Frame, out: Writer, from_client: bool) -> bool:
        """Carry out a verdict on ``frame`` (``out``: where it was going); False: close."""
        kind = verdict.kind
        request = not frame.flag & C.FLAG_RESPONSE
        if kind is Kind.PASS or kind is Kind.REWRITE:
            if request:
                self.track(frame, 0 if from_client else 1)
            # the pump forwarding into out is at a frame boundary: a whole-frame write
            out.write(frame.data if kind is Kind.PASS else verdict.data)
        elif kind is Kind.REPLY:
            self._reply(verdict.data, frame, request, from_client)
            if self.answers_overflow:
                return False
        elif kind is Kind.CLOSE:
            log.warning(
                "policy closed connection", extra=ctx(role=self.role, client=self.client_addr, reason=verdict.reason)
            )
            return False
        elif request and from_client:  # DIVERT: a filter owns the frame; no answer will come from upstream
            if frame.is_oneway:
                self.stats.count_result(code_slot(frame.code), R_ONEWAY)
            else:
                self.local_answers += 1
        return True

    def _reply(self, data: bytes, frame: Frame, request: bool, from_client: bool) -> None:
        """The answer goes back to where the frame came from."""
        back = self.to_client if from_client else self.to_upstream
        if back is None:
            raise OSError(errno.EBADF, "connection closed by the other side of the relay")
        if request:
            answered = decode_frame(data).code  # replies are rare and small
            self.stats.count_result(code_slot(frame.code), result_index(answered))
        self.answer(back, data, request and from_client and not frame.is_oneway)

    def track(self, frame: Frame, direction: int) -> None:
        """A policy request is forwarded: time it like the scanner times the others."""
        slot = code_slot(frame.code)
        if frame.is_oneway:
            self.stats.count_result(slot, R_ONEWAY)
        elif self.inflight is not None and not self.inflight.track(
            direction, frame.opaque, slot, time.monotonic_ns(), len(frame.data), want=frame.want_response
        ):
            self.stats.untracked += 1

    # The ordered writers ----------------------------------------------------------------------

    def answer(self, out: Writer, data: bytes, request: bool) -> None:
        """A frame the proxy makes itself: written now if the stream to ``out`` is at a frame
        boundary, else queued for the next one (the pump writing there stops at it)."""
        if not out.queue and out.at_boundary() and out.write_at_boundary(data):
            if request:
                self.local_answers += 1
            return
        held = out.held + len(data)
        if held > MAX_HELD_ANSWERS:  # the stream stays mid-frame (a peer that stops reading): close
            if not self.answers_overflow:
                log.warning(
                    "answers held for a frame boundary exceed the bound; closing connection",
                    extra=ctx(role=self.role, client=self.client_addr, held_bytes=out.held, bound=MAX_HELD_ANSWERS),
                )
            self.answers_overflow = True
            return
        out.held = held
        q = out.queue if isinstance(out.queue, deque) else deque()
        out.queue = q
        q.append((data, request))
        if out.pump is not None:
            out.pump.hold = True

    def flush_answers(self, out: Writer) -> None:
        """Called by the pump writing to ``out`` when its stream is at a frame boundary."""
        q = out.queue
        while q:
            assert isinstance(q, deque)
            data, request = q.popleft()
            out.held -= len(data)
            out.write(data)
            if request:
                self.local_answers += 1
        if out.pump is not None:
            out.pump.hold = False

    # What a drain waits for -------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Client requests not completely answered yet (what a drain waits for).

        Requests the proxy answered itself count once their answer is written; a response
        counts as done when its last byte is written to the client, not when its header is
        scanned: while the client stream is in the middle of a frame (or answers wait to be
        written), at least 1 is reported so that a drain does not cut it.
        """
        if self.c2u is None or self.u2c is None or self.closed:
            return 0
        n = max(0, self.c2u.requests - self.local_answers - self.u2c.responses)
        out = self.to_client
        if out is not None and (out.queue or not out.at_boundary()):
            n += 1
        return n

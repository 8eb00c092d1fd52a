"""The pure-Python pump of a relay session: the same loop as the compiled pump
(:mod:`rmqfast.proxy.pump_c`), for the pure-Python scanner, for TLS connections, and as the
compiled pump's reference.

Each pump reads whole receive buffers (``recv_into`` a reusable buffer), lets the frame scanner
say how far the bytes may be forwarded unchanged, and forwards that span with one ``send``; only
frames a policy filter asked for become Python objects.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rmqfast import codec
from rmqfast.codec import EV_FORWARD, EV_POLICY, FrameScanner
from rmqfast.filters.api import Frame
from rmqfast.proxy import budget
from rmqfast.proxy.core import PumpState
from rmqfast.proxy.writer import raw_socket

if TYPE_CHECKING:
    from rmqfast.proxy.writer import Sock, SocketWriter


def skip_reader(scanner: Any) -> Callable[[Any], int]:
    """How to read a scanner's ``_skip`` (bytes of the current frame still to come)."""
    if codec.is_compiled(scanner):  # asks rmqfast.codec; never loads the extension itself
        from rmqfast._speedups import scanner_skip  # type: ignore[attr-defined]

        return scanner_skip  # type: ignore[no-any-return]
    return operator.attrgetter("_skip")


class PythonPumps:
    """The Python pump's half of :class:`rmqfast.proxy.relay.Session` (a mixin: the session's
    state lives in its slots)."""

    __slots__ = ()

    def _pump_py(
        self,
        src: Sock,
        dst: Sock,
        scanner: FrameScanner,
        side: str,
        out: SocketWriter,
        from_client: bool,
    ) -> None:
        """The same loop in Python, for the pure-Python scanner (and as the C pump's reference)."""
        state = PumpState()
        out.pump = state
        rb = RecvBuffer(self.settings.buffer_size)
        skip_of = skip_reader(scanner)
        wait = self.hub.wait
        rwatch = self._watcher(src, 0)
        raw = raw_socket(src)
        recv_into = raw.recv_into
        monotonic_ns = time.monotonic_ns
        heard = not from_client
        readable = True  # try a read before waiting for readiness
        try:
            while not self.closed:
                if state.hold and skip_of(scanner) == 0:
                    self.flush_answers(out)
                if not readable:
                    wait(rwatch)
                try:
                    n = recv_into(rb.view[rb.filled:])
                except BlockingIOError:
                    readable = False
                    continue
                if n == 0:
                    return
                # A short read drained the socket: wait for readiness first next time (saves a
                # failing recv per message when clients send one request at a time).
                readable = n == len(rb.buf) - rb.filled or getattr(raw, "eof_pending", False)
                now = monotonic_ns()
                self.last_activity = at = now / 1e9
                if heard:
                    self._heard = at
                state.stalled_since = 0
                rb.filled += n
                need = self._relay_received(rb, scanner, skip_of, out, from_client)
                if need is None:
                    return
                if need < 0:
                    self._protocol_error(side, scanner)
                    return
                if not rb.fit(need):
                    self._over_budget(side, need)
                    return
                if rb.filled or skip_of(scanner):
                    state.stalled_since = now
        finally:
            rb.release()

    def _relay_received(
        self, rb: RecvBuffer, scanner: FrameScanner, skip_of: Callable[[Any], int], out: SocketWriter, from_client: bool
    ) -> int | None:
        """Forward what the buffer holds up to the last frame boundary (whole policy frames
        through :meth:`policy`), keep the rest at its start.  Returns the bytes the scanner
        needs in the buffer next (0: any), -1 on a protocol error, None when policy closes."""
        state = out.pump
        buf, view, filled = rb.buf, rb.view, rb.filled
        write = out.write
        scan = scanner.scan
        start = pos = 0
        while True:
            end = filled
            if state.hold:  # a local answer waits: scan no further than the current frame
                skip = skip_of(scanner)
                if skip == 0:
                    self.flush_answers(out)
                elif pos + skip < filled:
                    end = pos + skip
            ev, a, b = scan(buf, pos, end)
            if a > start:
                state.at_boundary = False
                write(view[start:a])
                start = a
                state.at_boundary = skip_of(scanner) == 0
            if ev == EV_FORWARD:
                if end < filled and b == 0:
                    pos = a  # stopped at the end of a frame for a local answer: go on
                    continue
                rb.keep_from(start)
                return b
            if ev != EV_POLICY:
                return -1
            frame = Frame(bytes(view[a:b]), scanner.code, scanner.flag, scanner.opaque, scanner.limited,
                          scanner.records)
            if not self.policy(out, frame, from_client):
                return None
            start = pos = b



class RecvBuffer:
    """The Python pump's receive buffer: ``size`` bytes, grown (from the worker's budget.BUDGET) while
    a frame that must be read whole is larger, back to ``size`` as soon as the rest fits."""

    __slots__ = ("size", "buf", "view", "filled", "held")

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.filled = 0
        self.held = 0  # bytes of the buffer beyond ``size``, reserved from budget.BUDGET

    def keep_from(self, start: int) -> None:
        """Drop the bytes before ``start`` (forwarded); the rest moves to the front."""
        rest = self.filled - start
        if rest and start:
            self.buf[0:rest] = self.buf[start : self.filled]
        self.filled = rest

    def _replace(self, size: int) -> None:
        new = bytearray(size)
        new[0 : self.filled] = self.buf[0 : self.filled]
        self.view.release()
        self.buf = new
        self.view = memoryview(new)

    def fit(self, need: int) -> bool:
        """Size the buffer for a frame the scanner needs ``need`` bytes of; False: over budget."""
        if need > len(self.buf) and self.filled == len(self.buf):
            # A frame that needs policy (or a huge header) is larger than the buffer (the
            # scanner checked it against the frame limit already): grow as its bytes arrive,
            # so that memory and the budget follow what was received.
            grow_to = min(need, 2 * len(self.buf))
            if budget.BUDGET.used - self.held + (grow_to - self.size) > budget.BUDGET.limit:
                return False
            self._replace(grow_to)
            budget.BUDGET.used += grow_to - self.size - self.held
            self.held = grow_to - self.size
        elif self.held and self.filled <= self.size and need <= self.size:
            self._replace(self.size)  # back to the base size as soon as the rest fits
            budget.BUDGET.used -= self.held
            self.held = 0
        return True

    def release(self) -> None:
        self.view.release()
        budget.BUDGET.used -= self.held
        self.held = 0

"""Liveness of a relay session, as the control plane reads it: when bytes last came from the
upstream (broker health: hangs, :mod:`rmqfast.proxy.health`), how long the connection has been
idle, how long a peer has kept a frame half-sent, and the worker's sweep that closes idle,
silent and stalled connections (:func:`close_idle`).  Compiled pumps parked in the reactor note
their receives themselves; these readings take the later of theirs and the Python pumps'.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rmqfast.log import ctx
from rmqfast.proxy.core import PumpState

if TYPE_CHECKING:
    from rmqfast.proxy.relay import Session

log = logging.getLogger("rmqfast.relay")


class _Heard:
    """``Session.heard``, made when asked for (the failover sweep, for sessions with a send in
    flight): ``[0]`` is when bytes last came from the upstream (seconds, monotonic), the later of
    what the Python pumps stored and the last receive of the compiled pump reading the upstream
    (one parked in the reactor receives without Python); storing into ``[0]`` moves it on."""

    __slots__ = ("session",)

    def __init__(self, session: Session) -> None:
        self.session = session

    def __getitem__(self, i: int) -> float:
        return self.session.heard_at()

    def __setitem__(self, i: int, value: float) -> None:
        self.session._heard = value


_malloc_pinned = False

def close_idle(sessions: Any, limit: float, now: float | None = None,
               counted: Callable[[str, str], None] | None = None) -> int:
    """Close every session with no bytes received on either side for ``limit`` seconds, and
    every session whose peer stopped sending in the middle of a frame for longer than the
    ``frame_timeout`` of its settings (slowloris: a half-sent frame may hold a grown buffer).
    ``counted(role, reason)`` is told of each close (reason ``idle``, ``first_frame`` or
    ``frame_stalled``: the worker's ``rmqfast_deadline_closes_total``)."""
    now = time.monotonic() if now is None else now
    count = counted if counted is not None else _not_counted
    now_ns = int(now * 1e9)
    closed = 0
    for s in list(sessions):
        if s.closed:
            continue
        if s.idle_for(now) > limit:
            log.info("closing idle connection", extra=ctx(role=s.role, client=s.client_addr))
            s.close()
            count(s.role, "idle")
            closed += 1
            continue
        fft = s.settings.first_frame_timeout
        if fft > 0 and now - s.started > fft and not sent_a_frame(s):
            # half-open and slowloris clients: a connection that never sent a frame holds a cap's slot
            log.info("closing connection: no first frame in time",
                     extra=ctx(role=s.role, client=s.client_addr, first_frame_timeout=fft))
            s.close()
            count(s.role, "first_frame")
            closed += 1
            continue
        ft = s.settings.frame_timeout
        if ft > 0:
            side, stalled = s.stalled_for(now_ns)
            if stalled > ft:
                log.warning(
                    "closing connection: a frame stopped arriving",
                    extra=ctx(role=s.role, side=side, client=s.client_addr, seconds=round(stalled, 1),
                              frame_timeout=ft),
                )
                s.close()
                count(s.role, "frame_stalled")
                closed += 1
    return closed


def _not_counted(role: str, reason: str) -> None:
    pass


def sent_a_frame(s: Session) -> bool:
    """Has the client sent the head of a whole frame (a request or an answer) yet?  (Not judged
    while the session is still connecting upstream: ``connect_timeout`` bounds that.)"""
    c2u = s.c2u
    return c2u is None or c2u.requests > 0 or c2u.responses > 0



class SessionHealth:
    """The liveness readings of :class:`rmqfast.proxy.relay.Session` (a mixin: the session's
    state lives in its slots)."""

    __slots__ = ()

    @property
    def heard(self) -> _Heard:
        """``[0]``: when bytes last came from the upstream (see :class:`_Heard`)."""
        return _Heard(self)

    def heard_at(self) -> float:
        """When bytes last came from the upstream (seconds, monotonic)."""
        at = self._heard
        out = self.to_client  # the writer the upstream-reading pump forwards into
        pump = out.pump if out is not None else None
        if pump is not None and not isinstance(pump, PumpState):
            got = pump.last_receive / 1e9  # a compiled pump (-1 ns: nothing received yet)
            if got > at:
                return got
        return at

    @property
    def _parked(self) -> list[Any]:
        """The compiled pumps attached to the reactor (none once the session closed)."""
        if self._reactor is None or self.closed:
            return []
        return [out.pump for out in (self.to_client, self.to_upstream) if out is not None and out.pump is not None]

    def idle_for(self, now: float) -> float:
        last = self.last_activity
        for pump in self._parked:  # pumps in the reactor note their receives themselves
            got = pump.last_receive / 1e9
            if got > last:
                last = got
        return now - last

    def stalled_for(self, now_ns: int) -> tuple[str, float]:
        """(side, seconds) of the longest wait for the rest of a frame a peer started sending."""
        worst, side = 0.0, ""
        for name, sock in (("client", self.upstream), ("upstream", self.client)):  # the pump writing to sock
            out = self._out_of(sock)
            since = out.pump.stalled_since if out is not None and out.pump is not None else 0
            if since > 0 and (now_ns - since) / 1e9 > worst:
                worst, side = (now_ns - since) / 1e9, name
        return side, worst

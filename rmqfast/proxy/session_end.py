"""How a relay session ends: a direction's end ends the session, except when the client's
direction ended on a failed send to the upstream (the upstream-reading pump then relays what is
left and meets the end itself, bounded by ``UPSTREAM_END_WAIT``); the upstream ending first is
heard by the worker (broker health, answers for what is in flight: rmqfast.proxy.failover) before
the close; and the one log line for each way a connection ends.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING

import gevent

from rmqfast.codec import FrameScanner
from rmqfast.log import ctx
from rmqfast.proxy import budget
from rmqfast.proxy.core import PumpState

if TYPE_CHECKING:
    from rmqfast.proxy.writer import SocketWriter

log = logging.getLogger("rmqfast.relay")

#: After a send to the upstream failed, how long the session waits for the upstream-reading pump to
#: meet the end of the broken connection (milliseconds, normally) before it ends the session itself.
UPSTREAM_END_WAIT = 5.0


class SessionEnd:
    """The end of :class:`rmqfast.proxy.relay.Session`'s directions (a mixin: the session's state
    lives in its slots)."""

    __slots__ = ()

    def _ended_by(self, exc: OSError, side: str) -> None:
        if self.closed or exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.EBADF, errno.ENOTCONN, None):
            log.debug("connection ended", extra=ctx(role=self.role, side=side, client=self.client_addr,
                                                     error=str(exc)))
        else:
            log.info("connection error", extra=ctx(role=self.role, side=side, client=self.client_addr, error=str(exc)))

    def _forget_pump(self, out: SocketWriter) -> None:
        """The pump writing to ``out`` ended: its buffers (and budget share) go now, not when the
        session is collected; ``heard`` keeps the upstream pump's last receive, not the pump."""
        if out is self.to_client:
            self._heard = self.heard_at()
        out.pump = None

    def _direction_ended(self, out: SocketWriter | None, from_client: bool, waited_by_run: bool = False) -> None:
        """The pump forwarding into ``out`` ended: the session ends with it (after answering what
        is in flight when the upstream ended), unless the client's direction ended on a failed
        send to the upstream (:meth:`_await_upstream_end`)."""
        if from_client and out is not None and self._upstream_send_failed(out):
            self._await_upstream_end(out, waited_by_run)
            return
        if not from_client and not self.closed:
            self._upstream_lost()
        self.close()

    def _upstream_send_failed(self, out: SocketWriter) -> bool:
        """Whether the client's direction (forwarding into ``out``) ended because a send to the
        upstream failed: the broker's side broke (a reset, say), not the client's."""
        if self.closed or out is not self.to_upstream:
            return False
        pump = out.pump
        return out.failed or (pump is not None and not isinstance(pump, PumpState) and pump.send_failed)

    def _await_upstream_end(self, out: SocketWriter, waited_by_run: bool = False) -> None:
        """The client's direction ended on a failed send to the upstream.  Closing now would drop
        the answers the broker sent before it broke (still to be read) and the requests in flight
        (never answered: a client may wait out its whole timeout).  So only that direction ends:
        the upstream-reading pump relays what is left and meets the end itself, which answers what
        is still in flight (:meth:`_upstream_lost`) and closes.  Bounded by UPSTREAM_END_WAIT
        (``run`` waits for that pump itself when the client's direction ran in its greenlet)."""
        pump = out.pump
        if self._reactor is not None and pump is not None and not isinstance(pump, PumpState):
            self._reactor.detach(pump)  # the client's bytes are not read any more
        log.debug("send to the upstream failed; waiting for the upstream's end",
                  extra=ctx(role=self.role, client=self.client_addr, upstream=self.upstream_addr))
        if not waited_by_run:
            self._end_wait = gevent.spawn_later(UPSTREAM_END_WAIT, self._end_after_upstream_wait)

    def _end_after_upstream_wait(self) -> None:
        self._end_wait = None
        # The upstream pump did not end by itself: end the session as it would (unless its end is
        # under way: _upstream_lost may be waiting for resends, and closing now would drop them).
        if not self.closed and not self._lost:
            self._upstream_lost()
            self.close()

    def _upstream_lost(self) -> None:
        """The upstream connection ended first: the worker hears of it (broker health) and may answer
        the client's requests still waiting (rmqfast.proxy.failover.answer_in_flight) before the close."""
        if self._lost:
            return
        self._lost = True
        hook = getattr(self.events, "upstream_lost", None)
        if hook is None:
            return
        try:
            hook(self)
        except Exception:  # bookkeeping must never break the close
            log.exception("upstream_lost hook failed", extra=ctx(role=self.role, client=self.client_addr))

    def _protocol_error(self, side: str, scanner: FrameScanner) -> None:
        # One log line (the scanner counted it); only this connection closes.
        log.warning(
            "protocol error; closing connection",
            extra=ctx(role=self.role, side=side, client=self.client_addr, upstream=self.upstream_addr,
                      error=scanner.error),
        )

    def _over_budget(self, side: str, need: int) -> None:
        log.warning(
            "frame too large for the worker's buffer budget; closing connection",
            extra=ctx(role=self.role, side=side, client=self.client_addr, frame_bytes=need,
                      budget=budget.BUDGET.limit, in_use=budget.BUDGET.used,
                      hint="frames that policy reads whole (admin codes, limited sends, batches) are held in "
                           "memory; raise proxy.buffer_budget if legitimate clients send frames this large"),
        )

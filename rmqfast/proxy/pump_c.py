"""The compiled pump driver of a relay session: ``_speedups.Pump`` receives, scans and forwards
in C; this module waits for it and does what needs Python (policy frames, local answers at a
boundary, the end).  Its reference is the pure-Python pump beside it (:mod:`rmqfast.proxy.pump_py`).

The pumps talk to the raw non-blocking sockets under gevent's socket objects and wait on libev
watchers of their own: gevent's socket methods cost a getsockopt per sendall and a Timeout object
per recv, which was most of the relay's time.  With the reactor (``reactor_of``,
ext/reactor.pxi) the watchers give way to one epoll set per process that the hub steps in C once
per event-loop turn: a pump waiting for its source is parked there, and its greenlet runs only
for the statuses that need Python.

The environment switches below are comparison aids for benchmarks and tests.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import gevent

from rmqfast.codec import FrameScanner, Pump
from rmqfast.filters.api import Frame
from rmqfast.log import ctx
from rmqfast.proxy import budget

if TYPE_CHECKING:
    from rmqfast.proxy.writer import Sock, SocketWriter

log = logging.getLogger("rmqfast.relay")

if Pump is not None:
    from rmqfast._speedups import (  # type: ignore[attr-defined]
        P_BOUNDARY,
        P_EOF,
        P_OS_ERROR,
        P_OVER_BUDGET,
        P_POLICY,
        P_WAIT_LOCK,
        P_WAIT_READ,
        P_WAIT_WRITE,
        P_YIELD,
        Reactor,
    )

#: stepped in C per event-loop turn) rather than on a libev watcher each.
#: ``RMQFAST_RELAY_REACTOR=0`` turns it off (a comparison aid).
USE_REACTOR = os.environ.get("RMQFAST_RELAY_REACTOR", "1") != "0"
#: Extra ``epoll_wait`` calls a reactor turn makes while the previous one found several sources
#: ready (``Reactor.repoll``): the sources that became ready meanwhile are stepped without the
#: hub's wait, libev's getpid and the callback into the turn.  ``RMQFAST_REACTOR_REPOLL=0``: one
#: poll per turn (a comparison aid).
REACTOR_REPOLL = int(os.environ.get("RMQFAST_REACTOR_REPOLL", "4") or 0)

#: Whether a reactor issues its pumps' receives and sends through io_uring, one
#: ``io_uring_enter`` for all the pumps a poll found ready (``Reactor(uring=...)``; the reactor
#: falls back to plain system calls where the kernel or a seccomp profile refuses io_uring, and
#: logs why).  ``RMQFAST_URING=0`` turns it off.
USE_URING = os.environ.get("RMQFAST_URING", "1") != "0"

_reactors: dict[Any, Any] = {}  # hub -> (Reactor, its libev watcher)


def reactor_of(hub: Any) -> Any:
    """The reactor of ``hub``'s event loop (made and watched on first use), or None when the
    compiled pump is not there or the reactor is turned off."""
    if Pump is None or not USE_REACTOR:
        return None
    entry = _reactors.get(hub)
    if entry is None:
        reactor = Reactor(uring=USE_URING)
        reactor.repoll = REACTOR_REPOLL
        if reactor.uring:
            log.info("relay reactor uses io_uring")
        else:
            log.info("relay reactor uses plain system calls", extra=ctx(io_uring=reactor.uring_off))
        watcher = hub.loop.io(reactor.fileno(), 1)
        watcher.start(reactor.turn)
        entry = _reactors[hub] = (reactor, watcher)
    return entry[0]



class CompiledPumps:
    """The compiled pump's half of :class:`rmqfast.proxy.relay.Session` (a mixin: the session's
    state lives in its slots)."""

    __slots__ = ()

    def _pump_c(
        self,
        src: Sock,
        dst: Sock,
        scanner: FrameScanner,
        side: str,
        out: SocketWriter,
        from_client: bool,
    ) -> None:
        """The compiled pump on libev watchers of its own (the reactor is off): C receives, scans
        and forwards; Python waits and does policy.  With the reactor, :meth:`_launch` and
        :meth:`_drive` run the same loop.

        ``self.closed`` is checked before every step: once closed, the file descriptor
        numbers may already belong to other connections.
        """
        pump = Pump(scanner, src.fileno(), dst.fileno(), self.settings.buffer_size, budget.BUDGET)
        out.pump = pump
        rwatch = self._watcher(src, 0)
        wwatch = self._watcher(dst, 1)
        dst_lock = out.lock
        wait = self.hub.wait
        step = pump.step
        locked = dst_lock.locked
        policy = self.policy
        heard = not from_client
        st = step(not locked())
        while not self.closed:
            if st == P_WAIT_READ:
                wait(rwatch)
                self.last_activity = now = time.monotonic()
                if heard:
                    self._heard = now
            elif st == P_WAIT_WRITE or st == P_WAIT_LOCK:
                with dst_lock:
                    while not self.closed:
                        st = step(True)
                        if st != P_WAIT_WRITE:
                            break
                        wait(wwatch)
                continue
            elif st == P_BOUNDARY:
                self.flush_answers(out)
            elif st == P_POLICY:
                frame = Frame(pump.frame(), scanner.code, scanner.flag, scanner.opaque, scanner.limited,
                              scanner.records)
                pump.consume()
                if not policy(out, frame, from_client):
                    return
            elif st == P_YIELD:
                self.last_activity = now = time.monotonic()
                if heard:
                    self._heard = now
                gevent.sleep(0)
            else:
                self._pump_ended(st, pump, scanner, side)
                return
            if self.closed:
                return
            st = step(not locked())

    # Pumps parked in the reactor without a greenlet ------------------------------------------
    #
    # ``_launch`` attaches a compiled pump and parks it with the writer of its destination
    # (``SocketWriter``) as its wake-up: while the pump only waits for its source, the reactor steps it in C
    # and no greenlet exists for it.  A status that needs Python makes a greenlet (``SocketWriter.switch``)
    # that runs ``_drive`` from that status, the same loop as ``_pump_c``, until the pump parks
    # again (the greenlet ends) or ends (``_pump_done``; the session's ``on_end`` once both have).
    # Edges that arrive while the greenlet runs are kept by the reactor (``ready_in``) and stepped
    # by the ``park`` that ends it.

    def _launch(self, src: Sock, dst: Sock, scanner: Any, side: str, from_client: bool) -> None:
        """Start one direction parked in the reactor (never raises: a failure ends it)."""
        out = self._out_of(dst)
        assert out is not None and out.scanner is scanner and out.side == side and out.from_client == from_client
        if self.closed:  # the other direction failed to start: attach nothing any more
            self._pump_done(out)
            return
        try:
            out.pump = pump = Pump(scanner, src.fileno(), dst.fileno(), self.settings.buffer_size, budget.BUDGET)
            lock = out._lock  # None: the pump sends freely until a lock is made (SocketWriter.lock tells it)
            self._reactor.attach(pump, lock.locked if lock is not None else None)
            try:
                st = self._reactor.park(pump, out)
            except Exception:
                st = P_YIELD  # the greenlet steps again itself and meets the error there
        except Exception as exc:
            log.warning("relay direction failed to start",
                        extra=ctx(role=self.role, side=side, client=self.client_addr, error=str(exc)))
            self._pump_done(out)
            return
        if st >= 0:  # Python must act at once: from a callback in the hub, not this greenlet
            self.hub.loop.run_callback(out.switch, st)

    def _drive(self, out: SocketWriter, st: int) -> None:
        """The greenlet of a parked pump (the one forwarding into ``out``), from a status that needs
        Python; nothing escapes it (its parent is the hub)."""
        try:
            if self._drive_loop(out, st):
                return  # parked again: this greenlet ends
        except OSError as exc:
            self._ended_by(exc, out.side)
        except BaseException:
            log.exception("relay direction failed", extra=ctx(role=self.role, side=out.side, client=self.client_addr))
        self._pump_done(out)

    def _drive_loop(self, out: SocketWriter, st: int) -> bool:
        """``_pump_c``'s loop for a pump in the reactor; True when it is parked again."""
        pump = out.pump
        locked = out.locked  # the lock may be made in this loop (a write that waits)
        step = pump.step
        park = self._reactor.park
        while not self.closed:
            if st == P_WAIT_READ:
                st = park(pump, out)
                if st < 0:
                    return True
                continue
            if st == P_WAIT_WRITE or st == P_WAIT_LOCK:
                wwatch = self._watcher(out.sock, 1)
                with out.lock:
                    while not self.closed:
                        st = step(True)
                        if st != P_WAIT_WRITE:
                            break
                        self.hub.wait(wwatch)
                continue
            if st == P_BOUNDARY:
                self.flush_answers(out)
            elif st == P_POLICY:
                scanner = out.scanner
                frame = Frame(pump.frame(), scanner.code, scanner.flag, scanner.opaque, scanner.limited,
                              scanner.records)
                pump.consume()
                if not self.policy(out, frame, out.from_client):
                    return False
            elif st == P_YIELD:
                gevent.sleep(0)
            else:
                self._pump_ended(st, pump, out.scanner, out.side)
                return False
            if self.closed:
                return False
            st = step(not locked())
        return False

    def _pump_done(self, out: SocketWriter) -> None:
        """A parked pump (the one forwarding into ``out``) ended: what ``_pump`` does when its loop
        ends; ``on_end`` after the last."""
        try:
            self._direction_ended(out, out.from_client)
            self._forget_pump(out)
        finally:
            self._live -= 1
            if self._live == 0 and self._on_end is not None:
                on_end, self._on_end = self._on_end, None
                try:
                    on_end()
                except Exception:
                    log.exception("session end hook failed", extra=ctx(role=self.role, client=self.client_addr))

    def _pump_ended(self, st: int, pump: Any, scanner: FrameScanner, side: str) -> None:
        """The compiled pump stopped for good (end of stream, error, over budget): say why."""
        if st == P_OS_ERROR:
            raise OSError(pump.errno_value, os.strerror(pump.errno_value))
        if st == P_OVER_BUDGET:
            self._over_budget(side, pump.need)
        elif st != P_EOF:  # P_PROTOCOL_ERROR
            self._protocol_error(side, scanner)

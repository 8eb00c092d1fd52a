"""How long a worker's event loop was kept from running: the time its own timeouts must not count.

A worker short of CPU (a load burst on a busy machine, a stop by the scheduler, a long callback)
runs its timers late: a probe whose answer came in time sits unread while the loop is held, and
when the loop runs again the probe's deadline has passed.  Timed against the wall clock such a
probe "failed", and two of them made a healthy broker "hung" (issue 30, finding 5).

:class:`LoopLag` keeps a greenlet that wakes every ``tick`` seconds and adds up how late it woke
(beyond a small slack): :meth:`LoopLag.total` is that sum, plus the lateness of the wake-up that is
overdue now, so a caller that resumes before the greenlet does already sees the stall it came out
of.  A timeout is then measured as ``wall time - (total at the end - total at the start)``: the
time the loop actually ran (:meth:`LoopLag.ran_since`).
"""

from __future__ import annotations

import time
from typing import Any

import gevent

#: seconds between the lag greenlet's wake-ups
TICK = 0.05
#: lateness of a wake-up not counted as lag (timer granularity, the other greenlets of one turn)
SLACK = 0.005


class LoopLag:
    """Cumulative event-loop lag of this process (seconds), measured from the greenlet's start."""

    def __init__(self, tick: float = TICK, slack: float = SLACK) -> None:
        self.tick = tick
        self.slack = slack
        self._total = 0.0
        self._due = time.monotonic() + tick
        self._greenlet: Any = gevent.spawn(self._run)

    def _run(self) -> None:
        while True:
            gevent.sleep(self.tick)
            now = time.monotonic()
            late = now - self._due
            if late > self.slack:
                self._total += late
            self._due = now + self.tick

    def total(self, now: float | None = None) -> float:
        """The lag so far, the wake-up overdue now included."""
        now = time.monotonic() if now is None else now
        overdue = now - self._due
        return self._total + (overdue if overdue > self.slack else 0.0)

    def mark(self) -> tuple[float, float]:
        """(now, lag so far): the start of a measurement for :meth:`ran_since`."""
        now = time.monotonic()
        return now, self.total(now)

    def ran_since(self, mark: tuple[float, float]) -> float:
        """Seconds the loop ran since ``mark`` (wall time less the lag that came in between)."""
        now = time.monotonic()
        return max(0.0, (now - mark[0]) - (self.total(now) - mark[1]))

    def close(self) -> None:
        self._greenlet.kill(block=False)

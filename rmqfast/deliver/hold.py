"""Order across a worker crash: the other workers' copies wait while a crashed worker's spill replays.

An ordered producer's connection lands on one worker.  When that worker dies (``kill -9``) with
copies of the producer's queues in its spill, the producer reconnects at once and its next
sends land on another worker, whose copies would reach the remote before the older ones the
dead worker's replacement replays from the spill.  So, in a deliver process:

* a worker's link breaks: the worker is *held* for at most ``replicate.order_hold_max`` seconds;
* while any worker is held, the copies of the workers that are not held are *parked* here, in
  arrival order, instead of being queued in the sender's lanes; the held workers' own copies
  (the replacement replaying its spill) pass;
* the hold of worker N ends when a worker N says hello with nothing to replay, or tells that every
  copy it inherited was handed over (``D``): those are then queued in the lanes, ahead of the
  parked copies, which are queued next, in their order;
* a hold still there after ``order_hold_max`` seconds ends anyway (a worker that does not come
  back must not stop delivery for ever): counted in ``rmqfast_deliver_order_holds_total`` with
  ``outcome="timed_out"`` and logged; from then on order across that crash is not guaranteed.

The number of parked copies is bounded by the workers' windows (``replicate.max_in_flight``
each): a worker sends no more until its copies are acknowledged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import gevent

from rmqfast.log import ctx

log = logging.getLogger("rmqfast.deliver")


class OrderHold:
    """The held workers and the parked copies of one deliver process."""

    def __init__(self, max_wait: float, submit: Callable[[Any, Any], None], metrics: Any = None,
                 *, index: int = 0) -> None:
        self.max_wait = max_wait
        self.submit = submit  # (sender, item): queue a copy in its sender's lane
        self.metrics = metrics
        self.index = index
        self.held: dict[int, float] = {}  # worker -> deadline (monotonic)
        self.parked: list[tuple[Any, Any]] = []
        self.timed_out = 0
        self.released = 0
        self._timer: gevent.Greenlet | None = None

    def lost(self, worker: int) -> None:
        """Worker ``worker``'s link broke: hold the others until it is back and replayed."""
        if worker < 0 or self.max_wait <= 0:
            return
        self.held[worker] = time.monotonic() + self.max_wait
        log.info("worker link lost: other workers' copies wait for its replay",
                 extra=ctx(deliver=self.index, worker=worker, hold_max_s=self.max_wait))
        if self._timer is None or self._timer.dead:
            self._timer = gevent.spawn(self._expire_loop)

    def hello(self, worker: int, replaying: bool) -> None:
        if not replaying:
            self.release(worker, "released")

    def replayed(self, worker: int) -> None:
        self.release(worker, "released")

    def admit(self, worker: int, sender: Any, item: Any) -> None:
        """Queue ``item`` now, or park it while another worker is held."""
        if self.held and worker not in self.held:
            self.parked.append((sender, item))
            self._publish()
            return
        self.submit(sender, item)

    def release(self, worker: int, outcome: str) -> None:
        if self.held.pop(worker, None) is None:
            return
        if outcome == "timed_out":
            self.timed_out += 1
            log.warning("a crashed worker's replay did not finish in time: releasing the held copies; "
                        "order across this crash is not guaranteed (raise replicate.order_hold_max?)",
                        extra=ctx(deliver=self.index, worker=worker, parked=len(self.parked)))
        else:
            self.released += 1
        if self.metrics is not None:
            self.metrics.order_holds.labels(outcome).inc()
        if not self.held:
            parked, self.parked = self.parked, []
            for sender, item in parked:
                self.submit(sender, item)
            self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.parked.set(len(self.parked))

    def _expire_loop(self) -> None:
        while self.held:
            now = time.monotonic()
            soonest = min(self.held.values())
            if soonest > now:
                gevent.sleep(min(0.5, soonest - now))
                continue
            for w, deadline in list(self.held.items()):
                if deadline <= now:
                    self.release(w, "timed_out")

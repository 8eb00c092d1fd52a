"""Progress of long work: which stage is running and for how long, so slow can be told from stuck.

``with Stages("demo") as st: with st.stage("starting RocketMQ"): ...`` prints when a stage starts,
a status line every ``every`` seconds while it runs (from a daemon thread: the work itself may be a
blocking call such as a JVM start or a Spark job), and when it ends, with its time::

    [demo] stage 2/5 starting RocketMQ ...
    [demo]   starting RocketMQ: 10 s so far (demo 31 s)
    [demo]   starting RocketMQ: done in 14.2 s (demo 35 s)

Lines go to ``out`` (default stdout), flushed at once.  A stage that raises is reported as failed
with its time, and the exception goes on.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TextIO

#: Seconds between status lines while a stage runs.
DEFAULT_EVERY = 10.0


class Stages:
    """The stages of one long command (the demo, a report, a benchmark run)."""

    def __init__(self, name: str, total: int | None = None, every: float = DEFAULT_EVERY,
                 out: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if every <= 0:
            raise ValueError(f"every must be a positive number of seconds, got {every!r}")
        self.name = name
        self.total = total
        self.every = every
        self.out = out
        self.clock = clock
        self.started = clock()
        self.count = 0
        #: (stage, seconds, ok) of every stage that ended, in order
        self.done: list[tuple[str, float, bool]] = []
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        with self._lock:
            out = self.out if self.out is not None else sys.stdout
            print(f"[{self.name}] {text}", file=out, flush=True)

    def elapsed(self) -> float:
        return self.clock() - self.started

    @contextmanager
    def stage(self, what: str, detail: Callable[[], str] | None = None, tick: bool = True) -> Iterator[None]:
        """Run the ``with`` body as the next stage; ``detail`` adds to each status line (e.g. a
        Spark job's tasks done), and a failing ``detail`` adds nothing.  ``tick=False``: no status
        lines (the stage's work prints its own)."""
        self.count += 1
        of = f"/{self.total}" if self.total else ""
        self.say(f"stage {self.count}{of} {what} ...")
        t0 = self.clock()
        stop = threading.Event()

        def ticks() -> None:
            while not stop.wait(self.every):
                extra = ""
                if detail is not None:
                    try:
                        extra = f"; {detail()}"
                    except Exception:  # a status line must never break the work it reports on
                        extra = ""
                self.say(f"  {what}: {self.clock() - t0:.0f} s so far ({self.name} {self.elapsed():.0f} s){extra}")

        ticker = threading.Thread(target=ticks, name=f"progress-{self.name}", daemon=True)
        if tick:
            ticker.start()
        ok = False
        try:
            yield
            ok = True
        finally:
            stop.set()
            if tick:
                ticker.join()
            took = self.clock() - t0
            self.done.append((what, took, ok))
            self.say(f"  {what}: {'done' if ok else 'FAILED'} in {took:.1f} s ({self.name} {self.elapsed():.0f} s)")

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def stage(progress: Stages | None, what: str, detail: Callable[[], str] | None = None) -> Any:
    """``progress.stage(what)``, or nothing when there is no progress to show."""
    return nullcontext() if progress is None else progress.stage(what, detail)


def spark_status(spark: Any) -> str:
    """Jobs and tasks of a running SparkSession, from its status tracker (no UI needed)."""
    tracker = spark.sparkContext.statusTracker()
    active = tracker.getActiveJobsIds()
    finished = len(tracker.getJobIdsForGroup()) - len(active)
    if not active:
        return f"Spark: {finished} job(s) done, none running (the driver is planning or reading results)"
    stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
    done = sum(s.numCompletedTasks for s in stages if s is not None)
    total = sum(s.numTasks for s in stages if s is not None)
    return f"Spark: {finished} job(s) done, {len(active)} running (tasks {done}/{total} of its active stages)"

"""The send limits as a policy filter: SYSTEM_BUSY, or shaping, for sends over a limit.

The decision stays in the hot path: the scanner runs the limiter (compiled with the compiled
scanner) on every send whose topic a rule covers and hands only a refused send to Python, whole,
with the refusing rule's index in :attr:`rmqfast.filters.api.Frame.limited`.  Sends under their
limits, and every send when no rule applies, never become Python objects.  This filter answers
the refused ones:

* a ``limit`` or ``reject`` rule: SYSTEM_BUSY with the ext fields a Java client reads from a send
  response (measured: the Java client 5.3.3 retries SYSTEM_BUSY, 4.9.4 throws at once);
* a ``shape`` rule: the send goes to the worker's shaper (:mod:`rmqfast.limits.shaper`), which
  commits it to the spill and answers SUCCESS, or SYSTEM_BUSY when it cannot be shaped.

It comes after denial and the ACL and before the filters that hold or copy sends (a refused
send is neither held nor copied).  Its answers go out through the session's ordered writer like
every proxy-made answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rmqfast.filters.api import Filter, Frame, Session, Verdict

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost


class SendLimitFilter(Filter):
    """Answers the sends the scanner's limiter refused (``frame.limited`` >= 0); sees no others
    unless another filter asked for their code, and then lets them through (``None``)."""

    name = "send-limits"
    sees_limited = True

    def __init__(self, limits: Any) -> None:
        self.limits = limits  # rmqfast.limits.worker.WorkerLimits (rules, limiters, the shaper)

    def limiter(self, compiled: bool) -> Any:
        return self.limits.limiter_for(compiled)

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        index = frame.limited
        if index < 0:
            return None
        return self.limits.answer(frame, index, session.upstream_addr)


def build(host: ChainHost, role: str) -> Filter:
    """``[limits]``: the worker's shared buckets (the registry asks for it only when there are some)."""
    assert host.limits is not None
    return SendLimitFilter(host.limits)

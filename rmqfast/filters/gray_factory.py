"""The ``[gray]`` filter's factory (the filter, :class:`rmqfast.filters.gray.GrayFilter`, is a module
of its own at its size limit).

The split topics' queues come from the worker's route book (asked of the name server when not
cached; the asking greenlet waits); the promote/abort commands from the file in the state directory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rmqfast.filters.api import Filter
from rmqfast.filters.gray import GrayFilter, gray_metrics
from rmqfast.gray.state import Commands, state_path

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost


def build(host: ChainHost, role: str) -> Filter:
    """A new gray filter; a reload's carries on the hand-over fences of the one before (``host.gray``)."""
    book = host.book

    def queues(topic: str, broker: str) -> int | None:
        route = book.get(topic)  # cached; else asked of the name server (this greenlet waits)
        if route is None:
            return None
        return next((n for name, n, _ in route[1] if name == broker), None)

    def broker_name(addr: str, topic: str) -> str | None:
        book.get(topic)  # the route names the brokers
        return book.broker_name_of(addr)

    g = host.cfg.gray
    # every worker reads the file within 0.35 s (0.25 s + its 0.1 s tick) and switches 0.5 s after it was
    # written: all at the same instant (a client rebalancing meanwhile sees one phase everywhere)
    commands = Commands(state_path(g.state_file, host.cfg.proxy.state_dir), interval=0.25,
                        lead=0.5 if g.handover > 0 else 0.0)
    gray = GrayFilter(g, queues, commands, gray_metrics(), broker_name=broker_name)
    old = getattr(host, "gray", None)
    gray.handover.carry(old.handover if old is not None else None)  # a reload keeps the fences under way
    return gray

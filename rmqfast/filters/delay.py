"""The ``[delay]`` filter's factory: sends to delay topics held by the proxy and released when due.

The filter itself, :class:`rmqfast.delay.service.DelayFilter`, stays with the service that holds
and releases the sends (it is the service's door); the worker opens the service (its spill) before
the chains are built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rmqfast.filters.api import Filter

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost


def build(host: ChainHost, role: str) -> Filter:
    """The open delay service's filter (the registry asks for it only when there is one)."""
    return host.delay.filter

"""The cross-cloud copy filter's factory (``[clouds]`` remotes).

The filter itself, :class:`rmqfast.replicate.filter.ReplicateFilter`, stays with the replicator it
feeds; the worker starts the replication service before the chains are built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rmqfast.filters.api import Filter

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost


def build(host: ChainHost, role: str) -> Filter:
    """The replication service's filter."""
    return host.replication.filter

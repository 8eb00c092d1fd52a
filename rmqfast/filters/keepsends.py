"""The ``[failover]`` resend filter's factory: copies of the sends in flight, resent to another
live master when their broker dies.

The filter, :class:`rmqfast.proxy.failover.KeepSendsInFlight`, stays beside the failover service
that resends what it keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rmqfast.filters.api import Filter
from rmqfast.proxy.failover import KeepSendsInFlight

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost


def build(host: ChainHost, role: str) -> Filter:
    """``resend = "all"`` keeps every send (they leave the compiled path), ``"policy"`` only those
    another filter hands to Python anyway."""
    return KeepSendsInFlight(everything=host.cfg.failover.resend == "all")

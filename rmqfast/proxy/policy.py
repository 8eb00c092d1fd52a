"""The filter API's old address: it moved to :mod:`rmqfast.filters.api` (issue 29).

Kept only for ``proxy/relay.py``, ``proxy/failover.py`` and ``delay/service.py``, which other
engineers are splitting now; import from :mod:`rmqfast.filters.api` in new code.
"""

from rmqfast.filters.api import (
    PASS,
    Filter,
    FilterChain,
    Frame,
    Kind,
    Session,
    Verdict,
    divert,
    error_response,
    reply,
    slots_of,
)

__all__ = ["PASS", "Filter", "FilterChain", "Frame", "Kind", "Session", "Verdict", "divert", "error_response",
           "reply", "slots_of"]

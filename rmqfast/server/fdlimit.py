"""The open-files limit of a worker: every client connection costs it two descriptors (the client's
socket and its upstream connection), so the soft limit (often 1024) is raised to the hard limit
at start, and what that allows is logged."""

from __future__ import annotations

import logging
import resource

from rmqfast.log import ctx
from rmqfast.server.accept import auto_max_connections

log = logging.getLogger("rmqfast.worker")

def raise_nofile(worker: int | None = None) -> tuple[int, int]:
    """Raises RLIMIT_NOFILE's soft limit to its hard limit (unprivileged processes may) and logs
    the limit with the client connections it allows; returns (soft, hard) as they are afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = soft
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit", extra=ctx(worker=worker, soft=soft, hard=hard,
                                                                        error=str(exc)))
    sessions = auto_max_connections(soft)  # the default of proxy.max_connections
    msg = "open-files limit raised to the hard limit" if soft != before else "open-files limit"
    log.info(msg, extra=ctx(worker=worker, soft_before=before, soft=soft, hard=hard, max_client_connections=sessions))
    return soft, hard

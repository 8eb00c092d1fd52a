"""Arbitrary-delay messages held by the proxy (``[delay]``): see :mod:`rmqfast.delay.service`."""

from __future__ import annotations

import logging
from typing import Any

from rmqfast.delay.settings import DelaySection, parse_delay

log = logging.getLogger("rmqfast.delay")

__all__ = ["DelaySection", "open_delay", "parse_delay"]


def open_delay(cfg: Any, index: int, spill: Any, *, publish: bool = True) -> Any:
    """The worker's :class:`~rmqfast.delay.service.DelayService` over its open spill database
    (``spill``: a :class:`~rmqfast.spill.store.SpillStore`), or None when ``[delay]`` names no
    topic and the store holds nothing (a store that still holds messages is released)."""
    from rmqfast.delay.service import DelayService

    rp = cfg.replicate
    svc = DelayService(cfg.delay, spill.db, index, state_dir=cfg.proxy.state_dir, path=str(spill.path),
                       publish=publish, connect_timeout=cfg.proxy.connect_timeout,
                       retry_initial=rp.retry_initial, retry_max=rp.retry_max)
    if not cfg.delay.enabled and svc.store.messages == 0:
        svc.close()
        return None
    return svc

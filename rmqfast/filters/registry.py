"""The filter registry: the order of each chain, declared once.

:data:`CHAINS` lists, per listener role, the filters in the order a request meets them; each entry
names the module whose ``build(host, role)`` makes the filter from the configuration and the
worker's services (:class:`rmqfast.filters.host.ChainHost`), and when the configuration puts it in
the chain.  :func:`build_chains` walks it (the worker calls it at start and on every reload); a
filter's module is imported only when its entry is wanted, so a worker without ``[gray]`` never
loads the gray filter.  :data:`DRAINING` is the one filter put in front of every chain while the
worker drains.  ``docs/architecture.md`` shows :func:`order_table`; ``tests/test_filter_order.py``
fails when the two disagree.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rmqfast.codec import is_compiled
from rmqfast.filters.api import Filter, FilterChain

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost


@dataclass(frozen=True)
class Entry:
    name: str  #: the filter's name (docs/architecture.md, the ``built`` map of :func:`build_chains`)
    module: str  #: its module: ``build(host, role)`` makes it
    wanted: Callable[[ChainHost], bool]  #: whether this worker's configuration puts it in the chain
    when: str  #: the same, in words
    why: str  #: why it stands here in the order


def _always(host: ChainHost) -> bool:
    return True


DENY = Entry("deny", "rmqfast.filters.deny", _always, "always",
             "admin codes are refused before any other filter reads them")
ROUTES = Entry("routes", "rmqfast.filters.routes", _always, "always",
               "route answers name the proxy's broker endpoints (healed with `[failover]`)")
ACL = Entry("acl", "rmqfast.filters.acl", lambda h: h.cfg.acl.enabled, "`[acl]` topics",
            "before the filters that copy or hold sends")
LIMITS = Entry("limits", "rmqfast.filters.limits", lambda h: h.limits is not None, "`[limits]` rules",
               "a refused send is answered SYSTEM_BUSY or shaped, neither held nor copied")
GRAY = Entry("gray", "rmqfast.filters.gray_factory", lambda h: h.cfg.gray.enabled, "`[gray]` groups",
             "after the limits, before the filters that hold or copy sends")
DELAY = Entry("delay", "rmqfast.filters.delay", lambda h: h.delay is not None, "`[delay]` topics (or a held backlog)",
              "a held send is answered here and not copied")
REPLICATE = Entry("replicate", "rmqfast.filters.replicate", lambda h: h.cfg.replication_enabled,
                  "`[clouds]` remotes", "copies what the broker is sent")
ADDRESSES = Entry("addresses", "rmqfast.filters.addresses", _always, "always",
                  "broker addresses inside messages become proxy endpoints; the filters before see the frames first")
KEEP_SENDS = Entry("keep-sends", "rmqfast.filters.keepsends",
                   lambda h: h.cfg.failover.enabled and h.cfg.failover.resend != "off",
                   "`[failover]` resend", "last: what it keeps is what the broker was sent")

#: listener role -> its chain, in the order a request meets the filters
CHAINS: dict[str, tuple[Entry, ...]] = {
    "namesrv": (DENY, ROUTES),
    "broker": (DENY, ACL, LIMITS, GRAY, DELAY, REPLICATE, ADDRESSES, KEEP_SENDS),
}

#: first in every chain while the worker drains (:func:`rmqfast.filters.goaway.go_away_from_now_on`)
DRAINING = Entry("go-away", "rmqfast.filters.goaway", lambda h: h.cfg.failover.go_away, "`[failover]` go_away",
                 "while draining: GO_AWAY to clients that reconnect on it")


def build_chains(host: ChainHost) -> tuple[dict[str, FilterChain], dict[str, Filter]]:
    """Each role's chain from :data:`CHAINS`, and the broker chain's filters by entry name (the
    worker hands some of them to the failover service)."""
    chains: dict[str, FilterChain] = {}
    built: dict[str, Filter] = {}
    for role, entries in CHAINS.items():
        filters: list[Filter] = []
        for entry in entries:
            if entry.wanted(host):
                made = importlib.import_module(entry.module).build(host, role)
                filters.append(made)
                built[entry.name] = made
        chains[role] = FilterChain(filters)
    return chains, built


def adopt_chains(sessions: Iterable[Any], chains: dict[str, FilterChain]) -> None:
    """A reload: every live session onto its role's new chain, its scanners onto what the chain asks
    (the request actions, delay and policy topics; the answers' store-host map)."""
    for s in list(sessions):
        chain = chains[s.role]
        if s.c2u is not None:
            s.c2u.set_actions(chain.request_actions)
            s.c2u.delay_topics = chain.delay_topics
            s.c2u.policy_topics = chain.policy_topics
        u2c = getattr(s, "u2c", None)
        if u2c is not None:  # the new chain's store-host map (a records answer's other half)
            u2c.address_map = chain.address_map(is_compiled(u2c))
        s.chain = chain


def order_table() -> str:
    """The order as the Markdown table ``docs/architecture.md`` shows."""
    rows = ["| chain | # | filter | module | in the chain when | why here |",
            "| --- | --- | --- | --- | --- | --- |"]
    for role, entries in CHAINS.items():
        for n, e in enumerate(entries, 1):
            rows.append(f"| {role} | {n} | {e.name} | `{e.module}` | {e.when} | {e.why} |")
    e = DRAINING
    rows.append(f"| every, draining | 0 | {e.name} | `{e.module}` | {e.when} | {e.why} |")
    return "\n".join(rows) + "\n"

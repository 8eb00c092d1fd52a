"""The gray decisions, without frames or sockets.

Gray queues are the **last** ``k`` queue ids of a topic on each broker.  Producers pick a queue id
in ``0 .. writeQueueNums-1``; a queue id the proxy rewrites stays inside that range, and topics grow
(``updateTopic`` with more queues) at the end, so the normal queues ``0 .. n-k-1`` keep their ids
(and their committed offsets) when ``n`` changes, only the gray ones move up.

Consumers keep their own allocation strategy: each side is shown only its own members in the
consumer list (``GET_CONSUMER_LIST_BY_GROUP``), so each side's strategy partitions **all** queues
among its own members; the proxy then parks every pull of a queue the other side owns (answered
``SYSTEM_BUSY``: the client retries it 3 s later) and drops that client's offset commits for it.
Every queue is pulled by exactly one client of the side that owns it.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from collections.abc import Iterable
from enum import Enum

from rmqfast.gray.config import GrayGroup

GRAY = "gray"
NORMAL = "normal"
ANY = "any"  # both sides may pull (after a promote the group is one again)
NOBODY = "nobody"  # nobody pulls (an abort's settle: the gray side's last commits come in)


class Phase(Enum):
    ACTIVE = "active"  # gray clients on gray queues, normal clients on normal queues
    PROMOTING = "promoting"  # promote given: as ACTIVE until the gray version has consumed its queues up to the marks
    PROMOTED = "promoted"  # one group again: every queue, every member
    ABORTING = "aborting"  # abort given: gray consumers stopped; their last offset commits are taken
    ABORTED = "aborted"  # normal consumers on every queue; gray consumers get nothing


def phase(action: str | None, at: float, now: float, settle: float, drained_at: float | None = None,
          drain_timeout: float | None = None) -> Phase:
    """The phase of a group ``now``, given its last command (``promote``/``abort``/None) given at ``at``.

    A promote ends when its drain was seen over (``drained_at``: the group's committed offsets of the gray
    queues reached the marks, their max offsets read when the promote was first seen; no earlier than
    ``settle`` after the command) or, at the latest, ``drain_timeout`` after it; without a
    ``drain_timeout`` it ends ``settle`` after the command.  An abort hands the gray queues over
    ``settle`` after the command (the gray side's last offset commits), whatever their backlog."""
    if action == "promote":
        bound = settle if drain_timeout is None else max(settle, drain_timeout)
        if drained_at is not None:
            bound = min(bound, max(settle, drained_at - at))
        return Phase.PROMOTED if now - at >= bound else Phase.PROMOTING
    if action == "abort":
        return Phase.ABORTED if now - at >= settle else Phase.ABORTING
    return Phase.ACTIVE


class Marker:
    """Who is gray in one group: client ids (globs), client IPs (networks), producer groups, a property."""

    def __init__(self, g: GrayGroup) -> None:
        self.globs = list(g.clients)
        self.nets = [ipaddress.ip_network(c, strict=False) for c in g.cidrs]
        self.producer_groups = list(g.producer_groups)
        key, _, value = g.property.partition("=")
        self.prop: tuple[str, str] | None = (key, value) if g.property else None

    def ip_is_gray(self, ip: str) -> bool:
        if not self.nets:
            return False
        try:
            a = ipaddress.ip_address(ip.strip("[]"))
        except ValueError:
            return False
        return any(a in n for n in self.nets)

    def client_is_gray(self, client_id: str) -> bool:
        """A client id as clients build it: ``ip@instanceName`` (+ ``@unitName``...)."""
        if any(fnmatch.fnmatchcase(client_id, p) for p in self.globs):
            return True
        return self.ip_is_gray(client_id.split("@", 1)[0])

    def send_is_gray(self, producer_group: str, props: dict[str, str], client_id: str | None, peer_ip: str) -> bool:
        """A send: its producer group, its user properties, the connection's client id (when its
        heartbeat was seen) and the connection's address."""
        if any(fnmatch.fnmatchcase(producer_group, p) for p in self.producer_groups):
            return True
        if self.prop is not None and props.get(self.prop[0]) == self.prop[1]:
            return True
        if client_id is not None and self.client_is_gray(client_id):
            return True
        return self.ip_is_gray(peer_ip)


def split_consumer_ids(ids: Iterable[str], marker: Marker) -> tuple[list[str], list[str]]:
    """(gray ids, normal ids), order kept."""
    gray: list[str] = []
    normal: list[str] = []
    for cid in ids:
        (gray if marker.client_is_gray(cid) else normal).append(cid)
    return gray, normal


def consumer_ids_for(ids: list[str], side: str, ph: Phase, marker: Marker) -> list[str]:
    """The consumer list a member of ``side`` is shown: its own side only, until the group is one again."""
    if ph is Phase.PROMOTED:
        return list(ids)
    gray, normal = split_consumer_ids(ids, marker)
    return gray if side == GRAY else normal


def is_gray_queue(queue_id: int, queues: int, k: int) -> bool:
    """Whether ``queue_id`` of a topic with ``queues`` queues on its broker is one of the last ``k``.
    A broker with no more than ``k`` queues of the topic has no gray queue (the split needs a normal one)."""
    return queues > k and queues - k <= queue_id < queues


def owner(ph: Phase, gray_queue: bool, gray_alive: bool) -> str:
    """Which side pulls a queue.  Queues of topics that are not split count as normal queues."""
    if ph is Phase.PROMOTED:
        return ANY
    if not gray_queue:
        return NORMAL
    if ph is Phase.ACTIVE:
        return GRAY if gray_alive else NORMAL  # every gray consumer gone for the grace period
    if ph is Phase.PROMOTING:
        return GRAY
    if ph is Phase.ABORTING:
        return NOBODY
    return NORMAL  # ABORTED


def may_pull(side: str, ph: Phase, gray_queue: bool, gray_alive: bool) -> bool:
    """Whether a client of ``side`` may pull the queue.  In ABORTING and ABORTED, gray clients pull nothing."""
    if side == GRAY and ph in (Phase.ABORTING, Phase.ABORTED):
        return False
    own = owner(ph, gray_queue, gray_alive)
    return own == ANY or own == side


def may_commit(side: str, ph: Phase, gray_queue: bool, gray_alive: bool) -> bool:
    """Whether an offset commit of a client of ``side`` for the queue reaches the broker: the
    owner's do; in ABORTING also the gray side's (its last commits before normal consumers take over)."""
    if ph is Phase.ABORTING and side == GRAY and gray_queue:
        return True
    return may_pull(side, ph, gray_queue, gray_alive)


def send_queue(queue_id: int, queues: int, k: int, gray: bool, ph: Phase) -> int:
    """The queue id a send to a topic with ``queues`` queues on its broker goes to.

    ACTIVE and PROMOTING: gray sends to ``n-k + queue_id % k``, normal sends keep a normal queue id and
    a gray one becomes ``queue_id % (n-k)``: until a promote ends, only the gray version consumes the
    gray queues, so a gray send placed there is consumed with the gray version's subscription (a tag only
    it subscribes to would be skipped by the old version on a normal queue).  ABORTING, ABORTED: every
    send to a normal queue (the normal version is the one kept).  PROMOTED: unchanged.  A broker with no
    more than ``k`` queues: unchanged.
    """
    if ph is Phase.PROMOTED or queues <= k or queue_id < 0:
        return queue_id
    normal = queues - k
    if gray and ph in (Phase.ACTIVE, Phase.PROMOTING):
        return normal + queue_id % k
    return queue_id if queue_id < normal else queue_id % normal

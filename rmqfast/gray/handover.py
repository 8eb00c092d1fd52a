"""The hand-over of a gray group's queues at a phase change (start, promote, abort, end of a drain).

Each phase change changes which consumer may pull which queue (and which consumer list each member
is shown), but a client only learns it at its next rebalance (every 20 s by default).  So, per worker
and per group, from the moment the worker sees the change:

1. **Fence** (``gray.handover`` seconds): no pull of the group is answered with messages.  The pulls the
   broker holds (long polling) are answered by the proxy at once, "no message" (the broker's answer, when
   it comes, is dropped): the clients pull again, and a client whose queue gets no new message is not left
   waiting at the broker (up to 15 s) through the hand-over.  A pull that arrives is held and answered
   ``PULL_NOT_FOUND`` (its own ``queueOffset`` as ``nextBeginOffset``) when the fence ends; an answer
   the broker gives to a pull relayed before the worker saw the change is turned into the same.  Offset
   commits of the group pass if the old phase or the new one allows them (the old owner's last commits).
2. **Last positions**, a quarter of the fence in (at most :data:`QUIESCE` seconds: what was delivered
   before the fence is consumed meanwhile): the pulls held so far are answered (no message), the
   clients pull again at once, and such a pull of a client that pulled the queue in the phase before,
   which carries its consumed offset (``commitOffset``, ``FLAG_COMMIT_OFFSET``), is turned into an
   ``UPDATE_CONSUMER_OFFSET`` of that offset; the pull is then held to the fence's end, or answered
   ``SYSTEM_BUSY`` if the client loses the queue.  The clients' own commits are not enough: a client
   that loses a queue without dropping it (the other side takes it: a reset after a promote or an
   abort) commits nothing then, and the Go client (v2.1.2) drops the other queues' offsets from its
   table each time it commits a dropped queue's (``persist``), so its later drops commit nothing.  A
   commit of a client that pulled the queue neither in this phase nor in the last one (a new owner
   that read its start offset from the broker before the old owner's last commit) is dropped: it
   would undo that commit.
3. **Notify**, half the fence in: every connection of the group's consumers on this worker gets the
   broker's own ``NOTIFY_CONSUMER_IDS_CHANGED`` (40, header ``consumerGroup``), one-way, written at a
   frame boundary of the stream it is relayed on; the clients rebalance at once: a client drops the
   queues it no longer owns and takes the new ones.
4. **After the fence**, each client's first pull of each queue is turned into a query of the group's
   committed offset (:mod:`rmqfast.gray.filter`) and the client starts from
   ``max(committed offset, its own position)``: a new owner starts where the old one stopped (its
   commit came in during the fence); a client that kept its queue goes on from its own position (what
   it had pulled, it had been given).

The opaques of the proxy's requests count down from ``2**31 - 1``; a broker's count up from 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, encode, make_response
from rmqfast.codec.sendheader import field_int
from rmqfast.gray.rules import Phase
from rmqfast.log import ctx

log = logging.getLogger("rmqfast.gray")

#: Longest wait from the start of a fence to the notification.
QUIESCE = 0.5
#: PullSysFlag: the pull carries the client's consumed offset (``commitOffset``), which the broker commits
FLAG_COMMIT_OFFSET = 1
#: Pulls one worker holds during a fence at most (past it, a pull is answered "no message" at once).
MAX_HELD = 20000


@dataclass
class Fence:
    """One group's hand-over as one worker sees it."""

    phase: Phase
    prev: Phase | None = None
    epoch: int = 0  # phase changes this worker has seen for the group
    since: float = 0.0  # when this worker saw the last one
    until: float = 0.0  # end of its fence
    release_at: float = 0.0  # the pulls held so far are answered (the clients pull again with their offsets)
    released: bool = True
    notify_at: float = 0.0
    notified: bool = True
    cut: bool = True  # the pulls in flight at its start were answered
    held: list[tuple[Any, bytes]] = field(default_factory=list)  # (session, answer) of pulls held
    early: list[tuple[Any, bytes]] = field(default_factory=list)  # those held until ``release_at``


class Handover:
    """The fences of one worker's gray groups (``fence`` seconds each; 0: none, no notification)."""

    def __init__(self, fence: float) -> None:
        self.fence = fence
        self.groups: dict[str, Fence] = {}
        self._opaque = 0x7FFFFFFF

    def seen(self, group: str, ph: Phase, now: float) -> tuple[Fence, bool]:
        """The group is in ``ph`` at ``now``: (its fence, whether this starts a hand-over).  The first
        sight of a group (a worker starting) is no change."""
        f = self.groups.get(group)
        if f is None:
            self.groups[group] = f = Fence(ph)
            return f, False
        if f.phase is ph:
            return f, False
        f.prev, f.phase = f.phase, ph
        f.since = now
        if self.fence > 0:  # 0: as before hand-overs (no fence, no notification, positions kept)
            f.epoch += 1
            f.until = now + self.fence
            f.release_at = now + min(QUIESCE, self.fence / 4)
            f.notify_at = now + self.fence / 2
            f.released = f.notified = f.cut = False
        return f, True

    def fenced(self, group: str, now: float) -> bool:
        f = self.groups.get(group)
        return f is not None and now < f.until

    def epoch(self, group: str) -> int:
        f = self.groups.get(group)
        return 0 if f is None else f.epoch

    def hold(self, group: str, session: Any, answer: bytes) -> bool:
        """Keep a pull's answer until ``release_at`` (before it) or the fence's end; False when too many
        are held already."""
        f = self.groups[group]
        if sum(len(g.held) + len(g.early) for g in self.groups.values()) >= MAX_HELD:
            return False
        (f.held if f.released else f.early).append((session, answer))
        return True

    def due(self, now: float) -> tuple[list[str], list[str], list[tuple[str, list[tuple[Any, bytes]]]]]:
        """(groups whose fence started: their pulls in flight are to be answered, groups whose consumers are
        to be notified now, (group, held answers to write) of fences at ``release_at`` or their end)."""
        started: list[str] = []
        notify: list[str] = []
        release: list[tuple[str, list[tuple[Any, bytes]]]] = []
        for group, f in self.groups.items():
            if not f.cut:
                f.cut = True
                started.append(group)
            if not f.released and now >= f.release_at:
                f.released = True
                release.append((group, f.early))
                f.early = []
            if not f.notified and now >= f.notify_at:
                f.notified = True
                notify.append(group)
            if f.held and now >= f.until:
                release.append((group, f.held))
                f.held = []
        return started, notify, release

    def notify_frame(self, group: str) -> bytes:
        """``NOTIFY_CONSUMER_IDS_CHANGED`` as the broker sends it (one-way)."""
        opaque = self._opaque
        self._opaque = opaque - 1 if opaque > 0x40000000 else 0x7FFFFFFF
        return encode(RemotingCommand(code=C.NOTIFY_CONSUMER_IDS_CHANGED, flag=C.FLAG_ONEWAY, opaque=opaque,
                                      ext_fields={"consumerGroup": group}))

    def carry(self, old: Handover | None) -> None:
        """A reload: the fences under way go on (with the new length for the next ones)."""
        if old is not None:
            self.groups = old.groups
            self._opaque = old._opaque


def held_answer(pull: RemotingCommand) -> bytes:
    """What a pull held in a fence is answered: no message, the client's position unchanged."""
    offset = (pull.ext_fields or {}).get("queueOffset", "0")
    out = {"suggestWhichBrokerId": "0", "nextBeginOffset": offset, "minOffset": "0", "maxOffset": offset}
    return encode(make_response(pull, C.PULL_NOT_FOUND, "rmqfast gray: queues changing hands", ext_fields=out))


def commit_of_pull(pull: RemotingCommand) -> RemotingCommand | None:
    """The ``UPDATE_CONSUMER_OFFSET`` (two-way, the pull's opaque) of the consumed offset a pull carries
    (``FLAG_COMMIT_OFFSET`` and ``commitOffset``); None when it carries none."""
    ext = pull.ext_fields or {}
    flag = field_int(ext.get("sysFlag"), -1)
    offset = field_int(ext.get("commitOffset"), -1)
    if flag < 0 or not flag & FLAG_COMMIT_OFFSET or offset < 0 or "AccessKey" in ext:  # a signature covers it
        return None
    q = {k: ext[k] for k in ("consumerGroup", "topic", "queueId", "bname") if k in ext}
    q["commitOffset"] = str(offset)
    return RemotingCommand(code=C.UPDATE_CONSUMER_OFFSET, language=pull.language, version=pull.version,
                           opaque=pull.opaque, flag=pull.flag, ext_fields=q, serialize_type=pull.serialize_type)


def write_client(session: Any, data: bytes) -> bool:
    """A frame the proxy makes itself to a client, at a frame boundary of the stream relayed to it."""
    out = session.to_client
    if session.closed or out is None:
        return False
    try:
        session.answer(out, data, False)
    except OSError:  # the client went meanwhile
        return False
    return True


def run_due(handover: Handover, sessions: Any, now: float) -> None:
    """What the worker's tick does for the fences (:meth:`Handover.due`) over its ``sessions``."""
    started, notify, release = handover.due(now)
    for group in started:
        n = 0
        for s in list(sessions):
            st = s._state
            pulls = st.get("gray_pulls") if st else None
            for opaque, entry in list(pulls.items()) if pulls else ():
                if entry[0][0] == group:  # (key, side, gray queue, pull, epoch); key[0] is the group
                    del pulls[opaque]
                    if write_client(s, held_answer(entry[3])):
                        st.setdefault("gray_cut", set()).add(opaque)
                        n += 1
        log.info("gray: pulls at the brokers answered at the hand-over's start", extra=ctx(group=group, pulls=n))
    for group in notify:
        data, n = handover.notify_frame(group), 0
        for s in list(sessions):
            st = s._state
            if st and group in st.get("gray_groups", ()) and write_client(s, data):
                n += 1
        log.info("gray: consumers notified to rebalance (NOTIFY_CONSUMER_IDS_CHANGED)",
                 extra=ctx(group=group, connections=n))
    for group, held in release:
        n = sum(1 for s, answer in held if write_client(s, answer))
        log.info("gray: held pulls answered", extra=ctx(group=group, pulls=n))

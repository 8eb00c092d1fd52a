"""The policy hook: a per-request-code filter chain.

Frames reach Python only when a filter asked for their request code (or, for responses,
when a filter wants responses at all), or when the scanner's send limiter refused a send
(:attr:`Frame.limited`); everything else is relayed by the compiled scanner without a
Python object per frame.  A filter looks at a :class:`Frame` and returns a :class:`Verdict`
(its :class:`Kind`), or ``None`` to let the next filter decide:

* ``PASS``: relay the frame unchanged;
* ``reply(frame)``: answer the sender locally, the frame is not relayed;
* ``rewrite(frame)``: relay a changed frame instead;
* ``divert(reason)``: the filter took the frame (stored, queued...); relay nothing;
* ``close(reason)``: close the connection.

This module is the filter API only (a leaf: it imports the codec and the log); the filters
themselves are the other modules of :mod:`rmqfast.filters`, and :mod:`rmqfast.filters.registry`
declares the order of each chain once.  The session (:mod:`rmqfast.proxy.core`) carries out
verdicts.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from rmqfast.codec import ACTION_POLICY, ACTION_RECORDS, CODE_SLOTS, code_slot
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode, make_response

log = logging.getLogger("rmqfast.policy")

_I32 = struct.Struct(">i")


class Kind(Enum):
    """What a verdict asks the session to do with the frame."""

    PASS = "pass"  # relay it unchanged
    REPLY = "reply"  # answer the sender with ``data``; relay nothing
    REWRITE = "rewrite"  # relay ``data`` instead
    DIVERT = "divert"  # a filter took it; relay nothing, answer nothing
    CLOSE = "close"  # close the connection (``reason`` is logged)


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    data: bytes = b""
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):  # a plain string would never match in the session
            raise TypeError(f"Verdict kind {self.kind!r} is not a policy.Kind (use PASS, reply(), rewrite(), "
                            "divert() or close())")


PASS = Verdict(Kind.PASS)


def reply(frame: bytes) -> Verdict:
    return Verdict(Kind.REPLY, frame)


def rewrite(frame: bytes) -> Verdict:
    return Verdict(Kind.REWRITE, frame)


def divert(reason: str) -> Verdict:
    return Verdict(Kind.DIVERT, reason=reason)


def close(reason: str) -> Verdict:
    return Verdict(Kind.CLOSE, reason=reason)


class Frame:
    """A whole frame handed to the policy, with the fields the scanner already read."""

    __slots__ = ("data", "code", "flag", "opaque", "limited", "records", "_cmd", "want_response")

    def __init__(self, data: bytes, code: int, flag: int, opaque: int, limited: int = -1, records: int = 0) -> None:
        self.data = data
        self.code = code
        self.flag = flag
        self.opaque = opaque
        #: The send-limit rule (its index) that refused this send, decided by the scanner's
        #: limiter in the hot path; -1: no limit refused it (see :attr:`Filter.sees_limited`).
        self.limited = limited
        #: 1: an answer to a request the scanner tracked for :meth:`Filter.record_slots` whose store
        #: hosts it did not map itself (an address its map does not know, or a body it could not walk).
        self.records = records
        self._cmd: RemotingCommand | None = None
        #: Set by a filter's ``on_request``: hand the answer to this request (and only it) to the
        #: filters' ``on_response``.  The scanner finds it by opaque, in C; every other response
        #: is forwarded without Python.
        self.want_response = False

    @property
    def is_oneway(self) -> bool:
        return bool(self.flag & C.FLAG_ONEWAY)

    @property
    def header_length(self) -> int:
        return _I32.unpack_from(self.data, 4)[0] & 0xFFFFFF

    @property
    def body(self) -> bytes:
        return self.data[8 + self.header_length :]

    def command(self) -> RemotingCommand:
        """The fully decoded frame (decoded once, on first use)."""
        if self._cmd is None:
            self._cmd = decode_frame(self.data)
        return self._cmd

    def with_body(self, body: bytes) -> bytes:
        """This frame with another body and the header bytes kept verbatim."""
        hl = self.header_length
        return _I32.pack(4 + hl + len(body)) + self.data[4 : 8 + hl] + body


class Session(Protocol):
    """What a filter may know of the connection a frame came from."""

    role: str
    client_addr: str
    upstream_addr: str
    state: dict[str, Any]


class Filter:
    """Base class: override what you need; the defaults see nothing and decide nothing."""

    name = "filter"

    def request_slots(self) -> set[int]:
        """Scanner slots (see :func:`rmqfast.codec.code_slot`) whose requests this filter sees."""
        return set()

    def record_slots(self) -> set[int]:
        """Slots whose answers' store records the scanner maps in C with :meth:`address_map`
        (``ACTION_RECORDS``: the request is relayed and tracked without Python).  Such a request
        still reaches ``on_request`` when another filter has it handed to Python; an answer the
        scanner cannot map itself reaches ``on_response`` with ``frame.records`` set."""
        return set()

    def address_map(self, compiled: bool) -> Any:
        """The store-host map the scanners of this chain use for :meth:`record_slots` (compiled or
        pure twin), or None."""
        return None

    def passive_slots(self) -> set[int]:
        """Slots whose requests this filter sees only when another filter of the chain has them
        handed to Python anyway (it sees them last, once every other filter let them pass)."""
        return set()

    #: True: every response of the role goes to ``on_response`` (route rewrites need that).
    wants_responses = False
    #: True: ``on_response`` sees the answers to the requests whose frame it marked
    #: (``frame.want_response = True`` in ``on_request``), and only those.
    wants_marked_responses = False
    #: True: ``on_request`` also sees the sends the scanner's limiter refused (``frame.limited``
    #: >= 0: the limiter, not the action table, hands them to Python).
    sees_limited = False

    def limiter(self, compiled: bool) -> Any:
        """The send limiter the scanners of this chain run (compiled or pure twin), or None."""
        return None

    def scanner_topics(self) -> list[bytes] | None:
        """Topics (bytes; a trailing ``*`` makes a prefix) whose sends that ask for a delivery time
        the scanner hands to this filter (its ``delay_topics``: the list itself, so that changing
        it in place reaches live sessions); other sends stay on the fast path.  None: none."""
        return None

    def send_topics(self) -> list[bytes] | None:
        """Topics (bytes; a trailing ``*`` makes a prefix) whose every send (10, 310, 320) the scanner
        hands to this filter (its ``policy_topics``) without the send codes in the action table; the
        sends of other topics stay on the fast path.  None: none."""
        return None

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        return None

    def on_response(self, session: Session, frame: Frame) -> Verdict | None:
        return None

    def on_close(self, session: Session) -> None:
        """The connection closed (answers still awaited will never come)."""


def slots_of(codes: Iterable[int]) -> set[int]:
    return {code_slot(c) for c in codes}


#: The request codes a send limiter decides (the scanner checks no others).
LIMITED_CODES = C.SEND_CODES
#: Reply messages: a send header, stored by the broker in its topic and queue; the scanner hands
#: those of ``policy_topics`` and those over a send limit to policy too.


class FilterChain:
    """The filters of one listener role, in order, and the scanner action table they imply."""

    def __init__(self, filters: list[Filter]) -> None:
        self.filters = filters
        table = bytearray(CODE_SLOTS)
        by_slot: list[list[Filter]] = [[] for _ in range(CODE_SLOTS)]
        limited = slots_of(LIMITED_CODES)
        replies = slots_of(C.REPLY_SEND_CODES)
        #: the scanner's ``delay_topics`` (:meth:`Filter.scanner_topics` of the first filter with some)
        self.delay_topics: list[bytes] | None = None
        #: the scanner's ``policy_topics`` (:meth:`Filter.send_topics` of the filters with some)
        self.policy_topics: list[bytes] | None = None
        for f in filters:
            slots = f.request_slots()
            for s in slots:
                table[s] = ACTION_POLICY
            slots = slots | f.record_slots()
            topics = f.scanner_topics()
            if topics is not None and self.delay_topics is None:
                self.delay_topics = topics
            sends = f.send_topics()
            if sends is not None:
                self.policy_topics = sends if self.policy_topics is None else [*self.policy_topics, *sends]
            for s in range(CODE_SLOTS):
                if s in slots or ((f.sees_limited or topics is not None or sends is not None) and s in limited) \
                        or ((f.sees_limited or sends is not None) and s in replies):
                    by_slot[s].append(f)
        for f in filters:
            for s in f.passive_slots() - f.request_slots():
                # the sends of policy_topics reach Python whatever the table says: the passive
                # filters see them as they would if the send codes were in the table
                if table[s] == ACTION_POLICY or (self.policy_topics and s in limited):
                    by_slot[s].append(f)
        for f in filters:
            for s in f.record_slots():
                if table[s] != ACTION_POLICY:  # a filter that reads the request in Python wins
                    table[s] = ACTION_RECORDS
        self.request_actions = bytes(table)
        self.response_policy = any(f.wants_responses for f in filters)
        self._by_slot = [tuple(fs) for fs in by_slot]  # the filters that see a request of that slot
        self._resp_filters = [f for f in filters if f.wants_responses or f.wants_marked_responses]
        self._close_filters = [f for f in filters if type(f).on_close is not Filter.on_close]

    def limiter(self, compiled: bool) -> Any:
        """The send limiter of the first filter that has one (None: no send limits)."""
        for f in self.filters:
            lim = f.limiter(compiled)
            if lim is not None:
                return lim
        return None

    def address_map(self, compiled: bool) -> Any:
        """The store-host map of the first filter that has one (None: records answers go to policy)."""
        for f in self.filters:
            amap = f.address_map(compiled)
            if amap is not None:
                return amap
        return None

    def on_request(self, session: Session, frame: Frame) -> Verdict:
        for f in self._by_slot[code_slot(frame.code)]:
            v = f.on_request(session, frame)
            if v is not None:
                return v
        return PASS

    def on_response(self, session: Session, frame: Frame) -> Verdict:
        for f in self._resp_filters:
            v = f.on_response(session, frame)
            if v is not None:
                return v
        return PASS

    def on_close(self, session: Session) -> None:
        for f in self._close_filters:
            try:
                f.on_close(session)
            except Exception:  # a filter's bookkeeping must never break the close
                log.exception("filter on_close failed", extra={"filter": f.name})


#: Ext fields of a send response that a Java client reads besides the header's own.
SEND_RESPONSE_EXT = {"MSG_REGION": "DefaultRegion", "TRACE_ON": "false"}


def busy_answer(request: RemotingCommand, remark: str) -> bytes:
    """SYSTEM_BUSY answering a send, with the ext fields of a send response (limits, shaping, failover)."""
    return encode(make_response(request, C.SYSTEM_BUSY, remark, ext_fields=dict(SEND_RESPONSE_EXT)))


def error_response(frame: Frame, code: int, remark: str) -> bytes:
    """A response frame answering ``frame`` locally with ``code`` and ``remark``."""
    return encode(make_response(frame.command(), code, remark))

"""Broker addresses inside messages point at this proxy's endpoints.

Where a client learns a broker address from a message, and what happens to it here:

=====================================  ===============================================  ============
where                                  what a client does with it                       handling
=====================================  ===============================================  ============
STOREHOST of each record in pull (11),  Go ``sendMessageBack`` (orderly retry limit) and   rewritten
lite pull (361), pop (200050), peek     Java's fallback send it CONSUMER_SEND_MSG_BACK;
(200052), query (12), view (33)         the offset message id clients compute from it
answers
``msgId`` of send answers (10, 310,     ``SendResult.offsetMsgId``: ``viewMessage`` /      rewritten
320, 324, 325): the offset message id   ``queryMsgById`` connect to the address in it      (default)
CONSUMER_SEND_MSG_BACK (36) and         sent to the endpoint the client learnt above:     accepted
VIEW_MESSAGE_BY_ID (33) requests        the 1:1 relay already takes them to that           as they are
                                        endpoint's broker (their headers carry offsets,
                                        not addresses)
=====================================  ===============================================  ============

Rewrites are same-length byte patches (:mod:`rmqfast.codec.msgaddr`): frame sizes, body CRCs
and what consumers see as the message identity (UNIQ_KEY, keys, body, properties) stay as the
broker sent them.  Only the answers to the codes above reach Python (the request is marked, the
scanner hands back only its answer, by opaque, in C); every other frame stays in C.

``policy.message_addresses``: ``"all"`` (the default) rewrites the records and the send answers;
``"records"`` only the records; ``"off"`` nothing.  Both are mapped by the scanner, in C: such a
request is relayed and tracked there (``ACTION_RECORDS``, :meth:`record_slots`), and its answer
has its addresses looked up in an :class:`rmqfast.codec.AddressMap` this filter fills and patched
in place: the store hosts of a records answer, held whole, or the offset ids in a send answer's
``msgId`` header field (``ext/records.pxi``, pure twin ``rmqfast/codec/_records_py.py``).  Only
an answer with an address the map does not know yet (the first from each broker), or one the
scanner cannot walk (a body that is not whole store records, a ``msgId`` field twice or escaped),
reaches :meth:`on_response` (``frame.records``): the address is resolved here and remembered in
the map, or the answer relayed unchanged and logged.  A send that reaches Python anyway (a delay,
limit, gray or ACL filter reads it) has its answer marked and rewritten here.  So a client that
cannot reach the brokers (another cloud, a container network) can still ``queryMsgById`` the id a
send returned: the id names a proxy endpoint, which relays VIEW_MESSAGE_BY_ID to its broker.

Pull answers from a 5.x broker may carry records whose STOREHOST is another broker (a slave
serving reads, a message moved by escape bridging): each address gets its own endpoint, like
route addresses do.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING, Any

from rmqfast import codec
from rmqfast.codec import codes as C
from rmqfast.codec.msgaddr import format_host, header_field_span, host_bytes, patch_offset_ids, patch_store_hosts
from rmqfast.filters.api import Filter, Frame, Session, Verdict, close, rewrite, slots_of
from rmqfast.log import ctx

if TYPE_CHECKING:
    from rmqfast.filters.host import ChainHost
    from rmqfast.proxy.endpoints import EndpointRegistry

log = logging.getLogger("rmqfast.addresses")

#: Answers whose body is a sequence of store records.
RECORD_CODES = frozenset({
    C.PULL_MESSAGE, C.LITE_PULL_MESSAGE, C.POP_MESSAGE, C.PEEK_MESSAGE, C.QUERY_MESSAGE, C.VIEW_MESSAGE_BY_ID,
})
MODES = ("records", "all", "off")
#: Answer codes of a send whose message was stored: SUCCESS, FLUSH_DISK_TIMEOUT, SLAVE_NOT_AVAILABLE,
#: FLUSH_SLAVE_TIMEOUT (the client builds a SendResult with the offset msgId from each).
SENT_CODES = frozenset({C.SUCCESS, 10, 11, 12})
#: Slots whose answers the scanner maps in C (ACTION_RECORDS): store hosts in records, offset ids
#: in send answers' headers.
_RECORD_SLOTS = slots_of(RECORD_CODES | C.ANY_SEND_CODES)

_PENDING = "msgaddr_opaques"
_MAX_PENDING = 10000


def advertised_ipv4(host: str) -> str | None:
    """The IPv4 address records can carry for ``host`` (resolved once when it is a name)."""
    try:
        host_bytes(host, 0)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    return str(infos[0][4][0]) if infos else None


class RewriteMessageAddresses(Filter):
    """Map the broker addresses in pull/pop/query/view records and send answers to proxy endpoints."""

    name = "message-addresses"
    wants_marked_responses = True

    def __init__(self, registry: EndpointRegistry, mode: str = "all") -> None:
        if mode not in MODES:
            raise ValueError(f"policy.message_addresses must be one of {', '.join(MODES)}; got {mode!r}")
        self.registry = registry
        self.mode = mode
        sends = C.ANY_SEND_CODES if mode == "all" else frozenset()  # their answers carry msgId
        self.codes = frozenset() if mode == "off" else RECORD_CODES | sends
        self._slots = slots_of(self.codes)
        self._map: dict[bytes, bytes] = {}  # real ip4+port -> endpoint ip4+port (itself: leave it)
        self._amaps: dict[bool, Any] = {}  # compiled? -> the AddressMap the scanners of that twin read
        self._warned: set[str] = set()
        self.ip = advertised_ipv4(registry.advertise_host)
        self._rewritten = 0  # answers changed here (the scanners count theirs in the maps)
        if self.ip is None and mode != "off":
            log.error(
                "broker addresses inside messages are left as the broker wrote them: the advertised host "
                "is not an IPv4 address and does not resolve to one (records hold 4-byte addresses); "
                "set proxy.advertise_host to an IPv4 address",
                extra=ctx(advertise_host=registry.advertise_host),
            )
            self._slots = set()

    def request_slots(self) -> set[int]:
        return self._slots - self._record_slots

    def record_slots(self) -> set[int]:
        return self._record_slots

    @property
    def _record_slots(self) -> set[int]:
        return self._slots & _RECORD_SLOTS

    def address_map(self, compiled: bool) -> Any:
        """The store-host map the scanners of ``compiled``'s twin read (made on first use, with
        every address resolved so far)."""
        if not self._record_slots:
            return None
        amap = self._amaps.get(compiled)
        if amap is None:
            amap = self._amaps[compiled] = codec.twin_class(compiled, "AddressMap")()
            for raw, new in self._map.items():
                amap.set(raw, new)
        return amap

    @property
    def rewritten(self) -> int:
        """Answers changed (here and by the scanners)."""
        return self._rewritten + sum(m.rewritten for m in self._amaps.values())

    def _remember(self, raw: bytes, new: bytes) -> None:
        self._map[raw] = new
        for amap in self._amaps.values():
            amap.set(raw, new)

    # The mapping ---------------------------------------------------------------------------------

    def mapping(self, raw: bytes) -> bytes | None:
        """8 bytes ip4+port of a real broker -> those of its endpoint; None: leave it."""
        new = self._map.get(raw)
        if new is not None:
            return None if new == raw else new
        real = format_host(raw)
        if self.registry.is_proxy_address(real):
            self._remember(raw, raw)
            return None
        adv = self.registry.advertised(real)
        if adv is None or self.ip is None:
            if real not in self._warned:
                self._warned.add(real)
                log.warning("a message names a broker with no proxy endpoint; its address is left as is "
                            "(until the configuration is reloaded)", extra=ctx(broker=real))
            self._remember(raw, raw)  # asked once: no endpoint (no port range, or it is exhausted)
            return None
        port = int(adv.rpartition(":")[2])
        new = host_bytes(self.ip, port)
        self._remember(raw, new)
        return new

    def map_offset_ids(self, value: str) -> str | None:
        """``value`` (a send answer's msgId: comma-separated ids) with each offset id's broker
        mapped to its endpoint, or None when nothing changes or send answers are not mapped (for
        answers that never pass the scanner: sends moved by failover)."""
        if self.ip is None or not self.codes & C.ANY_SEND_CODES:
            return None
        return patch_offset_ids(value, self.mapping)

    # Filter --------------------------------------------------------------------------------------

    def on_request(self, session: Session, frame: Frame) -> Verdict | None:
        if frame.code in self.codes and not frame.is_oneway:
            pending: dict[int, int] = session.state.setdefault(_PENDING, {})
            # An answer whose opaque is not pending goes to the client unrewritten (real store hosts):
            # a second request on a pending opaque, or pending opaques forgotten, would let one through.
            if frame.opaque in pending:
                return close(f"request {frame.code} reuses opaque {frame.opaque} while a request with it is "
                             "unanswered (its answer could not be told apart and rewritten)")
            if len(pending) >= _MAX_PENDING:  # long-polled pulls pipelined without end
                return close(f"more than {_MAX_PENDING} requests with broker addresses in their answers "
                             "unanswered on one connection")
            pending[frame.opaque] = frame.code
            frame.want_response = True
        return None

    def on_response(self, session: Session, frame: Frame) -> Verdict | None:
        pending: dict[int, int] | None = session.state.get(_PENDING)
        code = pending.pop(frame.opaque, None) if pending else None
        if code is None and frame.records:  # tracked by the scanner, which left the mapping to us
            # a send answer has no body; a records answer the scanner hands over always has one
            code = C.SEND_MESSAGE_V2 if len(frame.data) <= 8 + frame.header_length else C.PULL_MESSAGE
        if code is None or not (frame.code == C.SUCCESS or (code in C.ANY_SEND_CODES and frame.code in SENT_CODES)):
            return None
        data = frame.data
        if code in C.ANY_SEND_CODES:
            span = header_field_span(data, "msgId")
            if span is None:
                return None
            value = data[span[0] : span[1]].decode("ascii", "replace")
            new_value = patch_offset_ids(value, self.mapping)
            if new_value is None:
                return None
            out = bytearray(data)
            out[span[0] : span[1]] = new_value.encode("ascii")
        else:
            start = 8 + frame.header_length
            if start >= len(data):
                return None
            try:
                patched, _ = patch_store_hosts(data, self.mapping, start, self._map)
            except ValueError as exc:
                log.warning("answer body is not a sequence of store records; relayed unchanged",
                            extra=ctx(code=code, error=str(exc), upstream=session.upstream_addr))
                return None
            if patched is None:
                return None
            out = patched
        self._rewritten += 1
        return rewrite(bytes(out))

    def on_close(self, session: Session) -> None:
        session.state.pop(_PENDING, None)


def build(host: ChainHost, role: str) -> Filter:
    """``[policy]`` ``message_addresses``: broker addresses inside messages become proxy endpoints."""
    return RewriteMessageAddresses(host.registry, host.cfg.policy.message_addresses)

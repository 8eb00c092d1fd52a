"""Route bodies from the name server: ``TopicRouteData`` (105) and ``ClusterInfo`` (106).

Two JSON dialects reach clients (apache/rocketmq ``namesrv/.../ClientRequestProcessor``):

* ``"legacy"``: plain ``JSON.toJSONString`` of fastjson.  Map keys that are not strings
  (``BrokerData.brokerAddrs`` is a ``HashMap<Long, String>``) are written *bare*:
  ``"brokerAddrs":{0:"10.0.0.1:10911",1:"10.0.0.2:10911"}``, which is not valid JSON.
  ``GET_BROKER_CLUSTER_INFO`` is always answered in this dialect.
* ``"standard"``: for request version >= V4_9_4 or ``acceptStandardJsonOnly``, fastjson with
  ``BrowserCompatible, QuoteFieldNames, SkipTransientField, MapSortField``: keys quoted,
  ``/`` and every non-ASCII character escaped, maps sorted.

The parser here reads both (standard JSON plus bare integer object keys), and
:func:`rewrite_broker_addrs` patches broker addresses in place so that every other byte of
the body stays as the name server wrote it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rmqfast.codec.command import fastjson_quote
from rmqfast.errors import BodyError

Dialect = Literal["legacy", "standard"]

__all__ = [
    "PERM_READ", "PERM_WRITE", "BrokerAddr", "Dialect", "PermMapper", "detect_dialect", "encode_route",
    "parse_route", "rewrite_broker_addrs",
]

#: Deeper nesting than any route has; refuses hostile input before Python's recursion limit.
MAX_DEPTH = 64

_WS = re.compile(rb"[ \t\n\r]*")
# One character per alternative (no nested repetition), so a failing match stays linear.
_STRING = re.compile(rb'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_BARE_KEY = re.compile(rb"-?[0-9]{1,19}")  # a Java Long
_BROKER_ID = re.compile(r"-?[0-9]{1,19}")
_LITERALS = ((b"true", True), (b"false", False), (b"null", None))


@dataclass(frozen=True)
class BrokerAddr:
    """One ``brokerAddrs`` entry and the ``brokerName``/``cluster`` of its BrokerData."""

    broker_name: str | None
    broker_id: int
    addr: str
    cluster: str | None


@dataclass
class _Slot:
    """Where one address string sits in the body."""

    start: int
    end: int
    broker_id: int
    addr: str
    broker_name: str | None = None
    cluster: str | None = None


class _Parser:
    """Recursive-descent reader of route JSON that builds Python values.

    While reading it records where each string value of a ``"brokerAddrs"`` object sits and
    whether any bare key was seen (the legacy dialect).  Bare keys are returned as ``int``,
    and so are the keys of every ``brokerAddrs`` object (it is a ``Map<Long, String>``).
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.bare_keys = 0
        self.slots: list[_Slot] = []
        #: ``perm`` integers of QueueData objects: (start, end, perm, brokerName), in document order
        self.perms: list[tuple[int, int, int, str]] = []
        self.value: Any = None

    def parse(self) -> Any:
        data = self.data
        pos = self._ws(0)
        if pos == len(data):
            raise BodyError("route body is empty; expected a JSON object")
        value, pos = self._value(pos, 0)
        pos = self._ws(pos)
        if pos != len(data):
            raise BodyError(f"route body has unexpected data after the JSON value at offset {pos}")
        return value

    def _ws(self, pos: int) -> int:
        m = _WS.match(self.data, pos)
        assert m is not None  # the pattern matches the empty string
        return m.end()

    def _fail(self, pos: int, expected: str) -> BodyError:
        if pos >= len(self.data):
            return BodyError(f"route body ends at offset {pos}; expected {expected}")
        got = self.data[pos : pos + 1]
        return BodyError(f"route body has {got!r} at offset {pos}; expected {expected}")

    def _value(self, pos: int, depth: int) -> tuple[Any, int]:
        data = self.data
        if pos >= len(data):
            raise self._fail(pos, "a JSON value")
        c = data[pos]
        if c == 0x7B:  # {
            return self._object(pos, depth + 1, None)
        if c == 0x5B:  # [
            return self._array(pos, depth + 1)
        if c == 0x22:  # "
            return self._string(pos)
        m = _NUMBER.match(data, pos)
        if m is not None:
            text = m.group()
            try:
                return (float(text) if m.group(1) or m.group(2) else int(text)), m.end()
            except ValueError:  # beyond Python's integer digit limit
                raise BodyError(f"route body has a {len(text)}-digit number at offset {pos}") \
                    from None
        for word, literal in _LITERALS:
            if data.startswith(word, pos):
                return literal, pos + len(word)
        raise self._fail(pos, "a JSON value")

    def _string(self, pos: int) -> tuple[str, int]:
        m = _STRING.match(self.data, pos)
        if m is None:
            raise self._fail(pos, "a complete JSON string (closing quote, valid escapes, "
                             "no raw control characters)")
        token = m.group()
        try:
            if b"\\" in token:
                text: str = json.loads(token)
            else:
                text = token[1:-1].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BodyError(
                f"route body has invalid UTF-8 in the string at offset {pos}: {exc.reason}"
            ) from exc
        return text, m.end()

    def _key(self, pos: int) -> tuple[str | int, int]:
        if self.data[pos : pos + 1] == b'"':
            return self._string(pos)
        m = _BARE_KEY.match(self.data, pos)
        if m is None:
            raise self._fail(pos, "an object key (a string or a bare integer)")
        self.bare_keys += 1
        return int(m.group()), m.end()

    def _array(self, pos: int, depth: int) -> tuple[list[Any], int]:
        if depth > MAX_DEPTH:
            raise BodyError(f"route body nests deeper than {MAX_DEPTH} levels at offset {pos}")
        out: list[Any] = []
        pos = self._ws(pos + 1)
        if self.data[pos : pos + 1] == b"]":
            return out, pos + 1
        while True:
            value, pos = self._value(pos, depth)
            out.append(value)
            pos = self._ws(pos)
            sep = self.data[pos : pos + 1]
            if sep == b"]":
                return out, pos + 1
            if sep != b",":
                raise self._fail(pos, "',' or ']' in an array")
            pos = self._ws(pos + 1)

    def _object(
        self, pos: int, depth: int, addr_slots: list[_Slot] | None
    ) -> tuple[dict[Any, Any], int]:
        """Read an object.

        With ``addr_slots`` it is a ``brokerAddrs`` map: keys must be integers and each string
        value is recorded in ``addr_slots`` (and in document order in ``self.slots``).
        """
        if depth > MAX_DEPTH:
            raise BodyError(f"route body nests deeper than {MAX_DEPTH} levels at offset {pos}")
        obj: dict[Any, Any] = {}
        # Address slots of this object's own brokerAddrs (when it is a BrokerData), labelled
        # with its brokerName and cluster once the object is complete: they may come later.
        pending: list[_Slot] = []
        perm_at: tuple[int, int] | None = None  # where this object's "perm" integer sits
        pos = self._ws(pos + 1)
        if self.data[pos : pos + 1] == b"}":
            return obj, pos + 1
        while True:
            key_at = pos
            key, pos = self._key(pos)
            if addr_slots is not None and not isinstance(key, int):
                if not _BROKER_ID.fullmatch(key):
                    raise BodyError(
                        f"route body has brokerAddrs key {key!r} at offset {key_at}; "
                        "expected an integer broker id"
                    )
                key = int(key)
            pos = self._ws(pos)
            if self.data[pos : pos + 1] != b":":
                raise self._fail(pos, "':' after an object key")
            pos = self._ws(pos + 1)
            value_at = pos
            if key == "brokerAddrs" and self.data[pos : pos + 1] == b"{":
                value, pos = self._object(pos, depth + 1, pending)
            else:
                value, pos = self._value(pos, depth)
            if key == "perm" and type(value) is int:
                perm_at = (value_at, pos)
            if addr_slots is not None and isinstance(value, str):
                assert isinstance(key, int)
                slot = _Slot(value_at, pos, key, value)
                addr_slots.append(slot)
                self.slots.append(slot)
            obj[key] = value
            pos = self._ws(pos)
            sep = self.data[pos : pos + 1]
            if sep == b"}":
                break
            if sep != b",":
                raise self._fail(pos, "',' or '}' in an object")
            pos = self._ws(pos + 1)
        if perm_at is not None and isinstance(obj.get("brokerName"), str) and "writeQueueNums" in obj:
            self.perms.append((perm_at[0], perm_at[1], obj["perm"], obj["brokerName"]))
        if pending:
            name = obj.get("brokerName")
            cluster = obj.get("cluster")
            for slot in pending:
                slot.broker_name = name if isinstance(name, str) else None
                slot.cluster = cluster if isinstance(cluster, str) else None
        return obj, pos + 1


def _parse(body: bytes | bytearray | memoryview) -> _Parser:
    parser = _Parser(bytes(body))
    parser.value = parser.parse()
    return parser


def _parse_object(body: bytes | bytearray | memoryview) -> _Parser:
    parser = _parse(body)
    if not isinstance(parser.value, dict):
        raise BodyError(
            f"route body is a JSON {type(parser.value).__name__}; expected an object"
        )
    return parser


def detect_dialect(body: bytes | bytearray | memoryview) -> Dialect:
    """``"legacy"`` if the body has a bare (unquoted) key anywhere, else ``"standard"``.

    A legacy body without any bare key (no broker at all) is valid JSON and reads as
    standard; re-emitting it as standard JSON is then harmless.
    """
    return "legacy" if _parse_object(body).bare_keys else "standard"


def parse_route(body: bytes | bytearray | memoryview) -> tuple[dict[Any, Any], Dialect]:
    """Parse a route or cluster-info body of either dialect into ``(object, dialect)``.

    Keys are ``str`` except: every ``brokerAddrs`` map has ``int`` broker ids in both
    dialects (it is a ``Map<Long, String>``), and any other bare key of a legacy body (e.g.
    a static topic's ``currIdMap``) is an ``int``.  :func:`encode_route` writes ``int`` keys
    bare in the legacy dialect, so ``encode_route(*parse_route(b))`` keeps the dialect.
    """
    parser = _parse_object(body)
    return parser.value, ("legacy" if parser.bare_keys else "standard")


def _sort_key(key: Any) -> tuple[int, Any]:
    # fastjson sorts bean fields by name and, with MapSortField, maps by natural key order.
    return (0, key) if isinstance(key, int) else (1, key)


def _emit(value: Any, legacy: bool, sort: bool, out: list[str], in_addrs: bool = False) -> None:
    if isinstance(value, str):
        out.append(fastjson_quote(value, browser_compatible=not legacy))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"route value {value!r} has no JSON representation")
        out.append(repr(value))
    elif isinstance(value, dict):
        _emit_object(value, legacy, sort, out, in_addrs)
    elif isinstance(value, list | tuple | set | frozenset):
        seq = sorted(value) if sort and isinstance(value, set | frozenset) else value
        out.append("[")
        for n, item in enumerate(seq):
            if n:
                out.append(",")
            _emit(item, legacy, sort, out)
        out.append("]")
    else:
        raise TypeError(f"route value {value!r} of type {type(value).__name__} is not JSON")


def _emit_object(value: dict[Any, Any], legacy: bool, sort: bool, out: list[str], in_addrs: bool) -> None:
    items: list[tuple[Any, Any]] = []
    for key, item in value.items():
        if in_addrs and isinstance(key, str) and _BROKER_ID.fullmatch(key):
            key = int(key)  # a brokerAddrs map is Map<Long, String>
        elif isinstance(key, bool) or not isinstance(key, int | str):
            raise TypeError(f"route key {key!r} must be a str or an int")
        items.append((key, item))
    if sort:
        items.sort(key=lambda kv: _sort_key(kv[0]))
    out.append("{")
    for n, (key, item) in enumerate(items):
        if n:
            out.append(",")
        if isinstance(key, int):
            out.append(str(key) if legacy else f'"{key}"')
        else:
            out.append(fastjson_quote(key, browser_compatible=not legacy))
        out.append(":")
        _emit(item, legacy, sort, out, in_addrs=key == "brokerAddrs")
    out.append("}")


def encode_route(obj: dict[Any, Any], dialect: Dialect, *, sort_keys: bool = False) -> bytes:
    """Write ``obj`` compactly in ``dialect``.

    Legacy: ``int`` keys, and integer keys of ``brokerAddrs`` maps, are written bare; strings
    use fastjson's default escaping.  Standard: every key is quoted and strings use the
    ``BrowserCompatible`` escaping of the name server.  Keys keep the order of ``obj``
    unless ``sort_keys`` sorts them the way fastjson does (integers numerically first).
    """
    if dialect not in ("legacy", "standard"):
        raise ValueError(f"dialect must be 'legacy' or 'standard', got {dialect!r}")
    out: list[str] = []
    _emit(obj, dialect == "legacy", sort_keys, out)
    return "".join(out).encode("utf-8", "replace")


PERM_READ = 4
PERM_WRITE = 2

#: ``perm(found, broker_name, perm)``: the new ``perm`` of a QueueData, or ``None`` to keep it.
PermMapper = Callable[[list[BrokerAddr], str, int], "int | None"]


def rewrite_broker_addrs(
    body: bytes | bytearray | memoryview, mapper: Callable[[str], str | None],
    *, perm: PermMapper | None = None,
) -> tuple[bytes, list[BrokerAddr]]:
    """Replace broker addresses in a route or cluster-info body by patching bytes.

    ``mapper`` is called, in document order, with every string value of every
    ``"brokerAddrs"`` object (TopicRouteData ``brokerDatas[*]``, ClusterInfo
    ``brokerAddrTable[*]``, wherever they sit).  A returned string different from the address
    replaces it, escaped for the body's dialect; ``None`` keeps it.  All other bytes stay
    identical.  Returns the new body (the input object itself if nothing changed and it was
    ``bytes``) and every address found, with the ``brokerName`` and ``cluster`` of its
    BrokerData.  The body is fully validated before ``mapper`` is first called.

    ``perm``, when given, is then called for every QueueData (``brokerName``, ``perm``,
    ``writeQueueNums``... of TopicRouteData ``queueDatas``) with every address found: a returned
    integer replaces the ``perm`` digits (route healing clears :data:`PERM_WRITE` of a dead
    master's queues so that producers avoid them and consumers keep them).
    """
    parser = _parse_object(body)
    data = parser.data
    browser_compatible = not parser.bare_keys
    found: list[BrokerAddr] = []
    edits: list[tuple[int, int, bytes]] = []
    for slot in parser.slots:
        found.append(BrokerAddr(slot.broker_name, slot.broker_id, slot.addr, slot.cluster))
        new = mapper(slot.addr)
        if new is None or new == slot.addr:
            continue
        if not isinstance(new, str):
            raise TypeError(f"mapper returned {new!r} for {slot.addr!r}; expected str or None")
        edits.append((slot.start, slot.end,
                      fastjson_quote(new, browser_compatible=browser_compatible).encode("utf-8", "replace")))
    if perm is not None:
        for start, end, old_perm, name in parser.perms:
            new_perm = perm(found, name, old_perm)
            if new_perm is None or new_perm == old_perm:
                continue
            if type(new_perm) is not int:
                raise TypeError(f"perm mapper returned {new_perm!r} for {name!r}; expected int or None")
            edits.append((start, end, str(new_perm).encode()))
    if not edits:
        return (body if isinstance(body, bytes) else data), found
    edits.sort()
    pieces: list[bytes] = []
    last = 0
    for start, end, text in edits:
        pieces.append(data[last:start])
        pieces.append(text)
        last = end
    pieces.append(data[last:])
    return b"".join(pieces), found

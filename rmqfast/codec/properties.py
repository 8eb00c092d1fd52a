"""Message properties strings: ``k\\x01v\\x02k\\x01v\\x02...``.

This is the encoding of ``Message.properties`` used in the ``i`` (properties) field of
``SendMessageRequestHeaderV2``, in batch bodies and in store records
(``MessageDecoder.messageProperties2String`` / ``string2messageProperties`` in
apache/rocketmq ``common/.../message/MessageDecoder.java``).
"""

from __future__ import annotations

from collections.abc import Mapping

#: Separates a name from its value (``MessageDecoder.NAME_VALUE_SEPARATOR``).
NAME_VALUE_SEPARATOR = "\x01"
#: Terminates every name/value pair (``MessageDecoder.PROPERTY_SEPARATOR``).
PROPERTY_SEPARATOR = "\x02"

#: Java reads the properties length of batch and store records as a signed short.
MAX_PROPERTIES_BYTES = 32767

# Well-known keys (apache/rocketmq ``MessageConst``).
KEYS = "KEYS"
TAGS = "TAGS"
WAIT = "WAIT"
DELAY = "DELAY"
RETRY_TOPIC = "RETRY_TOPIC"
REAL_TOPIC = "REAL_TOPIC"
REAL_QID = "REAL_QID"
TRAN_MSG = "TRAN_MSG"
PGROUP = "PGROUP"
MIN_OFFSET = "MIN_OFFSET"
MAX_OFFSET = "MAX_OFFSET"
ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
RECONSUME_TIME = "RECONSUME_TIME"
MSG_REGION = "MSG_REGION"
TRACE_ON = "TRACE_ON"
UNIQ_KEY = "UNIQ_KEY"
MAX_RECONSUME_TIMES = "MAX_RECONSUME_TIMES"
CONSUME_START_TIME = "CONSUME_START_TIME"
INNER_NUM = "INNER_NUM"
INNER_BASE = "INNER_BASE"
TRANSACTION_ID = "__transactionId__"
TRANSACTION_CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
CHECK_IMMUNITY_TIME_IN_SECONDS = "CHECK_IMMUNITY_TIME_IN_SECONDS"
INSTANCE_ID = "INSTANCE_ID"
CORRELATION_ID = "CORRELATION_ID"
REPLY_TO_CLIENT = "REPLY_TO_CLIENT"
TTL = "TTL"
CLUSTER = "CLUSTER"
MSG_TYPE = "MSG_TYPE"
POP_CK = "POP_CK"
POP_CK_OFFSET = "POP_CK_OFFSET"
FIRST_POP_TIME = "1ST_POP_TIME"
SHARDING_KEY = "__SHARDINGKEY"
TRACE_CONTEXT = "TRACE_CONTEXT"
TIMER_DELAY_SEC = "TIMER_DELAY_SEC"
TIMER_DELIVER_MS = "TIMER_DELIVER_MS"
TIMER_DELAY_MS = "TIMER_DELAY_MS"
BORN_HOST = "__BORNHOST"
BORN_TIMESTAMP = "BORN_TIMESTAMP"
CRC32 = "__CRC32#"
DLQ_ORIGIN_TOPIC = "DLQ_ORIGIN_TOPIC"
DLQ_ORIGIN_MESSAGE_ID = "DLQ_ORIGIN_MESSAGE_ID"

#: ``KEYS`` holds several keys separated by this (``MessageConst.KEY_SEPARATOR``).
KEY_SEPARATOR = " "


def parse_properties(s: str | bytes | bytearray | memoryview) -> dict[str, str]:
    """Parse a properties string exactly like Java's ``string2messageProperties`` (4.9.x, 5.x).

    The string is cut at every ``\\x02``; each piece is split at its *first* ``\\x01``.  A piece
    is kept only if both the name and the value are non-empty, so pieces without a
    ``\\x01``, empty pieces (the one after the final ``\\x02``), ``"\\x01v"`` and ``"k\\x01"``
    are skipped silently, as in Java.  A value may contain further ``\\x01`` characters.  A
    later duplicate name overwrites the earlier value (Java puts into a ``HashMap``); the
    dict keeps the first position.  Bytes are decoded as UTF-8 with invalid sequences
    replaced by U+FFFD, as ``new String(bytes, UTF_8)`` does.
    """
    if not isinstance(s, str):
        s = bytes(s).decode("utf-8", "replace")
    out: dict[str, str] = {}
    for piece in s.split(PROPERTY_SEPARATOR):
        name, sep, value = piece.partition(NAME_VALUE_SEPARATOR)
        if sep and name and value:
            out[name] = value
    return out


def format_properties(props: Mapping[str, str | None]) -> str:
    """Format ``props`` like Java's ``messageProperties2String``: ``k\\x01v\\x02`` per pair.

    ``None`` values are skipped, as Java skips null values.  Unlike Java this refuses pairs
    that :func:`parse_properties` could not read back (an empty name or value, a name with a
    separator, a value with ``\\x02``): Java would silently write a string that loses them.
    """
    parts: list[str] = []
    for name, value in props.items():
        if value is None:
            continue
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(
                f"property {name!r}: names and values must be str, got "
                f"{type(name).__name__} -> {type(value).__name__}"
            )
        if not name or NAME_VALUE_SEPARATOR in name or PROPERTY_SEPARATOR in name:
            raise ValueError(
                f"property name {name!r} is empty or contains \\x01/\\x02; "
                "it would not survive parsing"
            )
        if not value or PROPERTY_SEPARATOR in value:
            raise ValueError(
                f"property {name!r} has value {value!r}, which is empty or contains \\x02; "
                "Java's parser would drop or split it"
            )
        parts.append(name)
        parts.append(NAME_VALUE_SEPARATOR)
        parts.append(value)
        parts.append(PROPERTY_SEPARATOR)
    return "".join(parts)


def encode_properties(props: Mapping[str, str | None]) -> bytes:
    """:func:`format_properties` as UTF-8 bytes (unpaired surrogates become ``?``, as in Java)."""
    return format_properties(props).encode("utf-8", "replace")


def properties_bytes_for(props: Mapping[str, str], raw: bytes | None) -> bytes:
    """The properties bytes to emit for a decoded record.

    ``raw`` are the bytes the record was decoded from.  They are emitted unchanged while
    ``props`` still says what they parse to, so that decoding and re-encoding a record is
    byte-exact even for strings Java would not produce itself (missing final ``\\x02``,
    duplicate names, skipped fragments); once ``props`` was changed, the canonical format
    is emitted instead.
    """
    if raw is not None and parse_properties(raw) == dict(props):
        return raw
    return encode_properties(props)

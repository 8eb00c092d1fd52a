"""A send's header fields by their SendMessageRequestHeaderV2 short names, whatever its code.

SEND_MESSAGE (10) names the fields in full (``topic``, ``properties``...); SEND_MESSAGE_V2
(310) and SEND_BATCH_MESSAGE (320) use the short names ``a`` .. ``n``.  The filters that take
a send over (shaping, delayed messages, cross-cloud copies) read them through :func:`send_fields`.
"""

from __future__ import annotations

from rmqfast.codec import codes as C

#: SendMessageRequestHeader field names by SendMessageRequestHeaderV2 short name.
V1_FIELDS = {
    "a": "producerGroup", "b": "topic", "e": "queueId", "f": "sysFlag", "g": "bornTimestamp", "h": "flag",
    "i": "properties", "j": "reconsumeTimes", "l": "maxReconsumeTimes", "n": "bname",
}
#: ``sysFlag`` bit of a prepared transaction half.
TRANSACTION_PREPARED = 1 << 2


#: codes whose header is SendMessageRequestHeader (long field names); the others use the V2 short names
V1_CODES = (C.SEND_MESSAGE, C.SEND_REPLY_MESSAGE)


def send_fields(code: int, ext: dict[str, str] | None) -> dict[str, str]:
    """The send's ext fields by short name (``b`` the topic, ``i`` the properties...)."""
    ext = ext or {}
    if code in V1_CODES:
        return {k: ext[v] for k, v in V1_FIELDS.items() if ext.get(v) is not None}
    return ext


def is_batch(code: int, ext: dict[str, str] | None) -> bool:
    """Whether the broker takes this send as a batch (its messages in the body): the header's batch
    flag (``m``; ``batch`` in SEND_MESSAGE's long names) reads true as Boolean.parseBoolean reads
    it, "true" in any case, whatever the request code; reply messages are never batches."""
    ext = ext or {}
    if code == C.SEND_MESSAGE:
        v = ext.get("batch")
    elif code in (C.SEND_MESSAGE_V2, C.SEND_BATCH_MESSAGE):
        v = ext.get("m")
    else:
        return False
    return v is not None and len(v) == 4 and v.lower() == "true"


def field_int(v: str | None, default: int = 0) -> int:
    """An integer header field; ``default`` when absent or not a number."""
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default

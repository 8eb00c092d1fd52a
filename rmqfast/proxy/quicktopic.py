"""The topic of a send, read from its JSON header without decoding it (the filters' fast skip).

A filter that acts on some topics only (delayed messages, cross-cloud copies) uses it to let
the other sends through without a header decode. It answers None whenever the broker could read
another topic than the one found here (a binary header, escapes, a repeated or decoy key): the
caller then decodes the header the strict way, so what the filter decides is what the broker reads.
"""

from __future__ import annotations

from rmqfast.codec import codes as C
from rmqfast.filters.api import Frame


def quick_topic(frame: Frame) -> str | None:
    """The topic of a send with a JSON header, found without decoding the header (None: unsure)."""
    data = frame.data
    if data[4] != 0:  # ROCKETMQ binary header
        return None
    end = 8 + frame.header_length
    header = data[8:end]
    # Unsure when the broker may read the topic under a key spelled otherwise (an escape in a key)
    # while a plain decoy sits where it reads nothing (a nested object, an ignored top-level field):
    # the quoted key name appears once, and the only escapes are the properties' separators.
    if b"\\x" in header or b"\\U" in header or \
            header.count(b"\\u") != header.count(b"\\u0001") + header.count(b"\\u0002"):
        return None
    if header.count(b'"topic"' if frame.code == C.SEND_MESSAGE else b'"b"') != 1:
        return None
    key = b'"topic":"' if frame.code == C.SEND_MESSAGE else b'"b":"'
    i = data.find(key, 8, end)
    if i < 0 or data.find(key, i + 1, end) >= 0:
        return None
    i += len(key)
    j = data.find(b'"', i, end)
    if j < 0 or b"\\" in data[i:j]:
        return None
    return data[i:j].decode("utf-8", "replace")

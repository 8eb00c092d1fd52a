"""After a crash: did the broker already store a message the previous run was releasing?

A held message is deleted once the broker answered SUCCESS for its release; a worker killed
between the two would send it again.  The releaser records (unsynced, which a process crash
keeps) the last due key it read for release; after a restart, each held message at or before
that key is looked up first, by its ``UNIQ_KEY`` in the broker's message index
(``QUERY_MESSAGE``, code 12, with ``_UNIQUE_KEY_QUERY=true``, as ``mqadmin queryMsgByUniqueKey``
asks), and sent only when the broker does not have it.
"""

from __future__ import annotations

from typing import Any

from rmqfast.codec import codes as C
from rmqfast.delay.store import Held

QUERY_NOT_FOUND = 26


def broker_has(pool: Any, held: Held, *, timeout: float = 5.0) -> bool:
    """True when the broker's index finds this message's UNIQ_KEY in its topic (raises when unsure)."""
    uniq = held.msg_id
    if not uniq:
        return False
    ext = {
        "topic": held.record.topic,
        "key": uniq,
        "maxNum": "32",
        "beginTimestamp": "0",
        "endTimestamp": str(2**62),
        "_UNIQUE_KEY_QUERY": "true",
    }
    resp = pool.request(held.addr, C.QUERY_MESSAGE, ext, b"", timeout=timeout)
    if resp.code == QUERY_NOT_FOUND:
        return False
    if resp.code != C.SUCCESS:
        raise RuntimeError(f"{held.addr} answered QUERY_MESSAGE with code {resp.code}: {resp.remark}")
    # the index is a hash: check the answer really holds this UNIQ_KEY
    return b"UNIQ_KEY\x01" + uniq.encode() in (resp.body or b"")

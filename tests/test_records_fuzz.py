"""The records walk against a model of the client's reading (rmqfast/testing/records_fuzz.py).

A record's TOTALSIZE is only stored by a Java client (``MessageDecoder.decode`` reads field by
field), so a body whose length fields disagree with TOTALSIZE would be read as other records than
the walk's: the walk must then leave it (REC_BAD), never patch bytes the client reads as a body,
topic or properties.  ``python -m rmqfast.testing.records_fuzz --seconds 600`` runs longer.
"""

from __future__ import annotations

import struct

import pytest

from rmqfast.codec import _scan_py
from rmqfast.codec.msgaddr import patch_store_hosts
from rmqfast.codec.store import BORNHOST_V6_FLAG, MAGIC_V2, STOREHOST_V6_FLAG
from rmqfast.testing import records_fuzz as rf


def two_records(magic: int = 0) -> bytes:
    import random

    r = random.Random(5)
    recs = [rf._record(r, i) for i in range(2)]
    for x in recs:
        x.store_host, x.sys_flag = "10.1.2.3:10911", 0
        x.born_host = "192.168.0.9:5555"
        if magic:
            x.magic = magic
    return rf.encode_records(recs)


def lie(body: bytes, field: str, value: int) -> bytes:
    at, width = rf._length_fields(body, 0)[field]
    out = bytearray(body)
    rf._put(out, at, width, value)
    return bytes(out)


def field(body: bytes, name: str) -> int:
    at, width = rf._length_fields(body, 0)[name]
    return int.from_bytes(body[at : at + width], "big", signed=True)


@pytest.mark.parametrize("magic", [0, MAGIC_V2])
@pytest.mark.parametrize("name,delta", [("body", 4), ("body", -4), ("topic", 3), ("props", -2), ("props", 91),
                                        ("sysflag", BORNHOST_V6_FLAG), ("sysflag", STOREHOST_V6_FLAG)])
def test_a_record_whose_fields_do_not_end_at_its_totalsize_is_left_alone(magic: int, name: str, delta: int) -> None:
    body = two_records(magic)
    bad = lie(body, name, field(body, name) ^ delta if name == "sysflag" else field(body, name) + delta)
    for m in rf.twins():
        buf = bytearray(bad)
        status = m.walk_store_hosts(buf, 0, len(buf), rf._fill(m), True)[0]
        assert status == _scan_py.REC_BAD and bytes(buf) == bad
        assert m.walk_store_hosts(bytearray(body), 0, len(body), rf._fill(m), True)[0] == _scan_py.REC_OK
    with pytest.raises(ValueError, match="do not end there|claims"):
        patch_store_hosts(bad, rf.MAPPING.get)
    assert rf.check_walk(bad, rf.twins()) == _scan_py.REC_BAD


def swallowing_body() -> bytes:
    """Two well-formed records, then the first's body length made to cover the second: a client
    reads one record whose body holds the second record's bytes (its store host among them),
    and its topic and properties lengths from bytes placed in the second's body."""
    from rmqfast.codec.store import StoreRecord

    r0 = StoreRecord(topic="T", body=b"a", properties={"K": "v"}, store_host="10.1.2.3:10911",
                     born_host="1.2.3.4:5")
    r1 = StoreRecord(topic="T", body=b"\x00" * 64, properties={"K": "v"}, store_host="10.1.2.3:10911",
                     born_host="1.2.3.4:5")
    body = bytearray(rf.encode_records([r0, r1]))
    off1 = struct.unpack_from(">i", body, 0)[0]
    t = off1 + 88  # the second record's body: the client's topic length of the first
    struct.pack_into(">i", body, 84, off1)  # the first record's body length
    struct.pack_into(">bh", body, t, 0, len(body) - (t + 3))
    return bytes(body)


def test_a_body_length_covering_the_next_record_is_not_patched() -> None:
    body = swallowing_body()
    recs, stop = rf.client_reading(body, 0, len(body))
    assert stop == len(body) and [(x.start, x.end) for x in recs] == [(0, len(body))]  # one record to a client
    assert rf.check_walk(body, rf.twins()) == _scan_py.REC_BAD


def test_client_model_reads_what_the_encoder_wrote() -> None:
    body = two_records() + two_records(MAGIC_V2)
    recs, stop = rf.client_reading(body, 0, len(body))
    assert stop == len(body) and len(recs) == 4
    assert [x.end - x.start for x in recs] == [struct.unpack_from(">i", body, x.start)[0] for x in recs]


@pytest.mark.parametrize("seed", [11, 12])
def test_differential_fuzz(seed: int) -> None:
    counts = rf.run(seconds=2.0, seed=seed)
    assert counts["ok"] > 0 and counts["miss"] > 0 and counts["bad"] > 0 and counts["scanned"] > 0

"""One copy of a sent message (or batch), as the spill stores it and the deliverer sends it.

A copy keeps what a remote send needs to reproduce the original exactly: the topic, the
queue the producer chose (so order per message queue / sharding key survives), the system
flag (compression), the born timestamp, the user flag, the properties string (``UNIQ_KEY``
included, so consumers in the remote cloud can deduplicate) and the body.  A batch
(SEND_BATCH_MESSAGE, 320) is kept as one copy with its encoded batch body.

Encoding (big-endian), version 1::

    u8  version (1)     u8  kind (0 single, 1 batch)
    i64 created_ms      wall clock when the proxy took the copy (backlog age, lag)
    i32 queue_id        i32 sys_flag     i64 born_timestamp   i32 flag
    i32 reconsume_times i32 max_reconsume_times
    u16 len + topic (UTF-8)            u16 len + broker_name (UTF-8, may be empty)
    u16 len + producer_group (UTF-8)   u32 len + properties (UTF-8)
    body (the rest)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rmqfast.codec.sendheader import field_int
from rmqfast.errors import BodyError

VERSION = 1
KIND_SINGLE = 0
KIND_BATCH = 1

_FIXED = struct.Struct(">BBqiiqiii")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

#: The property that marks a copy: its value is the name of the cloud it came from.
ORIGIN_PROPERTY = "RMQFAST_ORIGIN"


@dataclass
class CopyRecord:
    topic: str
    body: bytes
    properties: str = ""
    queue_id: int = 0
    sys_flag: int = 0
    born_timestamp: int = 0
    flag: int = 0
    reconsume_times: int = 0
    max_reconsume_times: int = 16
    broker_name: str = ""
    producer_group: str = ""
    kind: int = KIND_SINGLE
    created_ms: int = 0

    @property
    def is_batch(self) -> bool:
        return self.kind == KIND_BATCH

    @classmethod
    def from_send(cls, ext: dict[str, str], *, body: bytes, properties: str, batch: bool,
                  created_ms: int) -> CopyRecord:
        """A send kept by the proxy, from its header fields by short name
        (:func:`rmqfast.codec.sendheader.send_fields`)."""
        return cls(
            topic=ext["b"], body=body, properties=properties, queue_id=field_int(ext.get("e")),
            sys_flag=field_int(ext.get("f")), born_timestamp=field_int(ext.get("g")), flag=field_int(ext.get("h")),
            reconsume_times=field_int(ext.get("j")), max_reconsume_times=field_int(ext.get("l"), 16),
            broker_name=ext.get("n") or "", producer_group=ext.get("a") or "",
            kind=KIND_BATCH if batch else KIND_SINGLE, created_ms=created_ms,
        )

    def encode(self) -> bytes:
        t = self.topic.encode()
        b = self.broker_name.encode()
        g = self.producer_group.encode()
        p = self.properties.encode("utf-8", "replace")
        return b"".join(
            (
                _FIXED.pack(
                    VERSION,
                    self.kind,
                    self.created_ms,
                    self.queue_id,
                    self.sys_flag,
                    self.born_timestamp,
                    self.flag,
                    self.reconsume_times,
                    self.max_reconsume_times,
                ),
                _U16.pack(len(t)),
                t,
                _U16.pack(len(b)),
                b,
                _U16.pack(len(g)),
                g,
                _U32.pack(len(p)),
                p,
                self.body,
            )
        )

    @classmethod
    def decode(cls, data: bytes | memoryview) -> CopyRecord:
        mv = memoryview(data)
        if len(mv) < _FIXED.size:
            raise BodyError(f"spill record of {len(mv)} bytes is shorter than its {_FIXED.size}-byte fixed part")
        version, kind, created, qid, sysflag, born, flag, recon, maxrecon = _FIXED.unpack_from(mv, 0)
        if version != VERSION:
            raise BodyError(
                f"spill record version {version} is not supported (this rmqfast reads version {VERSION}); "
                "drain the spill with the rmqfast version that wrote it"
            )
        pos = _FIXED.size
        strings = []
        for what in ("topic", "broker name", "producer group"):
            if pos + 2 > len(mv):
                raise BodyError(f"spill record truncated before its {what} length at offset {pos}")
            (n,) = _U16.unpack_from(mv, pos)
            pos += 2
            if pos + n > len(mv):
                raise BodyError(f"spill record: {what} of {n} bytes at offset {pos} runs past the end")
            strings.append(bytes(mv[pos : pos + n]).decode("utf-8", "replace"))
            pos += n
        if pos + 4 > len(mv):
            raise BodyError(f"spill record truncated before its properties length at offset {pos}")
        (n,) = _U32.unpack_from(mv, pos)
        pos += 4
        if pos + n > len(mv):
            raise BodyError(f"spill record: properties of {n} bytes at offset {pos} run past the end")
        props = bytes(mv[pos : pos + n]).decode("utf-8", "replace")
        pos += n
        return cls(
            topic=strings[0],
            broker_name=strings[1],
            producer_group=strings[2],
            properties=props,
            body=bytes(mv[pos:]),
            queue_id=qid,
            sys_flag=sysflag,
            born_timestamp=born,
            flag=flag,
            reconsume_times=recon,
            max_reconsume_times=maxrecon,
            kind=kind,
            created_ms=created,
        )


def created_ms_of(data: bytes | memoryview) -> int:
    """The creation time of an encoded record without decoding the rest."""
    return _FIXED.unpack_from(data, 0)[2]


def topic_of(data: bytes | memoryview) -> str:
    (n,) = _U16.unpack_from(data, _FIXED.size)
    return bytes(memoryview(data)[_FIXED.size + 2 : _FIXED.size + 2 + n]).decode("utf-8", "replace")

"""Transactional messages through the gRPC front: transaction ids, producer registration, check-back.

A transactional send is a half message (``TRAN_MSG``, ``TRANSACTION_PREPARED_TYPE``) whose producer
group (``PGROUP``) is its topic, as Apache's gRPC proxy writes it.  EndTransaction needs the half
message's broker, commit-log offset and queue offset: the front gives the client a transaction id
that carries them (:class:`TxId`), so nothing is kept per transaction; the client hands it back
with EndTransaction, and the front checks the broker against the topic's route before it sends
END_TRANSACTION there.

Check-back: the broker asks a channel of the half message's producer group
(CHECK_TRANSACTION_STATE).  Each front process registers, with a HEART_BEAT to every broker of the
topic, the topics its gRPC producers publish (each client's Telemetry ``settings``), so the broker
asks a front that has such a producer; that front relays the question over one of those
producers' Telemetry streams as a ``RecoverOrphanedTransactionCommand`` and the client answers with
EndTransaction (``SOURCE_SERVER_CHECK``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from rmqfast.grpcfront.convert import BadRequest

#: MessageSysFlag: commitOrRollback of END_TRANSACTION
TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT_TYPE, TRANSACTION_ROLLBACK_TYPE = 0, 8, 12
#: Telemetry commands queued for one client before the front drops further check-backs
STREAM_QUEUE = 1024


@dataclass(frozen=True)
class TxId:
    """The transaction id the front gives a client: ``commitLogOffset queueOffset broker transactionId``
    (the broker name percent-encoded, so the four fields split on the first three spaces)."""

    commit_log_offset: int
    queue_offset: int
    broker: str
    transaction_id: str

    def encode(self) -> str:
        return f"{self.commit_log_offset} {self.queue_offset} {quote(self.broker, safe='')} {self.transaction_id}"

    @classmethod
    def decode(cls, text: str) -> TxId:
        parts = text.split(" ", 3)
        if len(parts) != 4 or not all(p.isdigit() for p in parts[:2]) or not parts[2]:
            raise BadRequest("INVALID_TRANSACTION_ID", "transaction id is not one this proxy gave")
        return cls(int(parts[0]), int(parts[1]), unquote(parts[2]), parts[3])


def commit_log_offset(offset_msg_id: str) -> int:
    """The commit-log offset in a broker's offset message id (``MessageDecoder.decodeMessageId``: store
    address, 4 or 16 bytes, port, then the offset as the last 8 bytes, in hex)."""
    if len(offset_msg_id) not in (32, 56):
        raise ValueError(f"offset message id {offset_msg_id!r} has an unexpected length")
    return int(offset_msg_id[-16:], 16)


def heartbeat_body(client_id: str, groups: list[str]) -> bytes:
    """HEART_BEAT body registering ``groups`` as producer groups of this client (``HeartbeatData``)."""
    return json.dumps({"clientID": client_id, "consumerDataSet": [],
                       "producerDataSet": [{"groupName": g} for g in groups]}).encode()


class Stream:
    """One client's Telemetry stream: the commands waiting to be written to it."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.topics: frozenset[str] = frozenset()
        self.out: asyncio.Queue[Any] = asyncio.Queue(STREAM_QUEUE)


class Producers:
    """The Telemetry streams of this process's producers, by the topics they publish."""

    def __init__(self) -> None:
        self._by_topic: dict[str, list[Stream]] = {}
        self._rr = itertools.count()

    def publish(self, stream: Stream, topics: frozenset[str]) -> tuple[set[str], set[str]]:
        """``stream`` publishes ``topics`` (from its settings); returns the topics new to this process and
        those it no longer has a producer of."""
        gone = self.remove(stream)
        stream.topics = topics
        new = set()
        for t in topics:
            streams = self._by_topic.setdefault(t, [])
            if not streams and t not in gone:
                new.add(t)
            streams.append(stream)
        return new, gone - topics

    def remove(self, stream: Stream) -> set[str]:
        """Forget ``stream``; returns the topics this process no longer has a producer of."""
        gone = set()
        for t in stream.topics:
            streams = self._by_topic.get(t, [])
            if stream in streams:
                streams.remove(stream)
            if not streams:
                self._by_topic.pop(t, None)
                gone.add(t)
        stream.topics = frozenset()
        return gone

    def pick(self, topic: str) -> Stream | None:
        streams = self._by_topic.get(topic)
        if not streams:
            return None
        return streams[next(self._rr) % len(streams)]

    def topics(self) -> list[str]:
        return sorted(self._by_topic)

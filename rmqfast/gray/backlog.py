"""The backlog of a group's gray queues, asked of the brokers (``rmqfast gray status --backlog``).

Per split topic: its route from the name servers (``GET_ROUTEINFO_BY_TOPIC``), then for every gray
queue of every master ``GET_MAX_OFFSET`` and the group's ``QUERY_CONSUMER_OFFSET``; backlog = max
offset - committed offset (a queue the group never committed counts from 0).  Blocking sockets with a
short timeout: the admin endpoint answers from a thread of its own.
"""

from __future__ import annotations

import itertools
import socket
import struct
from typing import Any

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.codec.route import parse_route
from rmqfast.gray.config import GrayGroup
from rmqfast.gray.rules import is_gray_queue

_opaques = itertools.count(1)
MAX_FRAME = 16 * 1024 * 1024


class BacklogError(RuntimeError):
    pass


def _request(sock: socket.socket, code: int, ext: dict[str, str]) -> RemotingCommand:
    opaque = next(_opaques) & 0x7FFFFFFF
    sock.sendall(encode(RemotingCommand(code=code, opaque=opaque, ext_fields=ext)))
    while True:
        head = _read(sock, 4)
        (length,) = struct.unpack(">i", head)
        if not 0 < length <= MAX_FRAME:
            raise BacklogError(f"frame of {length} bytes")
        cmd = decode_frame(head + _read(sock, length))
        if cmd.opaque == opaque and cmd.is_response:
            return cmd


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise BacklogError("connection closed")
        out += chunk
    return out


class _Conns:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.socks: dict[str, socket.socket] = {}

    def request(self, addr: str, code: int, ext: dict[str, str]) -> RemotingCommand:
        s = self.socks.get(addr)
        if s is None:
            host, _, port = addr.rpartition(":")
            try:
                s = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout)
            except (OSError, ValueError) as exc:
                raise BacklogError(f"cannot connect to {addr}: {exc}") from exc
            self.socks[addr] = s
        try:
            return _request(s, code, ext)
        except (OSError, ValueError) as exc:
            raise BacklogError(f"{addr}: {exc}") from exc

    def close(self) -> None:
        for s in self.socks.values():
            s.close()


def _route(conns: _Conns, namesrvs: list[str], topic: str) -> tuple[dict[str, str], list[tuple[str, int]]]:
    errors = []
    for ns in namesrvs:
        try:
            resp = conns.request(ns, C.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
        except BacklogError as exc:
            errors.append(str(exc))
            continue
        if resp.code != C.SUCCESS:
            errors.append(f"{ns}: route of {topic}: code {resp.code} {resp.remark or ''}".strip())
            continue
        obj, _ = parse_route(resp.body)
        masters = {}
        for bd in obj.get("brokerDatas") or []:
            addrs = bd.get("brokerAddrs") or {}
            if addrs.get(0) or addrs.get("0"):
                masters[str(bd.get("brokerName"))] = str(addrs.get(0) or addrs.get("0"))
        queues = [(str(q.get("brokerName")), int(q.get("readQueueNums", q.get("writeQueueNums", 0))))
                  for q in obj.get("queueDatas") or []]
        return masters, queues
    raise BacklogError("; ".join(errors) or "no name server")


def gray_backlog(g: GrayGroup, namesrvs: list[str], timeout: float = 2.0) -> dict[str, Any]:
    """``{"queues": [{topic, broker, queue, max, committed, backlog}], "total": N}`` or ``{"error": ...}``."""
    conns = _Conns(timeout)
    rows: list[dict[str, Any]] = []
    try:
        for topic in g.topics:
            masters, queues = _route(conns, namesrvs, topic)
            for broker, n in queues:
                addr = masters.get(broker)
                if addr is None:
                    continue
                for q in range(n):
                    if not is_gray_queue(q, n, g.gray_queues):
                        continue
                    mx = conns.request(addr, C.GET_MAX_OFFSET, {"topic": topic, "queueId": str(q)})
                    co = conns.request(addr, C.QUERY_CONSUMER_OFFSET, {
                        "consumerGroup": g.group, "topic": topic, "queueId": str(q), "setZeroIfNotFound": "false"})
                    top = int((mx.ext_fields or {}).get("offset", 0)) if mx.code == C.SUCCESS else None
                    done = int((co.ext_fields or {}).get("offset", 0)) if co.code == C.SUCCESS else 0
                    rows.append({"topic": topic, "broker": broker, "queue": q, "max": top, "committed": done,
                                 "backlog": None if top is None else max(0, top - done)})
    except (BacklogError, ValueError) as exc:
        return {"error": str(exc), "queues": rows}
    finally:
        conns.close()
    return {"queues": rows, "total": sum(r["backlog"] or 0 for r in rows)}

"""A small gevent Remoting client: one TCP connection, requests multiplexed by opaque.

Used to talk to *remote* clusters (name servers and brokers of another cloud): the
online-consumer detector and the deliver processes.  Frames are built and read with
:mod:`rmqfast.codec.command` (JSON headers, as the Java client sends by default).
"""

from __future__ import annotations

import itertools
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import gevent
from gevent import socket
from gevent.event import AsyncResult
from gevent.lock import Semaphore

from rmqfast.codec.aclsign import sign
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.codec.route import parse_route

log = logging.getLogger("rmqfast.clouds")

_I32 = struct.Struct(">i")
#: Request version we announce: 4.9.4 (MQVersion ordinal 401), so name servers answer standard JSON.
CLIENT_VERSION = 401


class RemoteError(RuntimeError):
    """A remote cluster could not be reached or answered with an error; the message says which and why."""


def open_socket(addr: str, connect_timeout: float, wrap: Callable[[Any, str], Any] | None = None) -> Any:
    """A blocking (gevent) TCP_NODELAY socket connected to ``addr`` ("host:port", IPv6 in brackets),
    wrapped by ``wrap(sock, host)`` (e.g. TLS) if given; RemoteError saying why if it cannot be."""
    host, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=connect_timeout)
        if wrap is not None:
            sock = wrap(sock, host.strip("[]"))
    except (OSError, ValueError) as exc:
        raise RemoteError(f"cannot connect to {addr}: {exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock


class Connection:
    """One connection to ``addr`` ("host:port"); :meth:`request` may be called from many greenlets."""

    _opaques = itertools.count(1)

    def __init__(self, addr: str, *, connect_timeout: float = 3.0, wrap: Callable[[Any, str], Any] | None = None
                 ) -> None:
        self.addr = addr
        self.sock = open_socket(addr, connect_timeout, wrap)  # wrap: e.g. TLS, before the reader starts
        self.closed = False
        self._pending: dict[int, AsyncResult] = {}
        self._send_lock = Semaphore()
        self._reader = gevent.spawn(self._read_loop)

    def _read_loop(self) -> None:
        buf = bytearray()
        error: Exception = RemoteError(f"connection to {self.addr} closed by the remote side")
        try:
            while True:
                chunk = self.sock.recv(262144)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 4:
                    (n,) = _I32.unpack_from(buf, 0)
                    if len(buf) < 4 + n:
                        break
                    frame = bytes(buf[: 4 + n])
                    del buf[: 4 + n]
                    cmd = decode_frame(frame)
                    if not cmd.is_response:
                        continue  # broker-to-client requests (heartbeat checks...) need no answer here
                    waiter = self._pending.pop(cmd.opaque, None)
                    if waiter is not None:
                        waiter.set(cmd)
        except Exception as exc:  # socket errors, undecodable frames
            error = RemoteError(f"connection to {self.addr} failed: {exc}")
        finally:
            self.closed = True
            for w in self._pending.values():
                w.set_exception(error)
            self._pending.clear()
            try:
                self.sock.close()
            except OSError:
                pass

    def request(
        self, code: int, ext_fields: dict[str, str] | None = None, body: bytes = b"", *, timeout: float = 3.0
    ) -> RemotingCommand:
        if self.closed:
            raise RemoteError(f"connection to {self.addr} is closed")
        opaque = next(self._opaques) & 0x7FFFFFFF
        cmd = RemotingCommand(
            code=code, version=CLIENT_VERSION, opaque=opaque, ext_fields=ext_fields, body=body
        )
        waiter: AsyncResult = AsyncResult()
        self._pending[opaque] = waiter
        try:
            with self._send_lock:
                self.sock.sendall(encode(cmd))
        except OSError as exc:
            self._pending.pop(opaque, None)
            self.close()
            raise RemoteError(f"cannot send request {code} to {self.addr}: {exc}") from exc
        try:
            return waiter.get(timeout=timeout)
        except gevent.Timeout:
            self._pending.pop(opaque, None)
            raise RemoteError(f"{self.addr} did not answer request {code} within {timeout:.1f} s") from None

    def request_many(self, requests: list[tuple[int, dict[str, str], bytes]], *,
                     timeout: float = 3.0) -> list[RemotingCommand | RemoteError]:
        """Several requests written with one ``sendall`` (pipelined); their answers, in the same
        order (a :class:`RemoteError` for one that failed or timed out)."""
        if self.closed:
            raise RemoteError(f"connection to {self.addr} is closed")
        waiters: list[tuple[int, AsyncResult]] = []
        frames = []
        for code, ext, body in requests:
            opaque = next(self._opaques) & 0x7FFFFFFF
            w: AsyncResult = AsyncResult()
            self._pending[opaque] = w
            waiters.append((opaque, w))
            frames.append(encode(RemotingCommand(code=code, version=CLIENT_VERSION, opaque=opaque, ext_fields=ext,
                                                 body=body)))
        try:
            with self._send_lock:
                self.sock.sendall(b"".join(frames))
        except OSError as exc:
            for opaque, _w in waiters:
                self._pending.pop(opaque, None)
            self.close()
            raise RemoteError(f"cannot send {len(frames)} requests to {self.addr}: {exc}") from exc
        out: list[RemotingCommand | RemoteError] = []
        deadline = time.monotonic() + timeout
        for opaque, w in waiters:
            try:
                out.append(w.get(timeout=max(0.0, deadline - time.monotonic())))
            except gevent.Timeout:
                self._pending.pop(opaque, None)
                out.append(RemoteError(f"{self.addr} did not answer within {timeout:.1f} s"))
            except RemoteError as exc:
                out.append(exc)
        return out

    def request_command(self, cmd: RemotingCommand, *, timeout: float = 3.0) -> RemotingCommand:
        """Send ``cmd`` as given (header fields, version, serialize type) under an opaque of this
        connection; the answer comes back with that opaque (the caller restores its own)."""
        if self.closed:
            raise RemoteError(f"connection to {self.addr} is closed")
        opaque = next(self._opaques) & 0x7FFFFFFF
        waiter: AsyncResult = AsyncResult()
        self._pending[opaque] = waiter
        try:
            with self._send_lock:
                self.sock.sendall(encode(replace(cmd, opaque=opaque)))
        except OSError as exc:
            self._pending.pop(opaque, None)
            self.close()
            raise RemoteError(f"cannot send request {cmd.code} to {self.addr}: {exc}") from exc
        try:
            return waiter.get(timeout=timeout)
        except gevent.Timeout:
            self._pending.pop(opaque, None)
            raise RemoteError(f"{self.addr} did not answer request {cmd.code} within {timeout:.1f} s") from None

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class ConnectionPool:
    """Connections by address, reopened when they broke.

    ``credentials`` ``(access_key, secret_key)``: every request is signed as ``AclClientRPCHook``
    signs it (:mod:`rmqfast.codec.aclsign`), for clusters whose brokers have ACL on.
    """

    def __init__(self, connect_timeout: float = 3.0, credentials: tuple[str, str] | None = None,
                 wrap: Callable[[Any, str], Any] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.credentials = credentials
        self.wrap = wrap  # applied to every new connection's socket (Connection's ``wrap``)
        self._conns: dict[str, Connection] = {}

    def get(self, addr: str) -> Connection:
        c = self._conns.get(addr)
        if c is None or c.closed:
            c = Connection(addr, connect_timeout=self.connect_timeout, wrap=self.wrap)
            self._conns[addr] = c
        return c

    def request(self, addr: str, code: int, ext: dict[str, str] | None = None, body: bytes = b"",
                *, timeout: float = 3.0) -> RemotingCommand:
        if self.credentials is not None:
            ext = sign(ext or {}, body, *self.credentials)
        return self.get(addr).request(code, ext, body, timeout=timeout)

    def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()


def route_of(obj: dict[Any, Any]) -> tuple[dict[str, str], list[tuple[str, int, int]]]:
    """(master address by broker name, [(broker name, write queues, perm)]) of a parsed route."""
    masters: dict[str, str] = {}
    for bd in obj.get("brokerDatas") or []:
        addrs = bd.get("brokerAddrs") or {}
        master = addrs.get(0) or addrs.get("0")
        if master:
            masters[str(bd.get("brokerName"))] = str(master)
    queues = [
        (str(q.get("brokerName")), int(q.get("writeQueueNums", 0)), int(q.get("perm", 6)))
        for q in obj.get("queueDatas") or []
    ]
    return masters, queues


def fetch_route(pool: ConnectionPool, namesrvs: list[str], topic: str, *, timeout: float = 3.0
                ) -> tuple[dict[str, str], list[tuple[str, int, int]]] | None:
    """GET_ROUTEINFO_BY_TOPIC (105) at the first name server that answers; None if the topic is unknown."""
    errors = []
    for ns in namesrvs:
        try:
            resp = pool.request(ns, 105, {"topic": topic}, timeout=timeout)
        except RemoteError as exc:
            errors.append(str(exc))
            continue
        if resp.code == 17:  # TOPIC_NOT_EXIST
            return None
        if resp.code != 0:
            errors.append(f"{ns} answered GET_ROUTEINFO_BY_TOPIC {topic} with code {resp.code}: {resp.remark}")
            continue
        obj, _ = parse_route(resp.body)
        return route_of(obj)
    raise RemoteError("; ".join(errors) or "no name server configured")

"""Asyncio Remoting connections from the gRPC front to name servers and brokers.

Frames are built and read with :mod:`rmqfast.codec.command` (JSON headers), one connection per
address, requests multiplexed by opaque; a connection that fails is dropped and the next request
opens a new one.  ``[tls.upstream]`` applies as it does to the relay (:class:`UpstreamTls`): a
name server or broker whose role it covers is reached over TLS only, with the same context (CA,
verification, client certificate) and the same name checked (``server_name``, else the host).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
import struct
from collections.abc import Callable, Iterable
from typing import Any

from rmqfast.codec.codes import FLAG_ONEWAY
from rmqfast.codec.command import RemotingCommand, decode_frame, encode

log = logging.getLogger("rmqfast.grpc")

_I32 = struct.Struct(">i")
#: MQVersion ordinal of 5.3.3 (name servers answer standard JSON; brokers see a 5.x client).
CLIENT_VERSION = 500
MAX_FRAME = 64 * 1024 * 1024


class UpstreamError(RuntimeError):
    """A name server or broker could not be reached or did not answer in time."""


#: Called with the connection and a request the remote side sent on it (a broker's
#: CHECK_TRANSACTION_STATE); it must not block.
OnRequest = Callable[["Connection", RemotingCommand], None]


class UpstreamTls:
    """``[tls.upstream]`` for the front's connections: the addresses in ``namesrvs`` have the role
    "namesrv", every other (the brokers of the routes) "broker"; the context is built once, by
    :func:`rmqfast.proxy.tls.client_context` (ConfigError naming the key when a file is bad)."""

    def __init__(self, sec: Any, namesrvs: Iterable[str]) -> None:
        from rmqfast.proxy.tls import client_context

        self.sec = sec  # a TlsUpstreamSection
        self.namesrvs = frozenset(namesrvs)
        self.context: ssl.SSLContext | None = client_context(sec) if sec.enable else None

    def for_addr(self, addr: str, host: str) -> tuple[ssl.SSLContext, str] | None:
        """``(context, name checked and sent as SNI)`` when ``addr`` is reached over TLS, else None."""
        role = "namesrv" if addr in self.namesrvs else "broker"
        if self.context is None or not self.sec.enabled_for(role):
            return None
        return self.context, self.sec.server_name or host


async def _connect(addr: str, timeout: float, tls: UpstreamTls | None
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    try:
        port_no = int(port)
    except ValueError as exc:
        raise UpstreamError(f"cannot connect to {addr}: {exc}") from exc
    over = tls.for_addr(addr, host) if tls is not None else None
    try:
        if over is None:
            return await asyncio.wait_for(asyncio.open_connection(host, port_no), timeout)
        context, name = over
        return await asyncio.wait_for(asyncio.open_connection(host, port_no, ssl=context, server_hostname=name,
                                                              ssl_handshake_timeout=timeout), timeout)
    except ssl.SSLError as exc:  # before OSError: its subclass
        raise UpstreamError(f"TLS handshake with {addr} failed (name checked: {over[1] if over else host}): "
                            f"{getattr(exc, 'verify_message', None) or exc.reason or exc}") from exc
    except TimeoutError as exc:
        what = "TLS handshake with" if over is not None else "cannot connect to"
        raise UpstreamError(f"{what} {addr}: no answer within {timeout:.1f} s") from exc
    except (OSError, ValueError) as exc:
        what = "TLS connection to" if over is not None else "cannot connect to"
        raise UpstreamError(f"{what} {addr}: {exc}") from exc


class Connection:
    """One Remoting connection to ``addr`` ("host:port")."""

    _opaques = itertools.count(1)

    def __init__(self, addr: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_request: OnRequest | None = None) -> None:
        self.addr = addr
        self._on_request = on_request
        self._reader = reader
        self._writer = writer
        self._pending: dict[int, asyncio.Future[RemotingCommand]] = {}
        self._out: list[bytes] | None = None  # frames written in this turn of the loop, sent at its end
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._read_loop())

    @classmethod
    async def open(cls, addr: str, timeout: float, on_request: OnRequest | None = None,
                   tls: UpstreamTls | None = None) -> Connection:
        """Connect (over TLS when ``tls`` covers ``addr``); UpstreamError within ``timeout`` on failure."""
        reader, writer = await _connect(addr, timeout, tls)
        return cls(addr, reader, writer, on_request)

    async def _read_loop(self) -> None:
        error = UpstreamError(f"connection to {self.addr} closed by the remote side")
        try:
            while True:
                head = await self._reader.readexactly(4)
                (n,) = _I32.unpack(head)
                if n <= 0 or n > MAX_FRAME:
                    raise UpstreamError(f"{self.addr}: frame length {n}")
                frame = head + await self._reader.readexactly(n)
                cmd = decode_frame(frame)
                if not cmd.is_response:
                    if self._on_request is not None:
                        try:
                            self._on_request(self, cmd)
                        except Exception:
                            log.exception("request %d from %s not handled", cmd.code, self.addr)
                    continue
                fut = self._pending.pop(cmd.opaque, None)
                if fut is not None and not fut.done():
                    fut.set_result(cmd)
        except (asyncio.IncompleteReadError, OSError) as exc:
            error = UpstreamError(f"connection to {self.addr} lost: {exc}")
        except Exception as exc:  # an undecodable frame
            error = UpstreamError(f"connection to {self.addr} failed: {exc}")
        finally:
            self._fail(error)

    def _send(self, frame: bytes) -> None:
        """Queue a whole frame; the frames queued in one turn of the event loop go out in one write
        (one system call for the requests of many concurrent gRPC calls), in order."""
        if self._out is None:
            self._out = [frame]
            self._loop.call_soon(self._flush)
        else:
            self._out.append(frame)

    def _flush(self) -> None:
        out, self._out = self._out, None
        if out and not self.closed:
            self._writer.write(out[0] if len(out) == 1 else b"".join(out))

    def _fail(self, error: Exception) -> None:
        self.closed = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        self._writer.close()

    async def request(self, code: int, ext: dict[str, str], body: bytes = b"", *, timeout: float) -> RemotingCommand:
        if self.closed:
            raise UpstreamError(f"connection to {self.addr} is closed")
        opaque = next(self._opaques) & 0x7FFFFFFF
        fut: asyncio.Future[RemotingCommand] = asyncio.get_running_loop().create_future()
        self._pending[opaque] = fut
        self._send(encode(RemotingCommand(code=code, version=CLIENT_VERSION, opaque=opaque, ext_fields=ext,
                                          body=body)))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise UpstreamError(f"{self.addr} did not answer request {code} within {timeout:.1f} s") from None
        finally:
            self._pending.pop(opaque, None)

    def oneway(self, code: int, ext: dict[str, str], body: bytes = b"") -> None:
        """Write a one-way request (``RPC_ONEWAY``: the remote side sends no answer)."""
        if self.closed:
            raise UpstreamError(f"connection to {self.addr} is closed")
        opaque = next(self._opaques) & 0x7FFFFFFF
        self._send(encode(RemotingCommand(code=code, version=CLIENT_VERSION, opaque=opaque,
                                          flag=FLAG_ONEWAY, ext_fields=ext, body=body)))

    def abort(self) -> None:
        """Close now (the read loop ends; requests still waiting fail)."""
        self._task.cancel()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


class Pool:
    """One :class:`Connection` per address, opened on first use and replaced after a failure."""

    def __init__(self, connect_timeout: float = 3.0, on_request: OnRequest | None = None,
                 tls: UpstreamTls | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.on_request = on_request
        self.tls = tls
        self._conns: dict[str, Connection] = {}
        self._opening: dict[str, asyncio.Future[Connection]] = {}

    async def get(self, addr: str) -> Connection:
        conn = self._conns.get(addr)
        if conn is not None and not conn.closed:
            return conn
        opening = self._opening.get(addr)
        if opening is not None:
            return await asyncio.shield(opening)
        fut: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._opening[addr] = fut
        try:
            conn = await Connection.open(addr, self.connect_timeout, self.on_request, self.tls)
            self._conns[addr] = conn
            fut.set_result(conn)
            return conn
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self._opening.pop(addr, None)

    async def request(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"", *,
                      timeout: float = 3.0) -> RemotingCommand:
        conn = await self.get(addr)
        return await conn.request(code, ext, body, timeout=timeout)

    async def oneway(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"") -> None:
        (await self.get(addr)).oneway(code, ext, body)

    async def close(self) -> None:
        for conn in list(self._conns.values()):
            await conn.close()
        self._conns.clear()


class Lanes:
    """Connections that carry one long-polling request at a time (the receives' NOTIFICATIONs).

    A broker parks a notification until a message arrives and then wakes only one of the parked
    notifications of the group and topic: the one that expires last (``PopLongPollingService``,
    ``notifyLast``), skipping those whose connection is closed.  A notification still parked when
    its receive has ended would take that wake-up from a live receive of the group (of this or
    another proxy process) whose notification expires earlier, and the live receive would wait
    for the next message or end empty.  So a request cancelled or failed before its answer closes
    its connection (the broker then skips it), and a connection comes back for reuse only after
    its request was answered.  With ``max_busy`` requests in flight to one address, further ones
    go over ``shared`` (one multiplexed connection) instead: descriptors stay bounded, and only those
    requests keep the old behaviour.
    """

    def __init__(self, connect_timeout: float = 3.0, max_idle: int = 64, max_busy: int = 1024,
                 shared: Pool | None = None, tls: UpstreamTls | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.tls = tls
        self.max_idle = max_idle
        self.max_busy = max_busy
        self.shared = shared
        self._idle: dict[str, list[Connection]] = {}
        self._busy: dict[str, int] = {}
        self.opened = self.dropped = 0  # connections opened, closed with a request outstanding

    async def request(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"", *,
                      timeout: float = 3.0) -> RemotingCommand:
        if self.shared is not None and self._busy.get(addr, 0) >= self.max_busy:
            return await self.shared.request(addr, code, ext, body, timeout=timeout)
        self._busy[addr] = self._busy.get(addr, 0) + 1
        try:
            return await self._request(addr, code, ext, body, timeout)
        finally:
            self._busy[addr] -= 1

    async def _request(self, addr: str, code: int, ext: dict[str, str], body: bytes,
                       timeout: float) -> RemotingCommand:
        idle = self._idle.get(addr) or []
        conn = None
        while idle and conn is None:
            c = idle.pop()
            conn = None if c.closed else c
        if conn is None:
            conn = await Connection.open(addr, self.connect_timeout, tls=self.tls)
            self.opened += 1
        answered = False
        try:
            resp = await conn.request(code, ext, body, timeout=timeout)
            answered = True
            return resp
        finally:
            if answered and not conn.closed and len(self._idle.setdefault(addr, [])) < self.max_idle:
                self._idle[addr].append(conn)
            else:
                if not answered:
                    self.dropped += 1
                conn.abort()

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                await conn.close()
        self._idle.clear()

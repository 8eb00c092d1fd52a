"""The listener prober of ``rmqfast bench --hostile``: does each listener answer a newcomer?

``python -m rmqfast.bench.hostile_probe '<plan as JSON>'`` opens, every ``period`` s and for
every listener, a fresh connection from that listener's own source address (127.0.0.x, used by
nobody else) and asks one thing:

* ``remoting``: a HEART_BEAT to the broker endpoint, GET_ROUTEINFO_BY_TOPIC to the name-server
  listener (where a HEART_BEAT is denied, and logged); answered = one whole frame back;
* ``h2`` (gRPC front): the client preface and an empty SETTINGS; answered = a SETTINGS frame back;
* ``http`` (admin ``/healthz``, ``/readyz``): a GET; answered = a status line; the status and the
  first bytes of the body are kept (the truth of health is judged from them by the bench).

A probe not answered within ``timeout`` s is closed and counted as unanswered.  It runs for
``duration`` s (or until SIGTERM) and prints one JSON object: per probe ``[start, answered at or
null, status]`` (CLOCK_MONOTONIC seconds, comparable with the bench's own clock), and how late
its own timer ran (a starved prober would make listeners look silent).
"""

from __future__ import annotations

import errno
import json
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rmqfast.bench.hostile_attack import IP_BIND_ADDRESS_NO_PORT
from rmqfast.codec.command import RemotingCommand, encode

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
H2_SETTINGS = 4


@dataclass
class Target:
    """One thing probed: ``proto`` is remoting, h2 or http (``path`` for http)."""

    name: str
    port: int
    proto: str
    source: str
    path: str = ""
    code: int = 34  # remoting: the request code (HEART_BEAT; the name server's probe asks a route, 105)


@dataclass
class ProbePlan:
    targets: list[dict[str, Any]]
    duration: float
    period: float = 0.05
    timeout: float = 2.0
    host: str = "127.0.0.1"
    periods: dict[str, float] = field(default_factory=dict)  # per target name, instead of ``period``


class _Probe:
    __slots__ = ("buf", "rec", "sock", "started", "target", "wrote")

    def __init__(self, target: Target, sock: socket.socket, rec: list[Any], started: float) -> None:
        self.target = target
        self.sock = sock
        self.rec = rec  # [start, answered_at | None, status]
        self.buf = b""
        self.started = started
        self.wrote = False


def _request(t: Target, host: str) -> bytes:
    if t.proto == "remoting":
        if t.code == 105:  # GET_ROUTEINFO_BY_TOPIC: what every client asks a name server
            return encode(RemotingCommand(code=105, version=435, opaque=7, ext_fields={"topic": "HostileProbe"}))
        return encode(RemotingCommand(code=t.code, version=435, opaque=7, body=b"{}"))
    if t.proto == "h2":
        return H2_PREFACE + H2_EMPTY_SETTINGS
    return f"GET {t.path} HTTP/1.0\r\nHost: {host}:{t.port}\r\n\r\n".encode()


def _verdict(t: Target, buf: bytes, eof: bool) -> tuple[bool, Any] | None:
    """(answered, status) once it is known, None while more bytes may come."""
    if t.proto == "remoting":
        if len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
            return True, "frame"
        return (False, "closed") if eof else None
    if t.proto == "h2":
        if len(buf) >= 9:
            return (True, "settings") if buf[3] == H2_SETTINGS else (False, f"frame type {buf[3]}")
        return (False, "closed") if eof else None
    if not eof and len(buf) < 65536:
        return None  # HTTP/1.0: the answer ends with the connection
    head, _, body = buf.partition(b"\r\n\r\n")
    line = head.split(b"\r\n", 1)[0].split()
    if len(line) < 2 or not line[0].startswith(b"HTTP/"):
        return False, "no status line"
    return True, [int(line[1]) if line[1].isdigit() else line[1].decode(errors="replace"),
                  body[:400].decode(errors="replace")]


class Prober:
    def __init__(self, plan: ProbePlan) -> None:
        self.p = plan
        self.targets = [Target(**t) for t in plan.targets]
        self.ep = select.epoll()
        self.live: dict[int, _Probe] = {}
        self.records: dict[str, list[list[Any]]] = {t.name: [] for t in self.targets}
        self.requests = {t.name: _request(t, plan.host) for t in self.targets}
        self.max_late = 0.0
        self.stopping = False

    def _start(self, t: Target, now: float) -> None:
        rec: list[Any] = [round(now, 4), None, None]
        self.records[t.name].append(rec)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            sock.bind((t.source, 0))
            err = sock.connect_ex((self.p.host, t.port))
        except OSError as exc:
            sock.close()
            rec[2] = f"connect: {exc.strerror or exc}"
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            rec[2] = f"connect: {errno.errorcode.get(err, err)}"
            return
        self.live[sock.fileno()] = _Probe(t, sock, rec, now)
        self.ep.register(sock.fileno(), select.EPOLLOUT)

    def _end(self, pr: _Probe, answered: bool, status: Any, now: float) -> None:
        if answered:
            pr.rec[1] = round(now, 4)
        pr.rec[2] = status
        self.live.pop(pr.sock.fileno(), None)
        try:
            self.ep.unregister(pr.sock.fileno())
        except OSError:
            pass
        pr.sock.close()

    def _event(self, pr: _Probe, ev: int, now: float) -> None:
        if not pr.wrote:
            if ev & (select.EPOLLERR | select.EPOLLHUP):
                code = pr.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                self._end(pr, False, f"connect: {errno.errorcode.get(code, code) if code else 'closed'}", now)
                return
            try:
                pr.sock.send(self.requests[pr.target.name])
            except OSError as exc:
                self._end(pr, False, f"send: {exc.strerror or exc}", now)
                return
            pr.wrote = True
            self.ep.modify(pr.sock.fileno(), select.EPOLLIN)
            return
        eof = False
        try:
            while True:
                data = pr.sock.recv(65536)
                if not data:
                    eof = True
                    break
                pr.buf += data
        except BlockingIOError:
            pass
        except OSError:
            eof = True
        v = _verdict(pr.target, pr.buf, eof)
        if v is not None:
            self._end(pr, v[0], v[1], now)
        elif eof:
            self._end(pr, False, "closed", now)

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        end = t0 + self.p.duration
        due = {t.name: t0 for t in self.targets}
        while not self.stopping:
            now = time.monotonic()
            if now >= end:
                break
            for t in self.targets:
                if due[t.name] <= now:
                    self.max_late = max(self.max_late, now - due[t.name])
                    period = self.p.periods.get(t.name, self.p.period)
                    # a late timer starts one probe, not a burst to catch up
                    due[t.name] = max(due[t.name] + period, now)
                    self._start(t, now)
            for pr in [pr for pr in self.live.values() if now - pr.started > self.p.timeout]:
                self._end(pr, False, "timeout", now)
            wait = min(min(due.values()), end) - time.monotonic()
            for fd, ev in self.ep.poll(max(0.0, wait), 256):
                pr = self.live.get(fd)
                if pr is not None:
                    self._event(pr, ev, time.monotonic())
        now = time.monotonic()
        for pr in list(self.live.values()):
            self._end(pr, False, "timeout" if now - pr.started > self.p.timeout else "unfinished", now)
        self.ep.close()
        return {"probes": self.records, "max_timer_late_s": round(self.max_late, 4), "t0": t0, "t1": now}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m rmqfast.bench.hostile_probe '<plan as JSON>'", file=sys.stderr)
        return 2
    pr = Prober(ProbePlan(**json.loads(argv[0])))

    def stop(*_: object) -> None:
        pr.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(json.dumps(pr.run()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

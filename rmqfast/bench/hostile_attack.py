"""One attacker of ``rmqfast bench --hostile``: a process holding hostile connections to a proxy.

``python -m rmqfast.bench.hostile_attack '<plan as JSON>'`` runs one :class:`Plan` until its
``duration`` ends or it gets SIGTERM, then closes every socket and exits.  Kinds:

* ``idle``: connections that send one HEART_BEAT (its answer counts them as set up), then stay
  idle (one more HEART_BEAT every ``interval`` s when > 0), as a fleet of quiet clients does;
* ``exhaust``: connections opened as fast as the proxy takes them and holding, sending nothing
  (a descriptor-exhaustion attempt, normally from one source address);
* ``slowloris``: a Remoting frame whose length and header length are sent, then one byte of
  header every ``interval`` s, never completed;
* ``http-slowloris``: an HTTP request line and one header, then one byte every ``interval`` s;
* ``half-preface``: the first 10 bytes of the HTTP/2 client preface, then nothing;
* ``admin-flood``: whole HTTP requests (``/healthz``, ``/metrics``, ``/limits``, ``/readyz`` in
  turn), each on a new connection, as fast as they are answered (at most ``rate`` per second
  when > 0).

A connection the proxy closes is opened again after ``retry`` s (clients retry).  Sources rotate
over ``sources`` (127.0.0.x), bound with IP_BIND_ADDRESS_NO_PORT so each source address has the
whole ephemeral range for each destination.  Once a second a JSON status line goes to stdout;
the last one has ``"final": true`` and how long the connections the proxy closed had lived.
"""

from __future__ import annotations

import errno
import heapq
import json
import select
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rmqfast.bench.idleconns import raise_nofile
from rmqfast.codec.command import RemotingCommand, encode

KINDS = ("idle", "exhaust", "slowloris", "http-slowloris", "half-preface", "admin-flood")
IP_BIND_ADDRESS_NO_PORT = 24  # linux/in.h: pick the source port at connect(), per destination
HEART_BEAT = 34
ADMIN_PATHS = ("/healthz", "/metrics", "/limits", "/readyz")
# A frame that says it is 4 KiB with a 4,000-byte JSON header; its header then comes one byte at a time.
SLOW_FRAME_HEAD = (4096).to_bytes(4, "big") + (4000).to_bytes(4, "big") + b'{"code":'
H2_HALF_PREFACE = b"PRI * HTTP"  # 10 of the preface's 24 bytes
_CONNECTING, _SENT, _HELD, _WAIT = range(4)


@dataclass
class Plan:
    """What one attacker process does (see the module doc)."""

    kind: str
    ports: list[int]
    conns: int
    sources: list[str]
    duration: float
    concurrency: int = 256  # connections being connected at once
    retry: float = 1.0  # s before a connection the proxy closed is opened again
    interval: float = 0.0  # idle: s between HEART_BEATs (0: only the first); slowloris kinds: s per byte
    rate: float = 0.0  # admin-flood: requests per second at most (0: as fast as answered)
    host: str = "127.0.0.1"  # where the proxy listens
    label: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class _Slot:
    __slots__ = ("buf", "born", "gen", "i", "sock", "state")

    def __init__(self, i: int) -> None:
        self.i = i
        self.sock: socket.socket | None = None
        self.state = _WAIT
        self.buf = b""
        self.born = 0.0
        self.gen = 0


class Attacker:
    """The event loop of one :class:`Plan`."""

    def __init__(self, plan: Plan) -> None:
        if plan.kind not in KINDS:
            raise ValueError(f"attacker kind {plan.kind!r} is not one of {', '.join(KINDS)}")
        if not plan.ports or not plan.sources:
            raise ValueError("an attacker needs at least one port and one source address")
        self.p = plan
        self.ep = select.epoll()
        self.slots = [_Slot(i) for i in range(plan.conns)]
        self.by_fd: dict[int, _Slot] = {}
        self.timers: list[tuple[float, int, int]] = []  # (due, slot, generation)
        self.connecting = 0
        self.open = 0
        self.c: dict[str, int] = {"opened": 0, "peer_closed": 0, "connect_failed": 0, "answers": 0,
                                  "bytes_trickled": 0, "requests": 0}
        self.codes: dict[str, int] = {}
        self.lifetimes: list[float] = []  # s a connection lived until the proxy closed it
        self.first_errors: list[str] = []
        self.stopping = False
        self.hb = encode(RemotingCommand(code=HEART_BEAT, version=435, opaque=1, body=b"{}"))
        self.req_n = 0
        self.flood_next = 0.0

    # connections ----------------------------------------------------------------------------

    def _connect(self, s: _Slot, now: float) -> None:
        p = self.p
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            sock.bind((p.sources[s.i % len(p.sources)], 0))
            err = sock.connect_ex((p.host, p.ports[s.i % len(p.ports)]))
        except OSError as exc:
            sock.close()
            self._failed(s, now, f"connect: {exc}")
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._failed(s, now, f"connect: {errno.errorcode.get(err, err)}")
            return
        s.sock, s.state, s.buf, s.born = sock, _CONNECTING, b"", now
        self.by_fd[sock.fileno()] = s
        self.ep.register(sock.fileno(), select.EPOLLOUT)
        self.connecting += 1

    def _failed(self, s: _Slot, now: float, why: str) -> None:
        self.c["connect_failed"] += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(why)
        self._later(s, now + self.p.retry)

    def _later(self, s: _Slot, due: float) -> None:
        s.state = _WAIT
        s.gen += 1
        heapq.heappush(self.timers, (due, s.i, s.gen))

    def _drop(self, s: _Slot) -> None:
        if s.sock is None:
            return
        if s.state == _CONNECTING:
            self.connecting -= 1
        elif s.state in (_SENT, _HELD):
            self.open -= 1
        self.by_fd.pop(s.sock.fileno(), None)
        try:
            self.ep.unregister(s.sock.fileno())
        except OSError:
            pass
        s.sock.close()
        s.sock = None

    def _peer_closed(self, s: _Slot, now: float) -> None:
        """The proxy closed (or reset) a connection: counted, and opened again after ``retry``."""
        was_open = s.state in (_SENT, _HELD)
        self._drop(s)
        if was_open:
            self.c["peer_closed"] += 1
            self.lifetimes.append(now - s.born)
        else:
            self.c["connect_failed"] += 1
        self._later(s, now + self.p.retry)

    def _send(self, s: _Slot, data: bytes, now: float) -> bool:
        assert s.sock is not None
        try:
            s.sock.send(data)
            return True
        except BlockingIOError:
            return True  # a full buffer: the byte is simply not sent; the attack goes on
        except OSError:
            self._peer_closed(s, now)
            return False

    # what each kind sends -----------------------------------------------------------------------

    def _first(self, s: _Slot, now: float) -> None:
        k = self.p.kind
        assert s.sock is not None
        self.connecting -= 1
        self.open += 1
        self.c["opened"] += 1
        s.state, s.born = _SENT, now
        self.ep.modify(s.sock.fileno(), select.EPOLLIN)
        if k == "idle":
            self._send(s, self.hb, now)
        elif k == "slowloris":
            if self._send(s, SLOW_FRAME_HEAD, now):
                self._later_held(s, now)
        elif k == "http-slowloris":
            if self._send(s, b"GET /healthz HTTP/1.1\r\nHost: " + self._host_port(s).encode() + b"\r\n", now):
                self._later_held(s, now)
        elif k == "half-preface":
            self._send(s, H2_HALF_PREFACE, now)
        elif k == "admin-flood":
            path = ADMIN_PATHS[self.req_n % len(ADMIN_PATHS)]
            self.req_n += 1
            self.c["requests"] += 1
            self._send(s, f"GET {path} HTTP/1.1\r\nHost: {self._host_port(s)}\r\nConnection: close\r\n\r\n".encode(),
                       now)
        # exhaust: nothing

    def _host_port(self, s: _Slot) -> str:
        return f"{self.p.host}:{self.p.ports[s.i % len(self.p.ports)]}"

    def _later_held(self, s: _Slot, now: float) -> None:
        """Slowloris kinds: the next byte is due in ``interval`` s (the slot stays open)."""
        s.gen += 1
        heapq.heappush(self.timers, (now + max(self.p.interval, 0.05), s.i, s.gen))

    def _readable(self, s: _Slot, now: float) -> None:
        assert s.sock is not None
        try:
            data = s.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if self.p.kind == "admin-flood":
                self._flood_done(s, now)
            else:
                self._peer_closed(s, now)
            return
        if self.p.kind == "admin-flood":
            if len(s.buf) < 256:  # the status line is all that is counted
                s.buf += data
            return
        s.buf += data
        if self.p.kind == "idle":
            n = int.from_bytes(s.buf[:4], "big") if len(s.buf) >= 4 else -1
            if n >= 0 and len(s.buf) >= 4 + n:
                s.buf = s.buf[4 + n:]
                self.c["answers"] += 1
                if s.state == _SENT:
                    s.state = _HELD
                    if self.p.interval > 0:
                        self._later_held(s, now)
        else:
            s.buf = s.buf[-256:]  # what a refusal said is kept for the count, not the bytes

    def _flood_done(self, s: _Slot, now: float) -> None:
        line = s.buf.split(b"\r\n", 1)[0].split()
        code = line[1].decode(errors="replace") if len(line) > 1 and line[0].startswith(b"HTTP/") else "none"
        self.codes[code] = self.codes.get(code, 0) + 1
        self._drop(s)
        due = now
        if self.p.rate > 0:
            self.flood_next = max(self.flood_next + 1.0 / self.p.rate, now)
            due = self.flood_next
        self._later(s, due)

    def _timer(self, s: _Slot, now: float) -> None:
        k = self.p.kind
        if s.state == _WAIT:
            self._connect(s, now)
            return
        if s.sock is None:
            return
        if k in ("slowloris", "http-slowloris"):
            if self._send(s, b" " if k == "slowloris" else b"X", now):
                self.c["bytes_trickled"] += 1
                self._later_held(s, now)
        elif k == "idle" and s.state == _HELD:
            if self._send(s, self.hb, now):
                s.state = _SENT
                self._later_held(s, now)

    # the loop ---------------------------------------------------------------------------------

    def status(self, final: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.p.label or self.p.kind, "kind": self.p.kind, "t": time.monotonic(),
                               "open": self.open, "connecting": self.connecting, **self.c}
        if self.codes:
            out["codes"] = dict(self.codes)
        if final:
            lt = sorted(self.lifetimes)
            out |= {"final": True, "errors": self.first_errors,
                    "closed_after_s": {"n": len(lt), "p50": round(lt[len(lt) // 2], 3) if lt else None,
                                       "max": round(lt[-1], 3) if lt else None}}
        return out

    def run(self) -> dict[str, Any]:
        now = time.monotonic()
        end = now + self.p.duration
        for s in self.slots:
            heapq.heappush(self.timers, (now, s.i, s.gen))
        next_status = now + 1.0
        while not self.stopping:
            now = time.monotonic()
            if now >= end:
                break
            blocked = False  # connects wait for one in progress to finish: the poll below wakes on it
            while self.timers and self.timers[0][0] <= now:
                due, i, gen = heapq.heappop(self.timers)
                s = self.slots[i]
                if gen != s.gen:
                    continue
                if s.state == _WAIT and self.connecting >= self.p.concurrency:
                    heapq.heappush(self.timers, (due, i, gen))  # connects wait for a free place, in order
                    blocked = True
                    break
                self._timer(s, now)
            due = end if blocked or not self.timers else self.timers[0][0]
            wait = min(next_status, end, due) - time.monotonic()
            for fd, ev in self.ep.poll(max(0.0, min(wait, 0.5)), 1024):
                s2 = self.by_fd.get(fd)
                if s2 is None:
                    continue
                t = time.monotonic()
                if s2.state == _CONNECTING:
                    if ev & (select.EPOLLERR | select.EPOLLHUP):
                        self._drop(s2)
                        self._failed(s2, t, "connect: refused or reset")
                    else:
                        self._first(s2, t)
                elif ev & (select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP):
                    self._readable(s2, t)
            if time.monotonic() >= next_status:
                next_status += 1.0
                print(json.dumps(self.status()), flush=True)
        final = self.status(final=True)
        for s in self.slots:
            self._drop(s)
        self.ep.close()
        return final


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m rmqfast.bench.hostile_attack '<plan as JSON>'", file=sys.stderr)
        return 2
    plan = Plan(**json.loads(argv[0]))
    raise_nofile(plan.conns + 256)
    a = Attacker(plan)

    def stop(*_: object) -> None:
        a.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(json.dumps(a.run()), flush=True)
    return 0


def plan_json(plan: Plan) -> str:
    """The argument :func:`main` takes."""
    return json.dumps(asdict(plan))


if __name__ == "__main__":
    sys.exit(main())

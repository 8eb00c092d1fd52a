"""Where the memory of an idle relayed connection goes (a measurement, not a test).

Runs relay sessions in THIS process (gevent, the compiled pump and reactor unless
``RMQFAST_NO_EXTENSIONS=1``) in front of the null broker; a child process opens ``--conns``
connections, sends one HEART_BEAT on each and waits for its answer, then keeps them open while
this process measures, per connection:

* RSS and anonymous memory (``/proc/self/smaps_rollup``), and how many mappings there are;
* Python heap by allocation site (tracemalloc, top lines), and live objects by type (gc);
* greenlets alive.

    .venv/bin/python bench/idle_memory.py [--conns 2000] [--top 15]

Prints a table per measurement and a JSON line with the totals.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tracemalloc
from collections import Counter
from typing import Any

from gevent import monkey

monkey.patch_all()

import gevent  # noqa: E402
import greenlet  # noqa: E402

from rmqfast import codec  # noqa: E402
from rmqfast.bench.cbuild import build_tools  # noqa: E402
from rmqfast.bench.nullbroker import NullBroker  # noqa: E402
from rmqfast.codec import codes as C  # noqa: E402
from rmqfast.codec.command import RemotingCommand, encode  # noqa: E402
from rmqfast.config import HostPort  # noqa: E402
from rmqfast.filters.api import FilterChain  # noqa: E402
from rmqfast.filters.deny import DenyAdminCodes  # noqa: E402
from rmqfast.proxy.relay import RelaySettings, Session  # noqa: E402
from rmqfast.server.worker import RelayServer  # noqa: E402

CLIENT = r"""
import socket, struct, sys
n, port, frame = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(frame)
    got = b""
    while len(got) < 4:
        chunk = s.recv(4 - len(got))
        if not chunk:
            sys.exit(f"connection {i} closed before its answer")
        got += chunk
    size = struct.unpack(">i", got)[0]
    while size:
        chunk = s.recv(size)
        if not chunk:
            sys.exit(f"connection {i} closed during its answer")
        size -= len(chunk)
    socks.append(s)
print("ready", flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
"""

HB = encode(RemotingCommand(code=C.HEART_BEAT, opaque=1, body=b"{}")).hex()


class Events:
    def upstream_error(self, role: str) -> None:
        pass

    def upstream_ok(self, session: Any, hp: HostPort) -> None:
        pass


def rollup() -> dict[str, int]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    with open("/proc/self/maps") as f:
        out["mappings"] = sum(1 for _ in f)
    return out


def types() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects())


def greenlets() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, greenlet.greenlet))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conns", type=int, default=2000)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--no-trace", action="store_true", help="RSS without tracemalloc's own overhead")
    args = ap.parse_args()
    n = args.conns
    sessions: list[Session] = []
    with NullBroker(build_tools(None)) as broker:
        chain = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
        settings = RelaySettings(262144, 16 << 20, 1 << 20, 3.0, 120.0)
        stats = codec.ScanStats()
        # shared by the sessions, as the worker shares its hooks object and a listener's upstream list
        events, upstreams = Events(), [HostPort("127.0.0.1", broker.port)]

        def ended() -> None:
            pass

        def handle(sock: Any, addr: tuple) -> None:
            s = Session("broker", sock, f"{addr[0]}:{addr[1]}", upstreams, chain, stats, settings, events)
            sessions.append(s)
            s.serve(ended)  # as the worker: returns once the pumps are parked in the reactor

        server = RelayServer(("127.0.0.1", 0), handle, backlog=1024)  # plain accepted sockets, as the worker's
        server.start()
        # one warm-up connection: lazily made per-process things (reactor, pools) are not counted
        warm = subprocess.Popen([sys.executable, "-c", CLIENT, "1", str(server.server_port), HB],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert warm.stdout is not None and warm.stdin is not None
        warm.stdout.readline()
        warm.stdin.write("\n")
        warm.stdin.flush()
        warm.wait()
        while any(not s.closed for s in sessions):
            gevent.sleep(0.05)
        gevent.sleep(0.2)
        sessions.clear()
        gc.collect()
        if not args.no_trace:
            tracemalloc.start(1)
        t0, g0, m0 = types(), greenlets(), rollup()
        snap0 = tracemalloc.take_snapshot() if not args.no_trace else None
        proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(n), str(server.server_port), HB],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line.startswith("ready"), line
        gevent.sleep(0.5)
        gc.collect()
        t1, g1, m1 = types(), greenlets(), rollup()
        snap1 = tracemalloc.take_snapshot() if snap0 is not None else None
        live = sum(1 for s in sessions if not s.closed)
        stats_diff = snap1.compare_to(snap0, "lineno") if snap1 is not None and snap0 is not None else []
        traced = sum(st.size_diff for st in stats_diff)
        print(f"{live} live sessions (of {n})")
        print(f"RSS {m1['Rss'] - m0['Rss']:+,} KiB = {(m1['Rss'] - m0['Rss']) * 1024 / n:,.0f} B/conn; "
              f"anonymous {(m1['Anonymous'] - m0['Anonymous']) * 1024 / n:,.0f} B/conn; "
              f"mappings {m1['mappings'] - m0['mappings']:+,}; greenlets {g1 - g0:+,}; "
              f"tracemalloc {traced / n:,.0f} B/conn")
        print(f"\ntop {args.top} allocation sites, bytes per connection:")
        for st in stats_diff[: args.top]:
            fr = st.traceback[0]
            print(f"  {st.size_diff / n:>8,.0f}  {st.count_diff / n:>6.2f} blocks  {fr.filename.split('/')[-1]}:"
                  f"{fr.lineno}")
        print("\nobjects per connection by type:")
        for name, cnt in sorted(((k, t1[k] - t0[k]) for k in t1), key=lambda kv: -kv[1])[: args.top]:
            if cnt > 0:
                print(f"  {cnt / n:>6.2f}  {name}")
        print(json.dumps({"conns": n, "live": live, "rss_b_per_conn": round((m1["Rss"] - m0["Rss"]) * 1024 / n),
                          "anon_b_per_conn": round((m1["Anonymous"] - m0["Anonymous"]) * 1024 / n),
                          "traced_b_per_conn": round(traced / n), "greenlets_per_conn": (g1 - g0) / n,
                          "mappings_per_conn": (m1["mappings"] - m0["mappings"]) / n}))
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait()
        server.stop(timeout=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What TLS costs rmqfast: plain vs TLS on both sides, in one run, as msgs/s and worker CPU per request.

The load generator and the null broker speak plain TCP, so one HAProxy process (``nbthread 1``)
stands at both edges: it originates TLS towards the proxy and terminates TLS in front of the
null broker.  Every path has the same hops; only the proxy in the middle and TLS differ::

    rmqfast       loadgen -> haproxy --------> rmqfast --------> haproxy -> nullbroker
    rmqfast-tls   loadgen -> haproxy ==TLS==> rmqfast ==TLS==> haproxy -> nullbroker
    haproxy       loadgen -> haproxy --------> haproxy --------> haproxy -> nullbroker
    haproxy-tls   loadgen -> haproxy ==TLS==> haproxy ==TLS==> haproxy -> nullbroker

(``haproxy``/``haproxy-tls``: HAProxy in rmqfast's place, a second process with ``nbthread 1``,
terminating and re-originating TLS.)  rmqfast runs 2 workers with the compiled scanner; TLS
sessions use the Python pump over OpenSSL (the compiled pump needs raw sockets).  The edges'
TLS work lands on the same 2 cores, so the msgs/s ratio is an upper bound on the slowdown;
"worker CPU µs/request" (rmqfast's processes only, from /proc) is the proxy's own cost.

    python bench/tls_cost.py                      # send-16x32, 3 rounds of 6 s
    python bench/tls_cost.py --scenario send-64x1 --rounds 5 --duration 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rmqfast.bench.cbuild import build_tools
from rmqfast.bench.haproxy import HAProxyTarget, ensure_haproxy, haproxy_version
from rmqfast.bench.loadgen import run_loadgen
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.processes import free_port, stop_process, wait_port
from rmqfast.bench.scenarios import SCENARIOS
from rmqfast.bench.targets import BenchProxy
from rmqfast.testing.tlscerts import make_certs


class TlsBenchProxy(BenchProxy):
    """rmqfast with one static broker endpoint, and ``[tls]`` when ``tls_toml`` is given."""

    def __init__(self, broker_port: int, tls_toml: str) -> None:
        super().__init__(broker_port, workers=2, pure=False)
        self.extra_config = tls_toml
        self._write_config()


def _haproxy_edges(exe: str, workdir: Path, pem: Path, ports: dict[str, int], nb_port: int) -> subprocess.Popen:
    """One HAProxy for both edges: plain->plain and plain->TLS towards the proxies, plain and TLS
    listeners in front of the null broker."""
    cfg = f"""global
    nbthread 1
    maxconn {HAProxyTarget.maxconn()}
    ssl-server-verify none

defaults
    mode tcp
    timeout connect 5s
    timeout client 5m
    timeout server 5m

listen to_rmqfast
    bind 127.0.0.1:{ports['edge_rmqfast']}
    server p 127.0.0.1:{ports['rmqfast']}
listen to_rmqfast_tls
    bind 127.0.0.1:{ports['edge_rmqfast_tls']}
    server p 127.0.0.1:{ports['rmqfast_tls']} ssl verify none
listen to_haproxy
    bind 127.0.0.1:{ports['edge_haproxy']}
    server p 127.0.0.1:{ports['mid_plain']}
listen to_haproxy_tls
    bind 127.0.0.1:{ports['edge_haproxy_tls']}
    server p 127.0.0.1:{ports['mid_tls']} ssl verify none
listen broker_plain
    bind 127.0.0.1:{ports['broker_plain']}
    server nb 127.0.0.1:{nb_port}
listen broker_tls
    bind 127.0.0.1:{ports['broker_tls']} ssl crt {pem}
    server nb 127.0.0.1:{nb_port}
"""
    return _start_haproxy(exe, workdir / "edges.cfg", cfg, [ports["edge_rmqfast"], ports["broker_tls"]])


def _haproxy_middle(exe: str, workdir: Path, pem: Path, ports: dict[str, int]) -> subprocess.Popen:
    """HAProxy in the proxy's place: plain relay, and TLS terminate + re-originate."""
    cfg = f"""global
    nbthread 1
    maxconn {HAProxyTarget.maxconn()}
    ssl-server-verify none

defaults
    mode tcp
    timeout connect 5s
    timeout client 5m
    timeout server 5m

listen mid_plain
    bind 127.0.0.1:{ports['mid_plain']}
    server b 127.0.0.1:{ports['broker_plain']}
listen mid_tls
    bind 127.0.0.1:{ports['mid_tls']} ssl crt {pem}
    server b 127.0.0.1:{ports['broker_tls']} ssl verify none
"""
    return _start_haproxy(exe, workdir / "middle.cfg", cfg, [ports["mid_plain"], ports["mid_tls"]])


def _start_haproxy(exe: str, path: Path, cfg: str, wait_ports: list[int]) -> subprocess.Popen:
    path.write_text(cfg)
    log = open(path.with_suffix(".log"), "ab")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen([exe, "-f", str(path), "-db"], stdout=log, stderr=subprocess.STDOUT)
    for p in wait_ports:
        wait_port(p, proc)
    return proc


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="send-16x32", choices=sorted(SCENARIOS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--targets", default="rmqfast,rmqfast-tls,haproxy,haproxy-tls")
    ap.add_argument("--json", help="also write every run as JSON lines to this file")
    args = ap.parse_args(argv)
    sc = SCENARIOS[args.scenario]
    targets = args.targets.split(",")
    exe = ensure_haproxy(install=False)
    if exe is None:
        print("tls_cost: HAProxy is needed for the TLS edges (apt-get install haproxy)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="rmqfast-tls-bench-"))
    certs = make_certs(workdir / "certs")
    pem = workdir / "certs" / "haproxy.pem"
    pem.write_bytes(certs.server_cert.read_bytes() + certs.server_key.read_bytes())
    tools = build_tools()
    procs: list[subprocess.Popen] = []
    proxies: dict[str, TlsBenchProxy] = {}
    nb = NullBroker(tools).start()
    try:
        ports = {k: free_port() for k in ("edge_rmqfast", "edge_rmqfast_tls", "edge_haproxy", "edge_haproxy_tls",
                                          "mid_plain", "mid_tls", "broker_plain", "broker_tls")}
        # the proxies first (their ports come from ProxyProcess's reservations), then HAProxy
        plain = TlsBenchProxy(nb.port, "")  # name server upstream: the null broker (readiness)
        plain.upstream = f"127.0.0.1:{ports['broker_plain']}"
        plain.start()
        proxies["rmqfast"] = plain
        tls = TlsBenchProxy(nb.port, (
            f'[tls.listen]\nmode = "enforcing"\ncert = "{certs.server_cert}"\nkey = "{certs.server_key}"\n'
            f'[tls.upstream]\nenable = true\nroles = ["broker"]\nca = "{certs.ca}"\nserver_name = "localhost"\n'))
        tls.upstream = f"127.0.0.1:{ports['broker_tls']}"
        tls.start()
        proxies["rmqfast-tls"] = tls
        ports["rmqfast"] = plain.endpoint_port
        ports["rmqfast_tls"] = tls.endpoint_port
        edges = _haproxy_edges(exe, workdir, pem, ports, nb.port)
        procs.append(edges)
        middle = _haproxy_middle(exe, workdir, pem, ports)
        procs.append(middle)
        entry = {"rmqfast": ports["edge_rmqfast"], "rmqfast-tls": ports["edge_rmqfast_tls"],
                 "haproxy": ports["edge_haproxy"], "haproxy-tls": ports["edge_haproxy_tls"]}
        under_test = {"rmqfast": plain.worker_pids(), "rmqfast-tls": tls.worker_pids(),
                      "haproxy": [middle.pid], "haproxy-tls": [middle.pid]}
        print(f"tls_cost: scenario {sc.name} ({sc.what}); {args.rounds} rounds x {args.duration:g} s; "
              f"{os.cpu_count()} CPUs; load average at start {_load()}; {haproxy_version(exe)}; "
              f"Python {sys.version.split()[0]}, OpenSSL via {__import__('ssl').OPENSSL_VERSION}")
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
        out = open(args.json, "a") if args.json else None  # noqa: SIM115
        for r in range(args.rounds):
            order = targets[r % len(targets):] + targets[:r % len(targets)]  # rotate: drift hits all alike
            for t in order:
                res = run_loadgen(tools, entry[t], sc, warmup=args.warmup, duration=args.duration,
                                  cpu_groups={"proxy": under_test[t], "edges": [edges.pid], "nullbroker": nb.pids})
                if res.get("errors"):
                    print(f"  {t}: {res['errors']} errors {res.get('error_detail')}", file=sys.stderr)
                    if t in proxies:
                        print(proxies[t].log_tail(10), file=sys.stderr)
                cpu = res["cpu"]["proxy"]
                done = max(1, res["responses"])
                row = {"target": t, "round": r, "rps": res["rps"], "p50_us": res["lat_us"]["p50"],
                       "p99_us": res["lat_us"]["p99"], "errors": res["errors"],
                       "proxy_cpu_us_per_req": round((cpu["user_s"] + cpu["sys_s"]) * 1e6 / done, 2),
                       "proxy_cores": cpu["cores"], "edges_cores": res["cpu"]["edges"]["cores"],
                       "other_cores": res["cpu"]["machine"]["other_cores"], "load": _load()}
                runs[t].append(row)
                print(f"  round {r} {t:12s} {row['rps']:>10,.0f} msg/s  p50 {row['p50_us']:>8.0f} us  "
                      f"p99 {row['p99_us']:>8.0f} us  proxy {row['proxy_cpu_us_per_req']:>6.1f} CPU-us/req "
                      f"({row['proxy_cores']:.2f} cores)  edges {row['edges_cores']:.2f} cores  "
                      f"others {row['other_cores']:.2f} cores  load {row['load']}")
                if out:
                    out.write(json.dumps({"scenario": sc.name, **row}) + "\n")
        if out:
            out.close()
        print("\nmedians:")
        med: dict[str, dict[str, float]] = {}
        for t in targets:
            rows = runs[t]

            def median(k: str, rows: list[dict[str, Any]] = rows) -> float:
                v = sorted(x[k] for x in rows)
                return v[len(v) // 2]

            med[t] = {k: median(k) for k in ("rps", "p50_us", "p99_us", "proxy_cpu_us_per_req")}
            m = med[t]
            print(f"  {t:12s} {m['rps']:>10,.0f} msg/s  p50 {m['p50_us']:>8.0f} us  p99 {m['p99_us']:>8.0f} us  "
                  f"{m['proxy_cpu_us_per_req']:>6.1f} CPU-us/req in the proxy")
        for base, tl in (("rmqfast", "rmqfast-tls"), ("haproxy", "haproxy-tls")):
            if base in med and tl in med:
                print(f"  {tl} / {base}: throughput x{med[tl]['rps'] / med[base]['rps']:.2f}, proxy CPU per "
                      f"request x{med[tl]['proxy_cpu_us_per_req'] / med[base]['proxy_cpu_us_per_req']:.2f} "
                      f"(+{med[tl]['proxy_cpu_us_per_req'] - med[base]['proxy_cpu_us_per_req']:.1f} us)")
        if "rmqfast-tls" in med and "haproxy-tls" in med:
            ratio = med["rmqfast-tls"]["rps"] / med["haproxy-tls"]["rps"]
            print(f"  rmqfast-tls / haproxy-tls: throughput x{ratio:.2f}")
        print(f"load average at end {_load()}")
    finally:
        for p in procs:
            stop_process(p)
        for px in proxies.values():
            px.__exit__()
        nb.stop()
        time.sleep(0.1)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What rewriting broker addresses inside messages costs (``policy.message_addresses``).

Starts the null broker and one ``rmqfast serve`` (2 workers) per mode (``off``, ``records``,
``all``), each with a static endpoint to the null broker and a port range, so the store host the
null broker writes in its pull records (127.0.0.1:10911) gets an endpoint of its own and is
really patched.  Then, rotating the order, runs the load generator against every proxy:

* ``pull``: pulls answered with 16 x 1 KiB records, 16 connections x 4 in flight;
* ``send``: 1 KiB sends, 16 connections x 32 in flight.

For each run it prints answers/s, p99 and the workers' CPU per request (user + system, from
/proc, during the measured window).  A measurement, not a test (no asserts)::

    .venv/bin/python bench/message_addresses.py [--rounds 3] [--duration 4] [--modes off,records,all]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rmqfast.bench.cbuild import build_tools
from rmqfast.bench.common import wait_serving
from rmqfast.bench.loadgen import run_loadgen
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.procfs import children
from rmqfast.bench.scenarios import Scenario
from rmqfast.testing.ports import reserve

SCENARIOS = {
    "pull": Scenario("pull", conns=16, inflight=4, pull_pct=100, topics=1),
    "send": Scenario("send", conns=16, inflight=32),
}




def start_proxy(mode: str, broker_port: int) -> tuple[subprocess.Popen[bytes], int, list[int], object]:
    lease = reserve([0, 1, 2, *range(3, 13)])
    ns, admin, endpoint, lo = lease.base, lease.base + 1, lease.base + 2, lease.base + 3
    d = Path(tempfile.mkdtemp(prefix="rmqfast-msgaddr-"))
    (d / "c.toml").write_text(f"""
[proxy]
workers = 2
state_dir = "{d}/state"
[namesrv]
listen = "127.0.0.1:{ns}"
upstreams = ["127.0.0.1:9"]
[brokers]
port_range = "{lo}-{lo + 9}"
vip_channel = false
[[brokers.static]]
listen = "127.0.0.1:{endpoint}"
upstream = "127.0.0.1:{broker_port}"
[admin]
listen = "127.0.0.1:{admin}"
[log]
level = "warning"
[policy]
message_addresses = "{mode}"
""")
    proc = subprocess.Popen([sys.executable, "-P", "-m", "rmqfast", "serve", "--config", str(d / "c.toml")],
                            stdout=subprocess.DEVNULL, stderr=open(d / "log", "wb"))
    wait_serving(proc, admin, [ns, endpoint], f"rmqfast ({mode}); see {d / 'log'}")
    while len(children(proc.pid)) < 2:
        time.sleep(0.1)
    return proc, endpoint, children(proc.pid), lease


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--modes", default="off,records,all")
    args = ap.parse_args()
    modes = args.modes.split(",")
    tools = build_tools()
    rows = []
    with NullBroker(tools) as nb:
        proxies = {m: start_proxy(m, nb.port) for m in modes}
        try:
            for r in range(args.rounds):
                for sname, sc in SCENARIOS.items():
                    order = modes if r % 2 == 0 else modes[::-1]
                    for m in order:
                        _, port, workers, _ = proxies[m]
                        res = run_loadgen(tools, port, sc, warmup=args.warmup, duration=args.duration,
                                          cpu_groups={"workers": workers})
                        cpu = res["cpu"]["workers"]
                        cpu_s = cpu["user_s"] + cpu["sys_s"]
                        answers = res["rps"] * res["duration_s"]
                        row = {"round": r, "scenario": sname, "mode": m, "rps": round(res["rps"]),
                               "p99_us": res["lat_us"]["p99"], "errors": res["errors"],
                               "worker_cpu_us_per_req": round(1e6 * cpu_s / max(answers, 1), 1)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            for proc, *_ in proxies.values():
                proc.terminate()
                proc.wait()
    print("\nmedian worker CPU us per request (answers/s):")
    for sname in SCENARIOS:
        for m in modes:
            sel = sorted(x["worker_cpu_us_per_req"] for x in rows if x["scenario"] == sname and x["mode"] == m)
            rps = sorted(x["rps"] for x in rows if x["scenario"] == sname and x["mode"] == m)
            print(f"  {sname:5} {m:8} {sel[len(sel) // 2]:7.1f} us  ({rps[len(rps) // 2]} /s)")


if __name__ == "__main__":
    main()
